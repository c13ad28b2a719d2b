// An fp32 master kept as a bf16 parameter plus a 16-bit remainder (param_remainders=True), the
// encoding of apex's DistributedFusedAdam(store_param_remainders=True), on the raw bits:
//   master bits = (param bits << 16) + sign-extended remainder        (mod 2^32)
//   param       = (master bits + 0x8000) >> 16,  remainder = low 16 bits of the master
// The split is the inverse of the join for every one of the 2^32 patterns but NaNs (a NaN master
// gives the param 0xFFFF, as float_to_bf16 does, and joins back to a NaN: its payload is not kept),
// so the master itself is exact, with zeros, subnormals, infinities and signs (tests/
// test_master_split.py checks every pattern).
//
// The param is the master rounded to nearest with ties away from zero, not to nearest even: the
// two differ only when the low 16 bits are exactly 0x8000 and bit 16 is 0, one master in 2^17.
// No 16-bit remainder can do better: with param = RNE(master), an even bf16 value P is the
// rounding of 2^16 + 1 masters (P<<16 - 0x8000 ... P<<16 + 0x8000, both ends ties to even), one
// more than 16 bits can tell apart. Keeping the master exact and moving the parameter of those
// ties one bf16 ulp up (in magnitude) is the choice that never loses state: the next step's
// master is the fp32 run's, only that step's forward sees the other rounding.
#pragma once
#include <cstdint>

#include "adamw_math.h"  // ZERO_EXT_HD

namespace zero_ext {

ZERO_EXT_HD uint32_t join_master_bits(uint16_t param, int16_t remainder) {
  return (static_cast<uint32_t>(param) << 16) +
         static_cast<uint32_t>(static_cast<int32_t>(remainder));
}

ZERO_EXT_HD uint16_t param_of_master_bits(uint32_t master) {
  if ((master & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;  // NaN, as float_to_bf16
  return static_cast<uint16_t>((master + 0x8000u) >> 16);   // no carry out: not a NaN
}

ZERO_EXT_HD int16_t remainder_of_master_bits(uint32_t master) {
  return static_cast<int16_t>(static_cast<uint16_t>(master & 0xFFFFu));
}

}  // namespace zero_ext
