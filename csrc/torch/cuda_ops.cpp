// CUDA backend of the zero_ext ops (built only when torch has CUDA): validate (checks.h, scalars.h)
// before any launch, then call the torch-free launchers in csrc/cuda on the current stream.
//
// No host synchronisation anywhere: a scalar given as a device tensor is handed to the kernel as a
// pointer (converted to fp32 on the stream first when it is not fp32), unvalidated, and found_inf
// is read by the kernel itself. Scalars given as CPU tensors are read with .item() (no device sync)
// and validated like Python numbers (resolve_adamw_scalars).
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
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "../cuda/kernels.h"
#include "checks.h"
#include "scalars.h"

namespace zero_ext {
namespace {

// Device pointer to a device scalar as fp32. `keep` owns the converted copy until after the launch;
// freeing it then is safe because the caching allocator reuses it only in stream order.
const float* device_fp32(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  keep.push_back(t.scalar_type() == at::kFloat ? t : t.to(at::kFloat));  // async on the stream
  return keep.back().const_data_ptr<float>();
}

cuda::DeviceScalar device_scalar(const ResolvedScalar& s, std::vector<at::Tensor>& keep) {
  if (s.on_device()) return {0.0, device_fp32(s.device_tensor, keep)};
  return {s.value, nullptr};
}

void fused_adamw_cuda(
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
  // --- validation: everything below this block may write ---
  TORCH_CHECK(master.is_cuda(), "zero_ext.fused_adamw_: `master` must be a CUDA tensor, got ",
              master.device());
  check_fused_adamw_args(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, found_inf,
                         remainder, element_offset);
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
  args.lr = device_scalar(s.lr, keep);
  args.beta1 = device_scalar(s.beta1, keep);
  args.beta2 = device_scalar(s.beta2, keep);
  args.eps = device_scalar(s.eps, keep);
  args.weight_decay = device_scalar(s.weight_decay, keep);
  args.step = device_scalar(s.step, keep);
  args.grad_scale = device_scalar(s.grad_scale, keep);
  args.maximize = maximize;
  args.found_inf =
      found_inf.has_value() && !found_inf_on_host ? device_fp32(*found_inf, keep) : nullptr;
  // With a remainder the kernel's master is the bf16 parameter (`master`) joined with it.
  const bool split = remainder.has_value();
  void* out = split ? master.data_ptr() : param_out.has_value() ? param_out->data_ptr() : nullptr;
  args.rounding_seed = rounding_seed;
  args.element_offset = static_cast<uint64_t>(element_offset);
  void* v_max = max_exp_avg_sq.has_value() ? max_exp_avg_sq->data_ptr() : nullptr;
  C10_CUDA_CHECK(cuda::launch_fused_adamw(split ? nullptr : master.data_ptr<float>(),
                                          grad.const_data_ptr(), grad_dtype, exp_avg.data_ptr(),
                                          exp_avg_sq.data_ptr(), v_max, out, out_dtype, n, args,
                                          stream, split ? remainder->data_ptr<int16_t>() : nullptr,
                                          to_kernel_dtype(exp_avg, "fused_adamw_", "exp_avg")));
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
