// The per-element and per-block arithmetic of the int8 fused AdamW step (moment_dtype=torch.int8),
// shared by the CPU (csrc/cpu/fused_adamw_int8*.cpp) and CUDA (csrc/cuda/fused_adamw_int8.cu)
// kernels. The plain-torch reference is tests/helpers/int8_reference.py (with the maps and
// quantization of zero_ext/update/blockwise_int8.py); every fp32 operation here is one IEEE fp32
// operation it also performs (a multiply, a divide, a comparison), map values and codes come from
// the branch-free quantizer (Int8Quantizer, below), equal to the maps and to the count of
// thresholds, so results are bitwise equal to it:
//   value = map[code] * scale                        (dequantize)
//   scale = max |x| over the block, NaN -> 0x7FC00000 (the canonical quiet NaN torch writes)
//   code  = #{thresholds t : t < y},  y = x / (scale == 0 ? 1 : scale)   (nearest map value; NaN ->
//   0)
// exp_avg_sq's codes use bits 0-6 only; with param_remainders bit 7 is the master's tie bit
// (SPEC A): master bits = (param << 16) + sign_extend(remainder) + (tie << 16).
#pragma once
#include <cstdint>

#include "adamw_math.h"  // ZERO_EXT_HD
#include "dtype.h"
#include "fused_adamw_int8_maps.h"
#include "master_split.h"  // param_remainders' encoding (join_master_bits, param_of_master_bits, ...)

namespace zero_ext {

constexpr int kInt8ExpAvgCodes = ZERO_EXT_INT8_EXP_AVG_CODES;       // 256: bits 0-7
constexpr int kInt8ExpAvgSqCodes = ZERO_EXT_INT8_EXP_AVG_SQ_CODES;  // 128: bits 0-6
constexpr uint32_t kInt8TieBit = 0x80;
constexpr uint32_t kCanonicalNan = 0x7FC00000u;
// One call's buffers. Codes and scales cover elements [0, n): scales has ceil(n / block) entries.
//  - master: fp32, read and written; null with `remainder`.
//  - param_out: bf16/fp16 copy of the new master (round to nearest even), or null. With
//    `remainder` it is required, bf16, and is the parameter half of the master (read and written).
//  - remainder: int16 (param_remainders), the master's low half; the tie bit is bit 7 of
//    exp_avg_sq's codes (SPEC A).
//  - max_exp_avg_sq_codes / _scales: amsgrad's max_exp_avg_sq, quantized as exp_avg_sq is (its
//    map, its own block absmax); both null without amsgrad. Bit 7 of its codes is ignored when read
//    and written 0 (the tie bit is only exp_avg_sq's).
struct Int8AdamWBuffers {
  float* master;
  const void* grad;
  DType grad_dtype;
  int8_t* exp_avg_codes;
  float* exp_avg_scales;
  int8_t* exp_avg_sq_codes;
  float* exp_avg_sq_scales;
  void* param_out;
  DType param_out_dtype;
  int16_t* remainder;
  int8_t* max_exp_avg_sq_codes;
  float* max_exp_avg_sq_scales;
  int64_t n;
  int64_t block;  // a multiple of 16 in [16, 4096]
};

static_assert(kInt8ExpAvgCodes == 256 && kInt8ExpAvgSqCodes == 128,
              "the quantizer (Int8Quantizer) is written for 256 and 128 codes");

// The number of the sorted `thresholds` (kCodes - 1 of them) strictly below y: a branchless binary
// search of log2(kCodes) steps. Every comparison is false for a NaN y, which gets code 0. The
// definition of a code; the kernels compute it with int8_encode_exp_avg / _exp_avg_sq (below),
// which the exhaustive test (csrc/cpu/tests/test_int8_quantizer.cpp) checks against this search.
template <int kCodes>
ZERO_EXT_HD uint32_t encode_code(const float* thresholds, float y) {
  uint32_t pos = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (uint32_t step = kCodes / 2; step >= 1; step /= 2) {
    if (thresholds[pos + step - 1] < y) pos += step;
  }
  return pos;
}

// The divisor of a block's encode: its scale, or 1 for an all-zero block (codes of +-0 then).
ZERO_EXT_HD float encode_divisor(float scale) { return scale == 0.0f ? 1.0f : scale; }

// The running block absmax: nan_propagating_max keeps a NaN once seen (its payload is replaced by
// the canonical NaN when the scale is stored: see finish_absmax).
ZERO_EXT_HD float absmax_step(float amax, float x) { return nan_propagating_max(fabsf(x), amax); }

ZERO_EXT_HD uint32_t float_bits_hd(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

ZERO_EXT_HD float bits_float_hd(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

ZERO_EXT_HD float finish_absmax(float amax) {
  return amax != amax ? bits_float_hd(kCanonicalNan) : amax;
}

// The branch-free quantizer: map values from codes and codes from values by arithmetic on the
// decade-structured maps (scripts/gen_int8_maps_header.py derives the constants and explains the
// method). Scalar reference of the SIMD paths (fused_adamw_int8_avx2.cpp, _avx512.cpp: the same
// operations lane by lane) and the CUDA kernel; csrc/cpu/tests/test_int8_quantizer.cpp checks it
// against the maps and encode_code on every fp32 pattern of |y| <= 1 and every NaN.
struct Int8Quantizer {
  uint32_t ladder_slope[8];       // fp32 bits, by the exponent of (index + 1), & 7
  uint32_t ladder_offset[8];      // fp32 bits, same index
  uint32_t ladder_deltas[8];      // 2 bits per ladder index (0..127), 16 per word
  uint32_t decade_log[2];         // fp32 bits: the decade estimate's multiplier and addend
  uint32_t decade_bound[8];       // fp32 bits: the threshold between decade d and d + 1
  uint32_t decade_scale[8];       // fp32 bits, by decade: value -> threshold index
  uint32_t decade_shift[8];       // fp32 bits, by decade
  uint32_t decade_step[8];        // fp32 bits, by decade: threshold index -> value
  uint32_t threshold_deltas[8];   // 2 bits per threshold index (0..127), 16 per word
  uint32_t exp_avg_near_zero[2];  // fp32 bits: exp_avg's first positive threshold, |last negative|
};

#define ZERO_EXT_INT8_QUANTIZER                                                                 \
  {ZERO_EXT_INT8_LADDER_SLOPE,     ZERO_EXT_INT8_LADDER_OFFSET, ZERO_EXT_INT8_LADDER_DELTAS,    \
   ZERO_EXT_INT8_DECADE_LOG,       ZERO_EXT_INT8_DECADE_BOUND,  ZERO_EXT_INT8_DECADE_SCALE,     \
   ZERO_EXT_INT8_DECADE_SHIFT,     ZERO_EXT_INT8_DECADE_STEP,   ZERO_EXT_INT8_THRESHOLD_DELTAS, \
   ZERO_EXT_INT8_EXP_AVG_NEAR_ZERO}

inline constexpr Int8Quantizer kInt8Quantizer = ZERO_EXT_INT8_QUANTIZER;

ZERO_EXT_HD float int8_constant(uint32_t bits) { return bits_float_hd(bits); }

// a * b rounded once: on CUDA __fmul_rn, which nvcc never contracts with a following add into an
// FMA (-fmad=true would be free to, and a dequantized moment feeds adamw_update's g - m).
ZERO_EXT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The 2-bit correction of index i (0..127) in a packed delta table.
ZERO_EXT_HD uint32_t int8_delta(const uint32_t* words, uint32_t i) {
  return (words[(i >> 4) & 7] >> ((i & 15) * 2)) & 3u;
}

// The ladder's value j (0..127) as fp32 bits: exp_avg_sq's map value of code j.
ZERO_EXT_HD uint32_t int8_ladder_bits(const Int8Quantizer& q, uint32_t j) {
  const float f = static_cast<float>(static_cast<int32_t>(j + 1));
  const uint32_t slot = (float_bits_hd(f) >> 23) & 7;
  const float approx =
      fmaf(f, int8_constant(q.ladder_slope[slot]), int8_constant(q.ladder_offset[slot]));
  return float_bits_hd(approx) + int8_delta(q.ladder_deltas, j);
}

// exp_avg_sq's map[code] * scale (bit 7 of the code ignored).
ZERO_EXT_HD float int8_exp_avg_sq_times(const Int8Quantizer& q, uint32_t code, float scale) {
  return mul_rn(bits_float_hd(int8_ladder_bits(q, code & 0x7Fu)), scale);
}

// exp_avg's map[code] * scale, bitwise: the map is V[j] at 128 + j, -V[j] at 127 - j and 0 at 128,
// and V * (+-scale) is +-(V * scale), V * (0 * scale) is 0 * scale (NaN for an inf or NaN scale).
ZERO_EXT_HD float int8_exp_avg_times(const Int8Quantizer& q, uint32_t code, float scale) {
  const int32_t x = static_cast<int32_t>(code & 0xFFu) - 128;
  const uint32_t j = static_cast<uint32_t>(x ^ (x >> 31));
  const float sign = static_cast<float>((x > 0) - (x < 0));
  return mul_rn(bits_float_hd(int8_ladder_bits(q, j)), mul_rn(sign, scale));
}

// The number of exp_avg_sq's thresholds below a (a not NaN). A decade estimate from a's bits, one
// comparison with that decade's upper boundary, the nearest threshold J inside the decade, and one
// comparison with its exact value.
ZERO_EXT_HD int32_t int8_ladder_count(const Int8Quantizer& q, float a) {
  const float log10 = fmaf(static_cast<float>(static_cast<int32_t>(float_bits_hd(a))),
                           int8_constant(q.decade_log[0]), int8_constant(q.decade_log[1]));
  const uint32_t estimate = static_cast<uint32_t>(static_cast<int32_t>(fmaxf(log10, 0.0f)));
  const uint32_t d = estimate + (int8_constant(q.decade_bound[estimate & 7]) < a ? 1u : 0u);
  const float shift = int8_constant(q.decade_shift[d & 7]);
  const int32_t j =
      static_cast<int32_t>(rintf(fmaf(a, int8_constant(q.decade_scale[d & 7]), shift)));
  const float approx = mul_rn(static_cast<float>(j) - shift, int8_constant(q.decade_step[d & 7]));
  const float t = bits_float_hd(float_bits_hd(approx) +
                                int8_delta(q.threshold_deltas, static_cast<uint32_t>(j) & 127));
  const int32_t raw = j - (a <= t ? 1 : 0);
  const int32_t hi = (2 << d) - 2;
  return raw < hi ? raw : hi;
}

// exp_avg_sq's code of y = x / the block's encode_divisor (|y| <= 1 or NaN): encode_code's count.
ZERO_EXT_HD uint32_t int8_encode_exp_avg_sq(const Int8Quantizer& q, float y) {
  const int32_t count = int8_ladder_count(q, y != y ? 0.0f : y);  // a NaN is counted as 0, coded 0
  return y != y ? 0u : static_cast<uint32_t>(count);
}

// exp_avg's code of y: 128 +- the ladder's count at |y|, with the two thresholds next to 0 that
// differ: for y >= 0 the ladder's first (BOUND[0]) is exp_avg's first positive one (V[1] / 2); for
// y < 0 the code is 128 - #{thresholds <= |y|}, which counts at the next float above |y| and adds
// exp_avg's last negative threshold (-V[0] / 2).
ZERO_EXT_HD uint32_t int8_encode_exp_avg(const Int8Quantizer& q, float y) {
  const uint32_t bits = y != y ? 0u : float_bits_hd(y);  // a NaN is counted as 0, then coded 0
  const uint32_t negative = bits >> 31;
  const float a = bits_float_hd((bits & 0x7FFFFFFFu) + negative);
  const float lo = int8_constant(q.exp_avg_near_zero[negative]);
  const float hi = negative != 0 ? 2.0f : int8_constant(q.decade_bound[0]);
  const int32_t x = int8_ladder_count(q, a) + (lo < a ? 1 : 0) - (hi < a ? 1 : 0);
  return y != y ? 0u : static_cast<uint32_t>(negative != 0 ? 128 - x : 128 + x);
}

}  // namespace zero_ext
