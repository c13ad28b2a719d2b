// Minimal test harness for the torch-free CPU kernels (no gtest dependency): CHECK records a
// failure with its location and keeps going; main() returns finish().
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/kernels.h"

namespace zero_ext::cpu::test {

inline int& failures() {
  static int count = 0;
  return count;
}

#define CHECK(cond, ...)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ++::zero_ext::cpu::test::failures();                                          \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                   \
    }                                                                               \
  } while (0)

inline int finish(const char* name) {
  if (failures() == 0) std::printf("%s: all checks passed\n", name);
  return failures() == 0 ? 0 : 1;
}

inline bool same_bits(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

inline std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// The ISA paths this CPU can run, scalar first.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> isas{Isa::kScalar};
  if (static_cast<int>(best_isa()) >= static_cast<int>(Isa::kAvx2)) isas.push_back(Isa::kAvx2);
  if (best_isa() == Isa::kAvx512) isas.push_back(Isa::kAvx512);
  return isas;
}

}  // namespace zero_ext::cpu::test
