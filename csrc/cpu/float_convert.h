// Scalar fp32 <-> bf16/fp16 conversions shared by every CPU kernel (and by the scalar tails of the
// SIMD paths). They are bit-identical to what torch's CPU `tensor.to(dtype)` produces, which is
// what the SIMD paths produce too:
//  - fp32 -> bf16: round to nearest even with integer bit math (denormals kept, not flushed);
//    every NaN becomes 0xFFFF, as in ATen's vectorised cvtfp32_bf16.
//  - fp32 -> fp16: round to nearest even (the FP16 library's float trick that c10 uses); NaN keeps
//    its sign and top payload bits and is made quiet, as F16C's VCVTPS2PH does.
//  - bf16/fp16 -> fp32: exact.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../dtype.h"

namespace zero_ext::cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFF;
  const uint32_t u = float_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal (and inf/nan): move exponent and mantissa into place, rebias by a power-of-two multiply.
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of 0.5's mantissa, minus 0.5, is exact.
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized);
  return bits_float(sign | magnitude);
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t w = float_bits(f);
  const uint32_t sign = (w & 0x80000000u) >> 16;
  const uint32_t shl1_w = w + w;
  if (shl1_w > 0xFF000000u) {  // NaN: quiet it, keep the top 9 payload bits (VCVTPS2PH behaviour)
    return static_cast<uint16_t>(sign | 0x7E00u | ((w >> 13) & 0x1FFu));
  }
  // Scaling by 2^112 overflows exactly the values that round to fp16 inf; the add below lets the
  // fp32 adder do the round-to-nearest-even at fp16 precision (subnormals included).
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  return static_cast<uint16_t>(sign | (exp_bits + mantissa_bits));
}

inline float load_as_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

}  // namespace zero_ext::cpu
