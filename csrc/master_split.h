// An fp32 master kept as a bf16 parameter plus a 16-bit remainder and a tie bit
// (param_remainders=True), on the raw bits M of the master:
//   param P   = round to nearest even of M to bf16 (float_to_bf16; a NaN gives 0xFFFF)
//   d         = M - (P << 16)  (mod 2^32), in [-0x8000, +0x8000] for every non-NaN M
//   remainder = low 16 bits of d (int16),  tie = (d == +0x8000)
//   M         = (P << 16) + sign-extended remainder + (tie << 16)  (mod 2^32)
// Why a 17th bit: an even bf16 value P is the nearest-even rounding of 2^16 + 1 masters, from
// (P << 16) - 0x8000 to (P << 16) + 0x8000 (both ends ties that round to even), one more than 16
// bits can tell apart. The two ends share the remainder 0x8000; the tie bit says which one
// (tie = 1: the master was a tie that rounding to even took DOWN). With it the parameter is
// exactly what the fp32-master run writes (master.to(torch.bfloat16)) and the master is exact:
// join(split(M)) == M for every non-NaN pattern (a NaN joins back to a NaN, payload not kept;
// csrc/cpu/tests/test_master_split.cpp checks all 2^32).
//
// Where the tie bit lives: the sign bit of exp_avg_sq's storage (bit 31 of fp32, bit 15 of bf16).
// exp_avg_sq is >= +0 or NaN, so the bit is free; with param_remainders the kernels read
// v = |stored| and tie = sign(stored), and store |v| with the tie as its sign.
#pragma once
#include <cstdint>

#include "adamw_math.h"  // ZERO_EXT_HD

namespace zero_ext {

ZERO_EXT_HD uint32_t join_master_bits(uint16_t param, int16_t remainder, uint32_t tie) {
  return (static_cast<uint32_t>(param) << 16) +
         static_cast<uint32_t>(static_cast<int32_t>(remainder)) + (tie << 16);
}

ZERO_EXT_HD uint16_t param_of_master_bits(uint32_t master) {
  if ((master & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;  // NaN, as float_to_bf16
  // No carry out of bit 31: the largest non-NaN pattern is 0xFF800000 (-inf).
  return static_cast<uint16_t>((master + 0x7FFFu + ((master >> 16) & 1u)) >> 16);
}

// master - (param << 16), mod 2^32: the remainder and the tie bit together.
ZERO_EXT_HD uint32_t master_delta_bits(uint32_t master) {
  return master - (static_cast<uint32_t>(param_of_master_bits(master)) << 16);
}

ZERO_EXT_HD int16_t remainder_of_master_bits(uint32_t master) {
  return static_cast<int16_t>(static_cast<uint16_t>(master_delta_bits(master) & 0xFFFFu));
}

ZERO_EXT_HD uint32_t tie_of_master_bits(uint32_t master) {
  return master_delta_bits(master) == 0x8000u ? 1u : 0u;
}

}  // namespace zero_ext
