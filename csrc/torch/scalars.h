// fused_adamw_'s seven scalars (lr, beta1, beta2, eps, weight_decay, step, grad_scale), each a
// Python number or a one-element tensor, resolved in one place for the CPU and CUDA bindings.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace zero_ext {

// One scalar as the schema passes it: `number`, unless `tensor` is given (then `number` is unused).
struct ScalarArg {
  double number;
  std::optional<at::Tensor> tensor;
};

struct AdamWScalarArgs {
  ScalarArg lr, beta1, beta2, eps, weight_decay, step, grad_scale;
};

// A resolved scalar: known on the host (`value`), or held by a one-element tensor on the op's
// (non-CPU) device that the kernel reads itself (`device_tensor` defined, `value` unused).
struct ResolvedScalar {
  double value = 0.0;
  at::Tensor device_tensor;
  bool on_device() const { return device_tensor.defined(); }
};

struct AdamWScalars {
  ResolvedScalar lr, beta1, beta2, eps, weight_decay, step, grad_scale;
  bool all_on_host() const;
};

// Checks every scalar tensor (one element, floating or integer dtype, on `device` or the CPU),
// reads CPU tensors (item(): no device sync) and validates every value known on the host:
// lr, eps, weight_decay finite and >= 0; beta1, beta2 in [0, 1); step finite and >= 1; grad_scale
// finite. A value in a tensor on `device` (not the CPU) is neither read nor validated: reading it
// would synchronise with the host. When `device` is the CPU every result is known on the host.
AdamWScalars resolve_adamw_scalars(const AdamWScalarArgs& args, const at::Device& device);

// A tensor given for a scalar (`arg`; also found_inf) must hold one floating or integer element
// and live on `device` or the CPU.
void check_scalar_tensor(const at::Tensor& t, const at::Device& device, const char* arg);

}  // namespace zero_ext
