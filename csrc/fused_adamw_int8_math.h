// The per-element and per-block arithmetic of the int8 fused AdamW step (moment_dtype=torch.int8),
// shared by the CPU (csrc/cpu/fused_adamw_int8*.cpp) and CUDA (csrc/cuda/fused_adamw_int8.cu)
// kernels. The plain-torch reference is tests/helpers/int8_reference.py (with the maps and
// quantization of zero_ext/update/blockwise_int8.py); every operation here is one IEEE fp32
// operation it also performs (a multiply, a divide, a comparison), so results are bitwise equal
// to it:
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
              "the kernels' binary searches are written for 256 and 128 codes");

// The number of the sorted `thresholds` (kCodes - 1 of them) strictly below y: a branchless binary
// search of log2(kCodes) steps. Every comparison is false for a NaN y, which gets code 0.
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

}  // namespace zero_ext
