// The int8 moments' minifloat codes (fused_adamw_int8_math.h) on every path
// this CPU has, exhaustively, against the maps and the threshold search that define them:
//  - decode: every code's value times a few scales (finite, 0, inf, NaN) is map[code] * scale,
//    bitwise (exp_avg_sq: bit 7 ignored);
//  - encode: every fp32 pattern of a block's normalised range, x * (1 / absmax) with |y| <= 1
//    (both signs, +-0, subnormals), and every NaN gets encode_code's count of thresholds below it
//    (NaN: 0), for exp_avg's and exp_avg_sq's maps.
#include <cmath>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fused_adamw_int8.h"
#include "fused_adamw_int8_math.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

constexpr float kExpAvgMap[] = ZERO_EXT_INT8_EXP_AVG_MAP;
constexpr float kExpAvgThresholds[] = ZERO_EXT_INT8_EXP_AVG_THRESHOLDS;
constexpr float kExpAvgSqMap[] = ZERO_EXT_INT8_EXP_AVG_SQ_MAP;
constexpr float kExpAvgSqThresholds[] = ZERO_EXT_INT8_EXP_AVG_SQ_THRESHOLDS;

using Encode = int64_t (*)(bool, const float*, float, int8_t*, int64_t);
using Decode = int64_t (*)(bool, const int8_t*, float, float*, int64_t);

struct Path {
  Isa isa;
  Encode encode;
  Decode decode;
};

std::vector<Path> paths() {
  std::vector<Path> all = {{Isa::kScalar, int8_encode_scalar, int8_decode_scalar},
                           {Isa::kAvx2, int8_encode_avx2, int8_decode_avx2}};
  std::vector<Path> here;
  for (const Path& p : all) {
    if (static_cast<int>(p.isa) <= static_cast<int>(best_isa())) here.push_back(p);
  }
  return here;
}

bool same_float(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : float_bits(a) == float_bits(b);
}

void check_decode(const Path& p) {
  std::vector<int8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<int8_t>(c);
  std::vector<float> out(256);
  int64_t wrong = 0;
  for (float scale : {1.0f, 0.37f, 3.0e-30f, 0.0f, INFINITY, NAN}) {
    for (bool sq : {false, true}) {
      const int64_t done = p.decode(sq, codes.data(), scale, out.data(), 256);
      int8_decode_scalar(sq, codes.data() + done, scale, out.data() + done, 256 - done);
      for (int c = 0; c < 256; ++c) {
        const float want = (sq ? kExpAvgSqMap[c & 0x7F] : kExpAvgMap[c]) * scale;
        if (!same_float(out[c], want) && wrong++ < 8) {
          CHECK(false, "%s decode %s code %d scale %g: %a, map * scale %a", isa_name(p.isa),
                sq ? "exp_avg_sq" : "exp_avg", c, scale, out[c], want);
        }
      }
    }
  }
  CHECK(wrong == 0, "%s: %lld decoded values differ", isa_name(p.isa),
        static_cast<long long>(wrong));
}

// Magnitudes 0 .. 1.0, then the NaNs, each with both signs: the encode's whole input domain.
constexpr uint64_t kUpToOne = 0x3F800001ull;
constexpr uint64_t kNans = 0x7FFFFFFFull - 0x7F800000ull;
constexpr uint64_t kPatterns = 2 * (kUpToOne + kNans);

uint32_t pattern(uint64_t k) {
  const uint32_t sign = static_cast<uint32_t>(k & 1) << 31;
  const uint64_t m = k >> 1;
  const uint32_t magnitude = static_cast<uint32_t>(m < kUpToOne ? m : 0x7F800001ull + m - kUpToOne);
  return sign | magnitude;
}

void check_encode(const std::vector<Path>& ps) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t chunks = static_cast<int64_t>((kPatterns + kChunk - 1) / kChunk);
  int64_t wrong = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : wrong)
  for (int64_t k = 0; k < chunks; ++k) {
    const uint64_t first = static_cast<uint64_t>(k) * kChunk;
    const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, kPatterns - first));
    std::vector<float> x(n);
    std::vector<uint8_t> want(n);
    std::vector<int8_t> got(n);
    for (bool sq : {false, true}) {
      for (int64_t i = 0; i < n; ++i) {
        x[i] = bits_float(pattern(first + i));
        want[i] =
            static_cast<uint8_t>(sq ? encode_code<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds, x[i])
                                    : encode_code<kInt8ExpAvgCodes>(kExpAvgThresholds, x[i]));
      }
      for (const Path& p : ps) {
        const int64_t done = p.encode(sq, x.data(), 1.0f, got.data(), n);
        int8_encode_scalar(sq, x.data() + done, 1.0f, got.data() + done, n - done);
        for (int64_t i = 0; i < n; ++i) {
          if (static_cast<uint8_t>(got[i]) == want[i]) continue;
          if (wrong++ < 8) {
#pragma omp critical
            CHECK(false, "%s encode %s: y %08x (%a) code %u, thresholds below %u", isa_name(p.isa),
                  sq ? "exp_avg_sq" : "exp_avg", float_bits(x[i]), x[i],
                  static_cast<uint8_t>(got[i]), want[i]);
          }
        }
      }
    }
  }
  CHECK(wrong == 0, "%lld codes differ from the threshold search", static_cast<long long>(wrong));
  std::printf("encode: %llu patterns (|y| <= 1 and NaN, both signs) x 2 maps on %zu path(s)\n",
              static_cast<unsigned long long>(kPatterns), ps.size());
}

}  // namespace

int main() {
  const std::vector<Path> ps = paths();
  for (const Path& p : ps) check_decode(p);
  check_encode(ps);
  return finish("test_int8_quantizer");
}
