// CUDA backend of the zero_ext ops (built only when torch has CUDA): validate (checks.h) before any
// launch, then call the torch-free launchers in csrc/cuda on the current stream.
//
// No host synchronisation anywhere: a scalar given as a device tensor is handed to the kernel as a
// pointer (converted to fp32 on the stream first when it is not fp32) and found_inf is read by the
// kernel itself. Scalars given as CPU tensors are read with .item() (no device sync) and validated
// like Python numbers.
//
// The current stream comes from c10/cuda/CUDAStream.h: at::cuda::getCurrentCUDAStream is the same
// function re-exported by ATen/cuda/CUDAContext.h, which also pulls in cuBLAS/cuSPARSE headers that
// this file does not need (and that a compile-only CUDA toolkit may lack).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "../cuda/kernels.h"
#include "checks.h"

namespace zero_ext {
namespace {

bool on_host(const std::optional<at::Tensor>& t) { return t.has_value() && t->device().is_cpu(); }
bool on_device(const std::optional<at::Tensor>& t) {
  return t.has_value() && !t->device().is_cpu();
}

// The host-known value of a scalar: the Python number, or the CPU tensor's value (no sync).
double host_value(double number, const std::optional<at::Tensor>& t) {
  return on_host(t) ? t->item<double>() : number;
}

// Device pointer to a device scalar as fp32. `keep` owns the converted copy until after the launch;
// freeing it then is safe because the caching allocator reuses it only in stream order.
const float* device_fp32(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  keep.push_back(t.scalar_type() == at::kFloat ? t : t.to(at::kFloat));  // async on the stream
  return keep.back().const_data_ptr<float>();
}

cuda::DeviceScalar resolve(double value, const std::optional<at::Tensor>& t,
                           std::vector<at::Tensor>& keep) {
  if (on_device(t)) return {0.0, device_fp32(*t, keep)};
  return {value, nullptr};
}

void fused_adamw_cuda(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2,
                      double eps, double weight_decay, double step, double grad_scale,
                      const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& beta1_tensor,
                      const std::optional<at::Tensor>& beta2_tensor,
                      const std::optional<at::Tensor>& eps_tensor,
                      const std::optional<at::Tensor>& weight_decay_tensor,
                      const std::optional<at::Tensor>& step_tensor,
                      const std::optional<at::Tensor>& grad_scale_tensor,
                      const std::optional<at::Tensor>& param_out,
                      const std::optional<at::Tensor>& found_inf) {
  // --- validation: everything below this block may write ---
  TORCH_CHECK(master.is_cuda(), "zero_ext.fused_adamw_: `master` must be a CUDA tensor, got ",
              master.device());
  const AdamWScalarArgs s{lr,           beta1,
                          beta2,        eps,
                          weight_decay, step,
                          grad_scale,   lr_tensor,
                          beta1_tensor, beta2_tensor,
                          eps_tensor,   weight_decay_tensor,
                          step_tensor,  grad_scale_tensor};
  check_fused_adamw_args(master, grad, exp_avg, exp_avg_sq, param_out, found_inf, s);
  lr = host_value(lr, lr_tensor);
  beta1 = host_value(beta1, beta1_tensor);
  beta2 = host_value(beta2, beta2_tensor);
  eps = host_value(eps, eps_tensor);
  weight_decay = host_value(weight_decay, weight_decay_tensor);
  step = host_value(step, step_tensor);
  grad_scale = host_value(grad_scale, grad_scale_tensor);
  // Values in device tensors cannot be checked without a sync; valid placeholders stand in.
  check_adamw_hyperparameters(
      on_device(lr_tensor) ? 0.0 : lr, on_device(beta1_tensor) ? 0.0 : beta1,
      on_device(beta2_tensor) ? 0.0 : beta2, on_device(eps_tensor) ? 0.0 : eps,
      on_device(weight_decay_tensor) ? 0.0 : weight_decay, on_device(step_tensor) ? 1.0 : step);
  TORCH_CHECK(on_device(grad_scale_tensor) || std::isfinite(grad_scale),
              "zero_ext.fused_adamw_: `grad_scale` must be finite, got ", grad_scale);
  if (on_host(found_inf) && found_inf->item<double>() != 0.0) return;
  const int64_t n = master.numel();
  if (n == 0) return;
  const DType grad_dtype = to_kernel_dtype(grad, "fused_adamw_", "grad");
  const DType out_dtype = param_out.has_value()
                              ? to_kernel_dtype(*param_out, "fused_adamw_", "param_out")
                              : DType::kBFloat16;  // unused without param_out

  // --- launch ---
  const c10::cuda::CUDAGuard guard(master.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<at::Tensor> keep;
  keep.reserve(8);
  cuda::AdamWArgs args{};
  args.lr = resolve(lr, lr_tensor, keep);
  args.beta1 = resolve(beta1, beta1_tensor, keep);
  args.beta2 = resolve(beta2, beta2_tensor, keep);
  args.eps = resolve(eps, eps_tensor, keep);
  args.weight_decay = resolve(weight_decay, weight_decay_tensor, keep);
  args.step = resolve(step, step_tensor, keep);
  args.grad_scale = resolve(grad_scale, grad_scale_tensor, keep);
  args.found_inf = on_device(found_inf) ? device_fp32(*found_inf, keep) : nullptr;
  void* out = param_out.has_value() ? param_out->data_ptr() : nullptr;
  C10_CUDA_CHECK(cuda::launch_fused_adamw(
      master.data_ptr<float>(), grad.const_data_ptr(), grad_dtype, exp_avg.data_ptr<float>(),
      exp_avg_sq.data_ptr<float>(), out, out_dtype, n, args, stream));
}

// flatten_ (to_flat) and unflatten_: one H2D copy of the slice records, one kernel launch.
void flatten_common(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                    double scale, bool to_flat) {
  const char* op = to_flat ? "flatten_" : "unflatten_";
  TORCH_CHECK(flat.is_cuda(), "zero_ext.", op, ": `flat` must be a CUDA tensor, got ",
              flat.device());
  const std::vector<TensorSlice> slices =
      check_flatten_args(flat, tensors, offsets, op, /*tensors_are_outputs=*/!to_flat);
  const DType flat_dtype = to_kernel_dtype(flat, op, "flat");
  int64_t max_numel = 0;
  for (const TensorSlice& sl : slices) max_numel = std::max(max_numel, sl.numel);
  if (max_numel == 0) return;

  const c10::cuda::CUDAGuard guard(flat.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t bytes = static_cast<int64_t>(slices.size() * sizeof(TensorSlice));
  // Pinned staging from the caching host allocator. A non_blocking copy from pinned memory records
  // an event on the current stream with that allocator (ATen's copy_ does it), so the block is not
  // handed out again before the copy has read it, although `host` is released when we return.
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), slices.data(), static_cast<size_t>(bytes));
  const at::Tensor records = host.to(flat.device(), /*non_blocking=*/true);
  C10_CUDA_CHECK(cuda::launch_flatten(const_cast<void*>(flat.const_data_ptr()), flat_dtype,
                                      static_cast<const TensorSlice*>(records.const_data_ptr()),
                                      static_cast<int64_t>(slices.size()), max_numel,
                                      static_cast<float>(scale), to_flat, stream));
}

void flatten_cuda(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                  double scale) {
  flatten_common(flat, tensors, offsets, scale, /*to_flat=*/true);
}

void unflatten_cuda(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                    double scale) {
  flatten_common(flat, tensors, offsets, scale, /*to_flat=*/false);
}

std::tuple<at::Tensor, at::Tensor> sum_squares_cuda(const at::Tensor& x) {
  const DType dtype = to_kernel_dtype(x, "sum_squares", "x");
  TORCH_CHECK(x.is_cuda(), "zero_ext.sum_squares: `x` must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.is_contiguous() && x.layout() == at::kStrided,
              "zero_ext.sum_squares: `x` must be a contiguous dense tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
  // Both outputs are written by the kernel (zeros for an empty x): no memset needed.
  at::Tensor sumsq = at::empty({}, fp32);
  at::Tensor nonfinite = at::empty({}, fp32);
  at::Tensor workspace = at::empty({cuda::sum_squares_workspace_size(x.numel())}, fp32);
  C10_CUDA_CHECK(cuda::launch_sum_squares(x.const_data_ptr(), dtype, x.numel(),
                                          sumsq.data_ptr<float>(), nonfinite.data_ptr<float>(),
                                          workspace.data_ptr<float>(), stream));
  return {sumsq, nonfinite};
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CUDA, m) {
  m.impl("fused_adamw_", &zero_ext::fused_adamw_cuda);
  m.impl("flatten_", &zero_ext::flatten_cuda);
  m.impl("unflatten_", &zero_ext::unflatten_cuda);
  m.impl("sum_squares", &zero_ext::sum_squares_cuda);
}
