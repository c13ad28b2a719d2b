// The per-ISA bodies of cpu::fused_adamw (kernels.h). Each processes [begin, end) of one thread's
// chunk and returns the index where it stopped; the caller finishes the rest with the scalar path,
// so the SIMD files need no tail code of their own.
#pragma once
#include <cstdint>

#include "../adamw_math.h"
#include "../dtype.h"

namespace zero_ext::cpu {

// Arguments of one fused_adamw call; `param_out` is null when there is no low-precision copy,
// `max_exp_avg_sq` null unless amsgrad. With `remainder` (param_remainders, master_split.h),
// `master` is null and the master is `param_out` (bf16, read and written) joined with `remainder`.
struct AdamWBuffers {
  float* master;
  const void* grad;
  DType grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  void* param_out;
  DType param_out_dtype;
  int16_t* remainder;
  // Write param_out with non-temporal stores where aligned (a call too big for the caches).
  bool stream_out = false;
};

int64_t fused_adamw_scalar(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c);
int64_t fused_adamw_avx2(const AdamWBuffers& b, int64_t begin, int64_t end,
                         const AdamWCoefficients& c);
int64_t fused_adamw_avx512(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c);

}  // namespace zero_ext::cpu
