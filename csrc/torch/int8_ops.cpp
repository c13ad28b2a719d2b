// zero_ext::fused_adamw_int8_: the schema (a fragment of the zero_ext library, so registration.cpp
// is untouched) and its CPU backend. The CUDA backend is cuda_int8_ops.cpp (CUDA builds only).
// Python wrapper and fake: zero_ext/ops/int8.py; reference: tests/helpers/int8_reference.py.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "../adamw_math.h"
#include "../cpu/fused_adamw_int8.h"
#include "checks.h"
#include "int8_checks.h"
#include "scalars.h"

namespace zero_ext {
namespace {

void fused_adamw_int8_cpu(
    const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg_codes,
    const at::Tensor& exp_avg_scales, const at::Tensor& exp_avg_sq_codes,
    const at::Tensor& exp_avg_sq_scales, int64_t block, double lr, double beta1, double beta2,
    double eps, double weight_decay, double step, double grad_scale,
    const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& beta1_tensor,
    const std::optional<at::Tensor>& beta2_tensor, const std::optional<at::Tensor>& eps_tensor,
    const std::optional<at::Tensor>& weight_decay_tensor,
    const std::optional<at::Tensor>& step_tensor,
    const std::optional<at::Tensor>& grad_scale_tensor, const std::optional<at::Tensor>& param_out,
    const std::optional<at::Tensor>& found_inf, bool maximize,
    const std::optional<at::Tensor>& remainder,
    const std::optional<at::Tensor>& max_exp_avg_sq_codes,
    const std::optional<at::Tensor>& max_exp_avg_sq_scales) {
  check_fused_adamw_int8_args(master, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                              exp_avg_sq_scales, block, param_out, found_inf, remainder,
                              max_exp_avg_sq_codes, max_exp_avg_sq_scales);
  // A skipped step changes no byte of the compressed state, before its scalars are read.
  if (found_inf.has_value() && found_inf->item<double>() != 0.0) return;
  const AdamWScalars s = resolve_adamw_scalars({{lr, lr_tensor},
                                                {beta1, beta1_tensor},
                                                {beta2, beta2_tensor},
                                                {eps, eps_tensor},
                                                {weight_decay, weight_decay_tensor},
                                                {step, step_tensor},
                                                {grad_scale, grad_scale_tensor}},
                                               master.device());
  TORCH_INTERNAL_ASSERT(s.all_on_host());
  const int64_t n = master.numel();
  if (n == 0) return;
  const AdamWCoefficients coeffs =
      adamw_coefficients(s.lr.value, s.beta1.value, s.beta2.value, s.eps.value,
                         s.weight_decay.value, s.step.value, s.grad_scale.value, maximize);
  const bool split = remainder.has_value();
  Int8AdamWBuffers b{};
  b.master = split ? nullptr : master.data_ptr<float>();
  b.grad = grad.const_data_ptr();
  b.grad_dtype = to_kernel_dtype(grad, "fused_adamw_int8_", "grad");
  b.exp_avg_codes = exp_avg_codes.data_ptr<int8_t>();
  b.exp_avg_scales = exp_avg_scales.data_ptr<float>();
  b.exp_avg_sq_codes = exp_avg_sq_codes.data_ptr<int8_t>();
  b.exp_avg_sq_scales = exp_avg_sq_scales.data_ptr<float>();
  b.param_out = split ? master.data_ptr() : param_out.has_value() ? param_out->data_ptr() : nullptr;
  b.param_out_dtype = param_out.has_value()
                          ? to_kernel_dtype(*param_out, "fused_adamw_int8_", "param_out")
                          : DType::kBFloat16;
  b.remainder = split ? remainder->data_ptr<int16_t>() : nullptr;
  if (max_exp_avg_sq_codes.has_value()) {  // amsgrad (the checks made sure both are given)
    b.max_exp_avg_sq_codes = max_exp_avg_sq_codes->data_ptr<int8_t>();
    b.max_exp_avg_sq_scales = max_exp_avg_sq_scales->data_ptr<float>();
  }
  b.n = n;
  b.block = block;
  cpu::fused_adamw_int8(b, coeffs, at::get_num_threads());
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_FRAGMENT(zero_ext, m) {
  m.def(
      "fused_adamw_int8_(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg_codes, "
      "Tensor(c!) exp_avg_scales, Tensor(d!) exp_avg_sq_codes, Tensor(e!) exp_avg_sq_scales, *, "
      "int block, float lr, float beta1, float beta2, float eps, float weight_decay, float step, "
      "float grad_scale=1.0, Tensor? lr_tensor=None, Tensor? beta1_tensor=None, "
      "Tensor? beta2_tensor=None, Tensor? eps_tensor=None, Tensor? weight_decay_tensor=None, "
      "Tensor? step_tensor=None, Tensor? grad_scale_tensor=None, Tensor(f!)? param_out=None, "
      "Tensor? found_inf=None, bool maximize=False, Tensor(g!)? remainder=None, "
      "Tensor(h!)? max_exp_avg_sq_codes=None, Tensor(i!)? max_exp_avg_sq_scales=None) -> ()");
}

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("fused_adamw_int8_", &zero_ext::fused_adamw_int8_cpu);
}
