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

// The tensors of one fused AdamW step (see adamw_math.h), all contiguous, n elements each.
//  - grad has grad_dtype; exp_avg, exp_avg_sq and max_exp_avg_sq (null unless amsgrad) are fp32 or
//    bf16 (moment_dtype). bf16 moments load exactly, update in fp32 and are stored with stochastic
//    rounding (stochastic_rounding.h) keyed on rounding_key and the canonical index
//    element_offset + i of element i.
//  - param_out, when not null, receives the updated master rounded to nearest-even in
//    param_out_dtype (bf16 or fp16).
//  - With remainder (not null): master is null, param_out is bf16 and the master is param_out
//    joined with remainder and the tie bit in exp_avg_sq's sign bit (master_split.h), read and
//    written back split the same way.
struct AdamWTensors {
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;
  DType moment_dtype = DType::kFloat32;
  void* param_out = nullptr;
  DType param_out_dtype = DType::kBFloat16;
  int16_t* remainder = nullptr;
  uint32_t rounding_key = 0;    // stochastic_rounding.h rounding_key(seed, step); bf16 moments only
  uint64_t element_offset = 0;  // canonical index of element 0; bf16 moments only
};

// One fused AdamW step over n elements (maximize is in coeffs).
void fused_adamw(const AdamWTensors& t, int64_t n, const AdamWCoefficients& coeffs,
                 int num_threads);

// The fp32-moment form (the C++ tests call it): max_exp_avg_sq, param_out and remainder may be
// null.
inline void fused_adamw(float* master, const void* grad, DType grad_dtype, float* exp_avg,
                        float* exp_avg_sq, float* max_exp_avg_sq, void* param_out,
                        DType param_out_dtype, int64_t n, const AdamWCoefficients& coeffs,
                        int num_threads, int16_t* remainder = nullptr) {
  AdamWTensors t;
  t.master = master;
  t.grad = grad;
  t.grad_dtype = grad_dtype;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.max_exp_avg_sq = max_exp_avg_sq;
  t.param_out = param_out;
  t.param_out_dtype = param_out_dtype;
  t.remainder = remainder;
  fused_adamw(t, n, coeffs, num_threads);
}

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
