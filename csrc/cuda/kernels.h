// Torch-free CUDA kernels: raw pointers + a stream. Launchers return the launch status
// (cudaGetLastError()) and never synchronise.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../dtype.h"

namespace zero_ext::cuda {

// A scalar the kernel reads either from device memory (ptr != nullptr, fp32) or by value. The value
// is a double so that host-known hyperparameters reach adamw_coefficients() with the precision the
// CPU kernel and torch.optim.AdamW use (a float would move lr/bc1 by an ulp now and then).
struct DeviceScalar {
  double value;
  const float* ptr;
};

struct AdamWArgs {
  DeviceScalar lr, beta1, beta2, eps, weight_decay, step, grad_scale;
  const float* found_inf;  // device fp32; nonzero => the whole call is a no-op. May be null.
  bool maximize;           // torch's maximize: the gradient is negated (adamw_coefficients)
  // bf16 moments only: the stochastic rounding's seed and the canonical index of element 0
  // (stochastic_rounding.h; the kernel derives the key from the seed and the step).
  int64_t rounding_seed = 0;
  uint64_t element_offset = 0;
};

// One fused AdamW step over n elements; the CPU kernel's formula (adamw_math.h). Its FMAs are
// explicit fmaf and nvcc (default -fmad=true) finds no other mul+add pair to contract, so the
// result should be the CPU kernel's bits; not yet checked on a GPU (the tests allow a few ulp).
// exp_avg, exp_avg_sq and max_exp_avg_sq have moment_dtype (fp32, or bf16 stored with stochastic
// rounding keyed on args.rounding_seed, the step and args.element_offset + i: the CPU kernel's
// bits). max_exp_avg_sq may be null; otherwise it makes the step amsgrad (n elements, updated in
// place). param_out may be null; otherwise bf16 or fp16, rounded to nearest-even from this kernel's
// master. With remainder (param_remainders): master is null, param_out is the bf16 parameter and
// the master is it joined with remainder and the tie bit in exp_avg_sq's sign bit (master_split.h),
// all read and written back split.
cudaError_t launch_fused_adamw(float* master, const void* grad, DType grad_dtype, void* exp_avg,
                               void* exp_avg_sq, void* max_exp_avg_sq, void* param_out,
                               DType param_out_dtype, int64_t n, const AdamWArgs& args,
                               cudaStream_t stream, int16_t* remainder = nullptr,
                               DType moment_dtype = DType::kFloat32);

// Multi-tensor copy between a flat buffer and `count` tensors in ONE launch. `device_slices` is
// device memory holding `count` TensorSlice records; max_numel is the largest slice (sizes the
// grid). Semantics as zero_ext::cpu::flatten.
cudaError_t launch_flatten(void* flat, DType flat_dtype, const TensorSlice* device_slices,
                           int64_t count, int64_t max_numel, float scale, bool to_flat,
                           cudaStream_t stream);

// Deterministic two-pass sum of squares (fp32) + non-finite flag, written to device scalars.
// workspace: device fp32 buffer of sum_squares_workspace_size(n) elements.
int64_t sum_squares_workspace_size(int64_t n);
cudaError_t launch_sum_squares(const void* x, DType dtype, int64_t n, float* sumsq,
                               float* nonfinite, float* workspace, cudaStream_t stream);

}  // namespace zero_ext::cuda
