#include "scalars.h"

#include <cmath>

namespace zero_ext {
namespace {

// Written so that NaN fails every rule.
bool finite_nonnegative(double v) { return v >= 0.0 && std::isfinite(v); }
bool unit_interval(double v) { return v >= 0.0 && v < 1.0; }
bool at_least_one(double v) { return v >= 1.0 && std::isfinite(v); }
bool finite(double v) { return std::isfinite(v); }

struct Rule {
  const char* name;
  bool (*valid)(double);
  const char* expected;
};

ResolvedScalar resolve(const ScalarArg& arg, const at::Device& device, const Rule& rule) {
  ResolvedScalar out;
  if (arg.tensor.has_value()) {
    const at::Tensor& t = *arg.tensor;
    check_scalar_tensor(t, device, rule.name);
    if (!t.device().is_cpu()) {
      out.device_tensor = t;  // the caller vouches for it (see scalars.h)
      return out;
    }
    out.value = t.item<double>();  // a CPU tensor: no device sync
  } else {
    out.value = arg.number;
  }
  TORCH_CHECK(rule.valid(out.value), "zero_ext.fused_adamw_: `", rule.name, "` must be ",
              rule.expected, ", got ", out.value, arg.tensor.has_value() ? " (a CPU tensor)" : "");
  return out;
}

}  // namespace

bool AdamWScalars::all_on_host() const {
  for (const ResolvedScalar* s : {&lr, &beta1, &beta2, &eps, &weight_decay, &step, &grad_scale}) {
    if (s->on_device()) return false;
  }
  return true;
}

void check_scalar_tensor(const at::Tensor& t, const at::Device& device, const char* arg) {
  TORCH_CHECK(t.numel() == 1, "zero_ext.fused_adamw_: `", arg,
              "` must be a Python number or a tensor with one element, got shape ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isIntegralType(t.scalar_type(), false),
              "zero_ext.fused_adamw_: `", arg, "` must be a floating or integer tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device || t.device().is_cpu(), "zero_ext.fused_adamw_: `", arg,
              "` must be on the CPU or on ", device, " (like `master`), got ", t.device());
}

AdamWScalars resolve_adamw_scalars(const AdamWScalarArgs& a, const at::Device& device) {
  const char* kFiniteNonnegative = "a finite value >= 0";
  AdamWScalars s;
  s.lr = resolve(a.lr, device, {"lr", finite_nonnegative, kFiniteNonnegative});
  s.beta1 = resolve(a.beta1, device, {"beta1", unit_interval, "in [0, 1)"});
  s.beta2 = resolve(a.beta2, device, {"beta2", unit_interval, "in [0, 1)"});
  s.eps = resolve(a.eps, device, {"eps", finite_nonnegative, kFiniteNonnegative});
  s.weight_decay =
      resolve(a.weight_decay, device, {"weight_decay", finite_nonnegative, kFiniteNonnegative});
  s.step = resolve(a.step, device,
                   {"step", at_least_one, "finite and >= 1 (the count including this update)"});
  s.grad_scale = resolve(a.grad_scale, device, {"grad_scale", finite, "finite"});
  return s;
}

}  // namespace zero_ext
