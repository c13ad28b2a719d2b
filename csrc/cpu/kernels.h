// Torch-free CPU kernels: SIMD (AVX-512 / AVX2 chosen at run time) + OpenMP.
// Every pointer is to contiguous memory; nothing here allocates or throws.
#pragma once
#include <cstdint>

#include "../adamw_math.h"
#include "../dtype.h"

namespace zero_ext::cpu {

// The instruction-set path a kernel takes. kAuto = the best this CPU supports.
enum class Isa : int32_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

Isa best_isa();           // what this CPU supports (cpuid)
Isa active_isa();         // what the kernels use now (best_isa() unless forced)
void force_isa(Isa isa);  // kAuto restores best_isa(); forcing an unsupported isa clamps to best
const char* isa_name(Isa isa);

// One fused AdamW step over n elements (see adamw_math.h). grad has grad_dtype; max_exp_avg_sq,
// when not null, makes it an amsgrad step (maximize is in coeffs); param_out, when not null,
// receives the updated master rounded to nearest-even in param_out_dtype (bf16 or fp16).
// With remainder (not null): master is null, param_out is bf16 and the master is param_out joined
// with remainder (master_split.h), read and written back split the same way.
void fused_adamw(float* master, const void* grad, DType grad_dtype, float* exp_avg,
                 float* exp_avg_sq, float* max_exp_avg_sq, void* param_out, DType param_out_dtype,
                 int64_t n, const AdamWCoefficients& coeffs, int num_threads,
                 int16_t* remainder = nullptr);

// to_flat:  flat[s.offset + i] = convert(s.data[i] * scale)   (flatten)
// !to_flat: s.data[i] = convert(flat[s.offset + i] * scale)   (unflatten)
// Math in fp32, rounding to bf16/fp16 nearest-even. scale == 1 copies bits exactly between equal
// dtypes.
void flatten(void* flat, DType flat_dtype, const TensorSlice* slices, int64_t count, float scale,
             bool to_flat, int num_threads);

// sum of x^2 accumulated in fp32 (deterministic: fixed chunking, independent of num_threads), and
// nonfinite = 1 if any element is inf or nan, else 0.
void sum_squares(const void* x, DType dtype, int64_t n, float* sumsq, float* nonfinite,
                 int num_threads);

}  // namespace zero_ext::cpu
