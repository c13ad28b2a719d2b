// CUDA backend of zero_ext::fused_adamw_int8_ (CUDA builds only; the schema is in int8_ops.cpp).
// NEVER RUN: written on a machine without a GPU. As cuda_ops.cpp: validate before any launch, no
// host synchronisation (device scalars and found_inf are read by the kernel).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "../cuda/fused_adamw_int8.h"
#include "checks.h"
#include "int8_checks.h"
#include "scalars.h"

namespace zero_ext {
namespace {

cuda::DeviceScalar device_scalar(const ResolvedScalar& s, std::vector<at::Tensor>& keep) {
  if (!s.on_device()) return {s.value, nullptr};
  const at::Tensor& t = s.device_tensor;
  keep.push_back(t.scalar_type() == at::kFloat ? t : t.to(at::kFloat));  // async on the stream
  return {0.0, keep.back().const_data_ptr<float>()};
}

void fused_adamw_int8_cuda(
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
  TORCH_CHECK(master.is_cuda(), "zero_ext.fused_adamw_int8_: `master` must be a CUDA tensor, got ",
              master.device());
  check_fused_adamw_int8_args(master, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                              exp_avg_sq_scales, block, param_out, found_inf, remainder,
                              max_exp_avg_sq_codes, max_exp_avg_sq_scales);
  const AdamWScalars s = resolve_adamw_scalars({{lr, lr_tensor},
                                                {beta1, beta1_tensor},
                                                {beta2, beta2_tensor},
                                                {eps, eps_tensor},
                                                {weight_decay, weight_decay_tensor},
                                                {step, step_tensor},
                                                {grad_scale, grad_scale_tensor}},
                                               master.device());
  const bool found_inf_on_host = found_inf.has_value() && found_inf->device().is_cpu();
  if (found_inf_on_host && found_inf->item<double>() != 0.0) return;
  const int64_t n = master.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(master.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<at::Tensor> keep;
  keep.reserve(8);
  cuda::AdamWArgs args{};
  args.lr = device_scalar(s.lr, keep);
  args.beta1 = device_scalar(s.beta1, keep);
  args.beta2 = device_scalar(s.beta2, keep);
  args.eps = device_scalar(s.eps, keep);
  args.weight_decay = device_scalar(s.weight_decay, keep);
  args.step = device_scalar(s.step, keep);
  args.grad_scale = device_scalar(s.grad_scale, keep);
  args.maximize = maximize;
  if (found_inf.has_value() && !found_inf_on_host) {
    keep.push_back(found_inf->scalar_type() == at::kFloat ? *found_inf : found_inf->to(at::kFloat));
    args.found_inf = keep.back().const_data_ptr<float>();
  }
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
  C10_CUDA_CHECK(cuda::launch_fused_adamw_int8(b, args, stream));
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CUDA, m) {
  m.impl("fused_adamw_int8_", &zero_ext::fused_adamw_int8_cuda);
}
