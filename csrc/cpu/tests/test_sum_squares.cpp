// cpu::sum_squares: accuracy against a double reference, bitwise determinism across thread
// counts, and the nonfinite flag (inf, -inf, nan anywhere; an overflowing square is not nonfinite).
#include <cmath>
#include <limits>

#include "cpu/float_convert.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

int main() {
  const int64_t sizes[] = {0, 1, 7, 97, 1025, (int64_t{1} << 20) + 3, (int64_t{1} << 23) + 5};
  for (int64_t n : sizes) {
    std::vector<float> x = random_floats(n, 7);
    std::vector<uint16_t> b(n), h(n);
    for (int64_t i = 0; i < n; ++i) {
      b[i] = float_to_bf16(x[i]);
      h[i] = float_to_fp16(x[i]);
    }
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const void* p = d == DType::kFloat32
                          ? static_cast<const void*>(x.data())
                          : (d == DType::kBFloat16 ? static_cast<const void*>(b.data()) : h.data());
      double ref = 0;
      for (int64_t i = 0; i < n; ++i)
        ref += double(load_as_float(p, d, i)) * load_as_float(p, d, i);
      float s1, s2, f1, f2;
      sum_squares(p, d, n, &s1, &f1, 1);
      sum_squares(p, d, n, &s2, &f2, 2);
      CHECK(float_bits(s1) == float_bits(s2), "n=%lld dtype=%d: %.9g (1 thread) vs %.9g (2)",
            (long long)n, int(d), s1, s2);
      CHECK(std::fabs(s1 - ref) <= 1e-6 * ref + 1e-30, "n=%lld dtype=%d: %.9g vs %.9g",
            (long long)n, int(d), s1, ref);
      CHECK(f1 == 0.0f && f2 == 0.0f, "finite input flagged");
    }
  }
  const float specials[] = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (int64_t n : {int64_t{1}, int64_t{97}, int64_t{3000001}}) {
    for (float special : specials) {
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        std::vector<float> x = random_floats(n, 9);
        x[pos] = special;
        float s, f;
        sum_squares(x.data(), DType::kFloat32, n, &s, &f, 2);
        CHECK(f == 1.0f, "n=%lld special at %lld not flagged", (long long)n, (long long)pos);
      }
    }
  }
  std::vector<float> big(5000, 1e30f);  // squares overflow to inf, but every element is finite
  float s, f;
  sum_squares(big.data(), DType::kFloat32, big.size(), &s, &f, 2);
  CHECK(std::isinf(s) && f == 0.0f, "overflow: sum %g flag %g", s, f);
  return zero_ext::cpu::test::finish("test_sum_squares");
}
