// param_remainders' bit arithmetic (master_split.h), exhaustively: for all 2^32 fp32 patterns the
// split (param, remainder, tie) joins back (NaNs stay NaNs), the param is float_to_bf16's round to
// nearest even, and tie is set exactly for the ties that rounding to even took down. Then the
// kernel's remainder mode on every SIMD path this CPU has: an update that keeps the master (lr 0,
// zero gradient), with each tie bit in exp_avg_sq's sign bit, gives back every one of the 2^32
// masters' (param, remainder, tie), NaNs excepted.
#include <cmath>

#include "cpu/float_convert.h"
#include "master_split.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

void check_every_pattern() {
  int64_t ties = 0;
  for (uint64_t w = 0; w <= 0xFFFFFFFFull; ++w) {
    const uint32_t u = static_cast<uint32_t>(w);
    const uint16_t param = param_of_master_bits(u);
    const int16_t remainder = remainder_of_master_bits(u);
    const uint32_t tie = tie_of_master_bits(u);
    const uint32_t back = join_master_bits(param, remainder, tie);
    if (is_nan_bits(u)) {
      if (param != 0xFFFF || !is_nan_bits(back)) {
        CHECK(false, "NaN %08x splits to %04x and joins to %08x", u, param, back);
      }
      continue;
    }
    if (back != u) {
      CHECK(false, "%08x splits to (%04x, %d, %u) and joins to %08x", u, param, remainder, tie,
            back);
    }
    if (param != float_to_bf16(bits_float(u))) {
      CHECK(false, "%08x: param %04x, round to nearest even %04x", u, param,
            float_to_bf16(bits_float(u)));
    }
    // A tie (low half 0x8000) with the bf16 lsb clear: rounding to even went down.
    const uint32_t rounded_down_tie = (u & 0x1FFFFu) == 0x8000u ? 1u : 0u;
    if (tie != rounded_down_tie)
      CHECK(false, "%08x: tie %u, expected %u", u, tie, rounded_down_tie);
    ties += tie;
  }
  // one per even high half that is not inf/NaN: 0x7F80 / 2 per sign
  CHECK(ties == 2 * (0x7F80 / 2), "%lld ties", static_cast<long long>(ties));
  std::printf("all 2^32 patterns: exact, param = RNE, %lld ties rounded down carry the tie bit\n",
              static_cast<long long>(ties));
}

void check_kernel_round_trip(Isa isa) {
  force_isa(isa);
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<uint16_t> param(kChunk);
  std::vector<int16_t> remainder(kChunk);
  std::vector<float> zeros(kChunk), m(kChunk), v(kChunk);
  const AdamWCoefficients c = adamw_coefficients(0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0, false);
  int64_t wrong = 0;
  for (uint64_t start = 0; start <= 0xFFFFFFFFull; start += kChunk) {
    for (int64_t i = 0; i < kChunk; ++i) {
      const uint32_t u = static_cast<uint32_t>(start + i);
      param[i] = param_of_master_bits(u);
      remainder[i] = remainder_of_master_bits(u);
      m[i] = 0.0f;
      v[i] = bits_float(tie_of_master_bits(u) << 31);  // +0 or -0: the tie in the sign bit
    }
    fused_adamw(nullptr, zeros.data(), DType::kFloat32, m.data(), v.data(), nullptr, param.data(),
                DType::kBFloat16, kChunk, c, 1, remainder.data());
    for (int64_t i = 0; i < kChunk; ++i) {
      const uint32_t u = static_cast<uint32_t>(start + i);
      const bool ok = is_nan_bits(u) ? param[i] == 0xFFFF
                                     : param[i] == param_of_master_bits(u) &&
                                           remainder[i] == remainder_of_master_bits(u) &&
                                           float_bits(v[i]) == tie_of_master_bits(u) << 31;
      if (!ok && wrong++ < 8) {
        CHECK(false, "%s: master %08x came back as (%04x, %d, v %08x)", isa_name(isa), u, param[i],
              remainder[i], float_bits(v[i]));
      }
    }
  }
  CHECK(wrong == 0, "%s: %lld masters changed", isa_name(isa), static_cast<long long>(wrong));
  std::printf("%s: all 2^32 masters round-trip through the kernel\n", isa_name(isa));
}

}  // namespace

int main() {
  check_every_pattern();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (static_cast<int>(isa) <= static_cast<int>(best_isa())) check_kernel_round_trip(isa);
  }
  force_isa(Isa::kAuto);
  return finish("test_master_split");
}
