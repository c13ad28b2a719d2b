// CPU backend of the zero_ext ops: validate (checks.h, scalars.h) before any write, then call the
// torch-free kernels in csrc/cpu. Scalar tensors are read with .item(): on the CPU that is no sync.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "../adamw_math.h"
#include "../cpu/kernels.h"
#include "../stochastic_rounding.h"
#include "checks.h"
#include "scalars.h"

namespace zero_ext {
namespace {

void fused_adamw_cpu(
    const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
    double weight_decay, double step, double grad_scale, const std::optional<at::Tensor>& lr_tensor,
    const std::optional<at::Tensor>& beta1_tensor, const std::optional<at::Tensor>& beta2_tensor,
    const std::optional<at::Tensor>& eps_tensor,
    const std::optional<at::Tensor>& weight_decay_tensor,
    const std::optional<at::Tensor>& step_tensor,
    const std::optional<at::Tensor>& grad_scale_tensor, const std::optional<at::Tensor>& param_out,
    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& max_exp_avg_sq,
    bool maximize, const std::optional<at::Tensor>& remainder, int64_t rounding_seed,
    int64_t element_offset) {
  check_fused_adamw_args(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, found_inf,
                         remainder, element_offset);
  // A skipped step is a no-op before its scalars are read: the step that found the inf is the one
  // whose clip coefficient is nan and, when it is a parameter's first, whose step count is still 0
  // (the CUDA kernel reads found_inf first too).
  if (found_inf.has_value() && found_inf->item<double>() != 0.0) return;
  const AdamWScalars s = resolve_adamw_scalars({{lr, lr_tensor},
                                                {beta1, beta1_tensor},
                                                {beta2, beta2_tensor},
                                                {eps, eps_tensor},
                                                {weight_decay, weight_decay_tensor},
                                                {step, step_tensor},
                                                {grad_scale, grad_scale_tensor}},
                                               master.device());
  TORCH_INTERNAL_ASSERT(s.all_on_host());  // master is on the CPU, so every scalar tensor is too
  const int64_t n = master.numel();
  if (n == 0) return;
  const AdamWCoefficients coeffs =
      adamw_coefficients(s.lr.value, s.beta1.value, s.beta2.value, s.eps.value,
                         s.weight_decay.value, s.step.value, s.grad_scale.value, maximize);
  // With a remainder the kernel's master is the bf16 parameter (`master`) joined with it.
  const bool split = remainder.has_value();
  cpu::AdamWTensors t;
  t.master = split ? nullptr : master.data_ptr<float>();
  t.grad = grad.const_data_ptr();
  t.grad_dtype = to_kernel_dtype(grad, "fused_adamw_", "grad");
  t.exp_avg = exp_avg.data_ptr();
  t.exp_avg_sq = exp_avg_sq.data_ptr();
  t.max_exp_avg_sq = max_exp_avg_sq.has_value() ? max_exp_avg_sq->data_ptr() : nullptr;
  t.moment_dtype = to_kernel_dtype(exp_avg, "fused_adamw_", "exp_avg");
  t.param_out = split ? master.data_ptr() : param_out.has_value() ? param_out->data_ptr() : nullptr;
  t.param_out_dtype = param_out.has_value()
                          ? to_kernel_dtype(*param_out, "fused_adamw_", "param_out")
                          : DType::kBFloat16;
  t.remainder = split ? remainder->data_ptr<int16_t>() : nullptr;
  t.rounding_key = rounding_key(rounding_seed, s.step.value);
  t.element_offset = static_cast<uint64_t>(element_offset);
  cpu::fused_adamw(t, n, coeffs, at::get_num_threads());
}

void flatten_cpu(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                 double scale) {
  const auto slices = check_flatten_args(flat, tensors, offsets, "flatten_", false);
  if (slices.empty() || flat.numel() == 0) return;
  cpu::flatten(flat.data_ptr(), to_kernel_dtype(flat, "flatten_", "flat"), slices.data(),
               static_cast<int64_t>(slices.size()), static_cast<float>(scale), true,
               at::get_num_threads());
}

void unflatten_cpu(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                   double scale) {
  const auto slices = check_flatten_args(flat, tensors, offsets, "unflatten_", true);
  if (slices.empty() || flat.numel() == 0) return;
  cpu::flatten(const_cast<void*>(flat.const_data_ptr()),
               to_kernel_dtype(flat, "unflatten_", "flat"), slices.data(),
               static_cast<int64_t>(slices.size()), static_cast<float>(scale), false,
               at::get_num_threads());
}

std::tuple<at::Tensor, at::Tensor> sum_squares_cpu(const at::Tensor& x) {
  const DType dtype = to_kernel_dtype(x, "sum_squares", "x");
  TORCH_CHECK(x.is_contiguous() && x.layout() == at::kStrided,
              "zero_ext.sum_squares: `x` must be a contiguous dense tensor");
  at::Tensor sumsq = at::zeros({}, x.options().dtype(at::kFloat));
  at::Tensor nonfinite = at::zeros({}, x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    cpu::sum_squares(x.const_data_ptr(), dtype, x.numel(), sumsq.data_ptr<float>(),
                     nonfinite.data_ptr<float>(), at::get_num_threads());
  }
  return {sumsq, nonfinite};
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("fused_adamw_", &zero_ext::fused_adamw_cpu);
  m.impl("flatten_", &zero_ext::flatten_cpu);
  m.impl("unflatten_", &zero_ext::unflatten_cpu);
  m.impl("sum_squares", &zero_ext::sum_squares_cpu);
}
