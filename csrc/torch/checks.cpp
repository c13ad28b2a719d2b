#include "checks.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace zero_ext {
namespace {

void check_scalar_tensor(const std::optional<at::Tensor>& t, const at::Tensor& master,
                         const char* arg) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->numel() == 1, "zero_ext.fused_adamw_: `", arg,
              "` must be a Python number or a tensor with one element, got shape ", t->sizes());
  TORCH_CHECK(at::isFloatingType(t->scalar_type()) || at::isIntegralType(t->scalar_type(), false),
              "zero_ext.fused_adamw_: `", arg, "` must be a floating or integer tensor, got ",
              t->scalar_type());
  TORCH_CHECK(t->device() == master.device() || t->device().is_cpu(), "zero_ext.fused_adamw_: `",
              arg, "` must be on ", master.device(), " (like `master`) or the CPU, got ",
              t->device());
}

void check_state_tensor(const at::Tensor& t, const at::Tensor& master, const char* arg) {
  TORCH_CHECK(t.device() == master.device(), "zero_ext.fused_adamw_: `", arg,
              "` must be on the same device as `master` (", master.device(), "), got ", t.device());
  TORCH_CHECK(t.numel() == master.numel(), "zero_ext.fused_adamw_: `", arg,
              "` must have the same number of elements as `master` (", master.numel(), "), got ",
              t.numel());
  TORCH_CHECK(t.is_contiguous(), "zero_ext.fused_adamw_: `", arg, "` must be contiguous");
  TORCH_CHECK(t.layout() == at::kStrided, "zero_ext.fused_adamw_: `", arg,
              "` must be a dense (strided) tensor, got layout ", t.layout());
}

}  // namespace

DType to_kernel_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "zero_ext.", op, ": `", arg,
                  "` must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

void check_adamw_hyperparameters(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, double step) {
  // Written so that NaN fails every check.
  TORCH_CHECK(lr >= 0.0 && std::isfinite(lr),
              "zero_ext.fused_adamw_: `lr` must be a finite value >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "zero_ext.fused_adamw_: `beta1` must be in [0, 1), got ",
              beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "zero_ext.fused_adamw_: `beta2` must be in [0, 1), got ",
              beta2);
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps),
              "zero_ext.fused_adamw_: `eps` must be a finite value >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0 && std::isfinite(weight_decay),
              "zero_ext.fused_adamw_: `weight_decay` must be a finite value >= 0, got ",
              weight_decay);
  TORCH_CHECK(step >= 1.0 && std::isfinite(step),
              "zero_ext.fused_adamw_: `step` must be >= 1 (the count including this update), got ",
              step);
}

void check_fused_adamw_args(const at::Tensor& master, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const std::optional<at::Tensor>& param_out,
                            const std::optional<at::Tensor>& found_inf, const AdamWScalarArgs& s) {
  TORCH_CHECK(master.scalar_type() == at::kFloat,
              "zero_ext.fused_adamw_: `master` must be float32, got ", master.scalar_type());
  TORCH_CHECK(master.is_contiguous() && master.layout() == at::kStrided,
              "zero_ext.fused_adamw_: `master` must be a contiguous dense tensor");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat,
              "zero_ext.fused_adamw_: `exp_avg` must be float32, got ", exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat,
              "zero_ext.fused_adamw_: `exp_avg_sq` must be float32, got ",
              exp_avg_sq.scalar_type());
  to_kernel_dtype(grad, "fused_adamw_", "grad");
  check_state_tensor(grad, master, "grad");
  check_state_tensor(exp_avg, master, "exp_avg");
  check_state_tensor(exp_avg_sq, master, "exp_avg_sq");
  if (param_out.has_value()) {
    TORCH_CHECK(param_out->scalar_type() == at::kBFloat16 || param_out->scalar_type() == at::kHalf,
                "zero_ext.fused_adamw_: `param_out` must be bfloat16 or float16, got ",
                param_out->scalar_type());
    check_state_tensor(*param_out, master, "param_out");
  }
  if (found_inf.has_value()) check_scalar_tensor(found_inf, master, "found_inf");
  check_scalar_tensor(s.lr_t, master, "lr");
  check_scalar_tensor(s.beta1_t, master, "beta1");
  check_scalar_tensor(s.beta2_t, master, "beta2");
  check_scalar_tensor(s.eps_t, master, "eps");
  check_scalar_tensor(s.weight_decay_t, master, "weight_decay");
  check_scalar_tensor(s.step_t, master, "step");
  check_scalar_tensor(s.grad_scale_t, master, "grad_scale");
  // Host-known values are checked here; values inside tensors are checked where they can be read
  // without a device sync (the CPU path), placeholder values stand in for them otherwise.
  check_adamw_hyperparameters(s.lr_t ? 0.0 : s.lr, s.beta1_t ? 0.0 : s.beta1,
                              s.beta2_t ? 0.0 : s.beta2, s.eps_t ? 0.0 : s.eps,
                              s.weight_decay_t ? 0.0 : s.weight_decay, s.step_t ? 1.0 : s.step);
  TORCH_CHECK(s.grad_scale_t.has_value() || std::isfinite(s.grad_scale),
              "zero_ext.fused_adamw_: `grad_scale` must be finite, got ", s.grad_scale);
  // In-place outputs must not share memory: the update would read values it already wrote.
  if (master.numel() > 0) {
    TORCH_CHECK(
        master.data_ptr() != exp_avg.data_ptr() && master.data_ptr() != exp_avg_sq.data_ptr() &&
            exp_avg.data_ptr() != exp_avg_sq.data_ptr(),
        "zero_ext.fused_adamw_: `master`, `exp_avg` and `exp_avg_sq` must be distinct tensors");
  }
}

std::vector<TensorSlice> check_flatten_args(const at::Tensor& flat, at::TensorList tensors,
                                            at::IntArrayRef offsets, const char* op,
                                            bool tensors_are_outputs) {
  to_kernel_dtype(flat, op, "flat");
  TORCH_CHECK(flat.is_contiguous() && flat.layout() == at::kStrided, "zero_ext.", op,
              ": `flat` must be a contiguous dense tensor");
  TORCH_CHECK(offsets.size() == tensors.size(), "zero_ext.", op, ": `offsets` has ", offsets.size(),
              " entries but `tensors` has ", tensors.size());
  std::vector<TensorSlice> slices;
  slices.reserve(tensors.size());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string arg = "tensors[" + std::to_string(i) + "]";
    DType dt = to_kernel_dtype(t, op, arg.c_str());
    TORCH_CHECK(t.device() == flat.device(), "zero_ext.", op, ": `", arg, "` is on ", t.device(),
                " but `flat` is on ", flat.device());
    TORCH_CHECK(t.is_contiguous() && t.layout() == at::kStrided, "zero_ext.", op, ": `", arg,
                "` must be a contiguous dense tensor");
    const int64_t off = offsets[i];
    TORCH_CHECK(off >= 0 && off + t.numel() <= flat.numel(), "zero_ext.", op, ": `", arg, "` (",
                t.numel(), " elements at offset ", off, ") does not fit in `flat` (", flat.numel(),
                " elements)");
    if (t.numel() > 0) ranges.emplace_back(off, off + t.numel());
    slices.push_back(TensorSlice{t.numel() > 0 ? t.data_ptr() : nullptr, t.numel(), off, dt, 0});
  }
  if (!tensors_are_outputs) {
    // flatten_ writes the ranges: overlapping ranges would make the result order-dependent.
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) {
      TORCH_CHECK(ranges[i].first >= ranges[i - 1].second, "zero_ext.", op,
                  ": destination ranges overlap in `flat` ([", ranges[i - 1].first, ", ",
                  ranges[i - 1].second, ") and [", ranges[i].first, ", ", ranges[i].second, "))");
    }
  }
  return slices;
}

}  // namespace zero_ext
