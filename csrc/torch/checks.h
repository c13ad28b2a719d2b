// Argument validation shared by the CPU and CUDA bindings. Every check runs before any tensor is
// written, so a rejected call leaves all state untouched. Messages name the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "../dtype.h"

namespace zero_ext {

// at::ScalarType -> DType for fp32/bf16/fp16; anything else is a TORCH_CHECK error naming `arg`.
DType to_kernel_dtype(const at::Tensor& t, const char* op, const char* arg);

// The seven AdamW scalars after resolving Python numbers vs 0-d tensors.
struct AdamWScalarArgs {
  double lr, beta1, beta2, eps, weight_decay, step, grad_scale;
  std::optional<at::Tensor> lr_t, beta1_t, beta2_t, eps_t, weight_decay_t, step_t, grad_scale_t;
};

// Shapes, dtypes, devices, contiguity and numel of fused_adamw_'s tensors, and the host-known
// hyperparameter ranges (lr >= 0, eps >= 0, weight_decay >= 0, 0 <= beta < 1, step >= 1). Scalar
// tensors must hold one element and live on master's device or the CPU.
void check_fused_adamw_args(const at::Tensor& master, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const std::optional<at::Tensor>& param_out,
                            const std::optional<at::Tensor>& found_inf, const AdamWScalarArgs& s);

// Validates hyperparameters once their values are known on the host (CPU path reads the tensors).
void check_adamw_hyperparameters(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, double step);

// flatten_/unflatten_: flat is a contiguous fp32/bf16/fp16 buffer; tensors contiguous, same device,
// fp32/bf16/fp16; offsets.size() == tensors.size(); every range inside flat; destination ranges of
// flatten_ must not overlap. Returns the slice records (host memory).
std::vector<TensorSlice> check_flatten_args(const at::Tensor& flat, at::TensorList tensors,
                                            at::IntArrayRef offsets, const char* op,
                                            bool tensors_are_outputs);

}  // namespace zero_ext
