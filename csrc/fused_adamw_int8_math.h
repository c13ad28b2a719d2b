// The per-element and per-block arithmetic of the int8 fused AdamW step (moment_dtype=torch.int8),
// shared by the CPU (csrc/cpu/fused_adamw_int8*.cpp) and CUDA (csrc/cuda/fused_adamw_int8.cu)
// kernels. The plain-torch reference is tests/helpers/int8_reference.py (with the maps and
// quantization of zero_ext/update/blockwise_int8.py); every fp32 operation here is one IEEE fp32
// operation it also performs (a multiply, a divide, a comparison), map values and codes come from
// the minifloat codes' bit arithmetic (below), equal to the maps and to the count of thresholds,
// so results are bitwise equal to it:
//   value = map[code] * scale                        (dequantize)
//   scale = max |x| over the block, NaN -> 0x7FC00000 (the canonical quiet NaN torch writes)
//   code  = #{thresholds t : t < y},  y = x * (1 / (scale == 0 ? 1 : scale))   (nearest map value;
//   NaN -> 0)
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
              "the codes (int8_encode_exp_avg, _exp_avg_sq) are written for 256 and 128 values");

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

// The factor of a block's encode: 1 / its scale, or 1 for an all-zero block (codes of +-0 then).
// One division per block; each element is multiplied (x / scale per element kept the divider
// busy: 2 of the step's 5 divisions or square roots per element, which the update alone needs 3).
ZERO_EXT_HD float encode_reciprocal(float scale) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, scale == 0.0f ? 1.0f : scale);
#else
  return 1.0f / (scale == 0.0f ? 1.0f : scale);
#endif
}

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

// The int8 codes are minifloats (zero_ext/update/blockwise_int8.py; the mantissa widths come from
// fused_adamw_int8_maps.h, which scripts/gen_int8_maps_header.py writes from it):
//  - exp_avg: code = 128 + x, value = sign(x) * G[|x|] with G[0] = 0 and G[j] (j = 1 .. 128) the
//    fp32 number of bits (j + kInt8ExpAvgBias) << kInt8ExpAvgShift, G[127] = 1 (G[128], the value
//    of code 0, is above 1: no |y| <= 1 gets it);
//  - exp_avg_sq: value = H[code & 0x7F], H[j] (j = 0 .. 127) of bits (j + kInt8ExpAvgSqBias) <<
//    kInt8ExpAvgSqShift, H[127] = 1, no 0 (a small exp_avg_sq never decodes as 0).
// So a code is the nearest value's index, computed by rounding the float's own bits, and a value
// is the code's bits shifted into place: a few integer operations each way, no table. Scalar
// reference of the SIMD path (fused_adamw_int8_avx2.cpp: the same operations lane by lane) and
// the CUDA kernel; csrc/cpu/tests/test_int8_quantizer.cpp checks them against the maps and
// encode_code on every fp32 pattern of |y| <= 1 and every NaN.
constexpr uint32_t kInt8ExpAvgShift = 23 - ZERO_EXT_INT8_EXP_AVG_MANTISSA_BITS;
constexpr uint32_t kInt8ExpAvgSqShift = 23 - ZERO_EXT_INT8_EXP_AVG_SQ_MANTISSA_BITS;
constexpr uint32_t kInt8ExpAvgBias = (0x3F800000u >> kInt8ExpAvgShift) - 127;
constexpr uint32_t kInt8ExpAvgSqBias = (0x3F800000u >> kInt8ExpAvgSqShift) - 127;
// Added before the shift: rounds the dropped bits half down (a tie goes to the lower value).
constexpr uint32_t kInt8ExpAvgHalfDown = (1u << (kInt8ExpAvgShift - 1)) - 1;
constexpr uint32_t kInt8ExpAvgSqHalfDown = (1u << (kInt8ExpAvgSqShift - 1)) - 1;
// G[1] / 2 as fp32 bits: exp_avg's threshold between 0 and G[1].
constexpr uint32_t kInt8ExpAvgZeroThreshold =
    ((1 + kInt8ExpAvgBias) << kInt8ExpAvgShift) - (1u << 23);

// a * b rounded once: on CUDA __fmul_rn, which nvcc never contracts with a following add into an
// FMA (-fmad=true would be free to, and a dequantized moment feeds adamw_update's g - m).
ZERO_EXT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// exp_avg_sq's map[code] * scale (bit 7 of the code ignored).
ZERO_EXT_HD float int8_exp_avg_sq_times(uint32_t code, float scale) {
  return mul_rn(bits_float_hd(((code & 0x7Fu) + kInt8ExpAvgSqBias) << kInt8ExpAvgSqShift), scale);
}

// exp_avg's map[code] * scale: +-G[|x|] * scale, x = code - 128 (+0 * scale for code 128: NaN for
// an inf or NaN scale, as map[128] * scale is).
ZERO_EXT_HD float int8_exp_avg_times(uint32_t code, float scale) {
  const int32_t x = static_cast<int32_t>(code & 0xFFu) - 128;
  const uint32_t j = static_cast<uint32_t>(x < 0 ? -x : x);
  const uint32_t magnitude = j == 0 ? 0u : (j + kInt8ExpAvgBias) << kInt8ExpAvgShift;
  return mul_rn(bits_float_hd(magnitude | (static_cast<uint32_t>(x) & 0x80000000u)), scale);
}

// The number of exp_avg's magnitude thresholds (G[0..127]'s midpoints with their next value)
// below the float of bits `a` (a not NaN): the bits rounded half down to G's mantissa width give
// the nearest G at or above G[1]; below G[1] only the first threshold, G[1] / 2, counts.
ZERO_EXT_HD int32_t int8_exp_avg_count(uint32_t a) {
  const int32_t rounded = static_cast<int32_t>((a + kInt8ExpAvgHalfDown) >> kInt8ExpAvgShift) -
                          int32_t{kInt8ExpAvgBias};
  const int32_t first = a > kInt8ExpAvgZeroThreshold ? 1 : 0;
  return rounded > first ? rounded : first;
}

// exp_avg's code of y = x * the block's encode_reciprocal: encode_code's count of the map's
// thresholds below y (NaN: 0). For y >= 0 that is 128 + the magnitude count at |y|; for y < 0 it is
// 128 - #{magnitude thresholds <= |y|}, the count at the next float above |y|. Saturated to
// [0, 255] (only |y| > 1 reaches either end).
ZERO_EXT_HD uint32_t int8_encode_exp_avg(float y) {
  const uint32_t bits = float_bits_hd(y);
  const uint32_t negative = bits >> 31;
  const int32_t count = int8_exp_avg_count((bits & 0x7FFFFFFFu) + negative);
  const int32_t code = negative != 0 ? 128 - count : 128 + count;
  return y != y ? 0u : static_cast<uint32_t>(code < 0 ? 0 : (code > 255 ? 255 : code));
}

// exp_avg_sq's code of y (NaN: 0): its bits rounded half down to H's mantissa width, less the bias,
// clamped to [0, 127] (y < H[0], y <= -0 included, gives 0: y's bits as a signed integer).
ZERO_EXT_HD uint32_t int8_encode_exp_avg_sq(float y) {
  // The sum wraps (unsigned) only for NaNs; as a signed integer it is negative for every y <= -0.
  const int32_t rounded = static_cast<int32_t>(float_bits_hd(y) + kInt8ExpAvgSqHalfDown);
  const int32_t code = (rounded >> kInt8ExpAvgSqShift) - int32_t{kInt8ExpAvgSqBias};
  return y != y ? 0u : static_cast<uint32_t>(code < 0 ? 0 : (code > 127 ? 127 : code));
}

}  // namespace zero_ext
