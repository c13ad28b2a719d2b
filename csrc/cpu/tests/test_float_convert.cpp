// The scalar conversions in float_convert.h against the hardware (F16C) and a plain RNE reference.
#include <immintrin.h>

#include "cpu/float_convert.h"
#include "test_util.h"

using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

__attribute__((target("f16c"))) uint16_t f16c_from_float(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("f16c"))) float f16c_to_float(uint16_t h) { return _cvtsh_ss(h); }

uint16_t bf16_reference(uint32_t u) {                  // round to nearest even on the bit pattern
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;  // NaN, as ATen's vectorised path
  const uint32_t low = u & 0xFFFFu;
  uint32_t high = u >> 16;
  if (low > 0x8000u || (low == 0x8000u && (high & 1u))) ++high;
  return static_cast<uint16_t>(high);
}

}  // namespace

int main() {
  const bool has_f16c = __builtin_cpu_supports("f16c");
  // Every fp16 value: exact widening, and narrowing back gives the same bits (NaN made quiet).
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = fp16_to_float(static_cast<uint16_t>(h));
    if (has_f16c) {
      CHECK(float_bits(f) == float_bits(f16c_to_float(static_cast<uint16_t>(h))) ||
                (std::isnan(f) && std::isnan(f16c_to_float(static_cast<uint16_t>(h)))),
            "fp16 %04x widens to %08x", h, float_bits(f));
    }
    const bool nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0;
    const uint16_t back = float_to_fp16(f);
    CHECK(back == (nan ? (h | 0x200u) : h), "fp16 %04x round trip gives %04x", h, back);
  }
  // A stride through every fp32 bit pattern (normal, subnormal, inf, NaN, both signs).
  int64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 257) {
    const float f = bits_float(static_cast<uint32_t>(u));
    const uint16_t b = float_to_bf16(f);
    CHECK(b == bf16_reference(static_cast<uint32_t>(u)), "bf16 of %08x: %04x", unsigned(u), b);
    if (has_f16c) {
      const uint16_t h = float_to_fp16(f);
      CHECK(h == f16c_from_float(f), "fp16 of %08x: %04x vs F16C %04x", unsigned(u), h,
            f16c_from_float(f));
    }
    ++checked;
  }
  // Ties and subnormals explicitly: RNE, never flushed.
  CHECK(float_to_bf16(bits_float(0x3F808000u)) == 0x3F80, "tie to even (down)");
  CHECK(float_to_bf16(bits_float(0x3F818000u)) == 0x3F82, "tie to even (up)");
  CHECK(float_to_bf16(1e-40f) != 0, "bf16 subnormal kept");
  CHECK(float_to_fp16(1e-7f) != 0, "fp16 subnormal kept");
  CHECK(float_to_fp16(65520.0f) == 0x7C00, "fp16 overflow rounds to inf");
  CHECK(float_to_fp16(65519.0f) == 0x7BFF, "fp16 max finite");
  std::printf("checked %lld fp32 patterns (f16c: %d)\n", static_cast<long long>(checked), has_f16c);
  return zero_ext::cpu::test::finish("test_float_convert");
}
