// bf16 moments (moment_dtype=torch.bfloat16): each moment is updated in fp32 and stored rounded
// stochastically to bf16, with random bits from a counter-based hash of (seed, step, element
// index). The index is the element's canonical index (the engine's element_offset + i), so an
// element rounds the same way at every world size and stage. One formula for the CPU paths, CUDA
// and the plain-torch reference (tests/helpers/stochastic_rounding.py):
//   mix(x): x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
//     (Chris Wellons' "lowbias32" integer hash: two multiplies, full avalanche on 32 bits)
//   key = mix(seed32 ^ mix(step32 ^ 0x9E3779B9))                       once per call
//   h   = mix(mix(key ^ (uint32)(idx >> 32)) ^ (uint32)idx)            per element
//   exp_avg rounds with h & 0xFFFF, exp_avg_sq and max_exp_avg_sq with h >> 16.
//   sr_bf16(x, r) = (bits(x) + r) >> 16 (NaN -> 0xFFFF): rounds |x| up with probability
//   (low 16 bits of x) / 2^16, so E[result] = x (unbiased) for every finite x below bf16's max.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adamw_math.h"  // ZERO_EXT_HD

namespace zero_ext {

ZERO_EXT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The step count as the hash sees it: the whole number `step` (>= 1) modulo 2^32. fmod is exact,
// so this is defined for any finite step (a cast of a double >= 2^32 to uint32 is not).
ZERO_EXT_HD uint32_t step_bits(double step) {
  return static_cast<uint32_t>(fmod(step, 4294967296.0));
}

// One call's key: a function of the seed's low 32 bits and the step.
ZERO_EXT_HD uint32_t rounding_key(int64_t rounding_seed, double step) {
  return mix32(static_cast<uint32_t>(rounding_seed) ^ mix32(step_bits(step) ^ 0x9E3779B9u));
}

// The 32 random bits of the element with canonical index `idx`.
ZERO_EXT_HD uint32_t random_bits(uint32_t key, uint64_t idx) {
  return mix32(mix32(key ^ static_cast<uint32_t>(idx >> 32)) ^ static_cast<uint32_t>(idx));
}

ZERO_EXT_HD uint32_t bits_of_float(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// fp32 -> bf16 bits, rounded up in magnitude with probability (low 16 bits) / 2^16 for r uniform in
// [0, 2^16). NaN -> 0xFFFF as float_to_bf16; an infinity stays one (its low bits are 0); the
// largest finite values may round up to inf (accepted: a moment is never near 3e38).
ZERO_EXT_HD uint16_t sr_bf16(float x, uint32_t r) {
  const uint32_t u = bits_of_float(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
  return static_cast<uint16_t>((u + r) >> 16);  // no carry out: not a NaN, r < 2^16
}

}  // namespace zero_ext
