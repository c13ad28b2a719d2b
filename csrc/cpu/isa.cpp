// Run-time choice of the SIMD path (cpuid), and the test hook that forces one.
#include <atomic>

#include "kernels.h"

namespace zero_ext::cpu {
namespace {

Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // The AVX-512 path uses only AVX512F instructions (F16C conversions included in it).
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;  // FMA: the AdamW formula's lerp and addcmul are fused (adamw_math.h)
  }
#endif
  return Isa::kScalar;
}

std::atomic<Isa> g_forced{Isa::kAuto};

}  // namespace

Isa best_isa() {
  static const Isa best = detect_isa();
  return best;
}

Isa active_isa() {
  const Isa forced = g_forced.load(std::memory_order_relaxed);
  return forced == Isa::kAuto ? best_isa() : forced;
}

void force_isa(Isa isa) {
  // The enum is ordered by capability: an unsupported request clamps to the best supported path.
  if (isa != Isa::kAuto && static_cast<int32_t>(isa) > static_cast<int32_t>(best_isa())) {
    isa = best_isa();
  }
  g_forced.store(isa, std::memory_order_relaxed);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    default:
      return "auto";
  }
}

}  // namespace zero_ext::cpu
