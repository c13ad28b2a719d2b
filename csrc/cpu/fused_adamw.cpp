// cpu::fused_adamw: OpenMP over large chunks, each chunk handed to the SIMD path chosen at run time
// (isa.cpp), with the scalar path below finishing what the SIMD path leaves (the last < 16
// elements).
//
// The scalar path is the reference: the SIMD paths perform the same IEEE operations in the same
// order (FMA exactly where adamw_math.h calls fmaf), so every path gives bitwise the same result.
// Contraction into FMA is switched off here too in case this file is ever built with -march flags
// that have FMA. Built without them, fmaf is a libm call (glibc picks the FMA instruction at run
// time where the CPU has it): only tails (< 16 elements) and CPUs without AVX2 pay for it.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <type_traits>

#include "../master_split.h"
#include "../stochastic_rounding.h"
#include "float_convert.h"
#include "fused_adamw_paths.h"
#include "kernels.h"

namespace zero_ext::cpu {
namespace {

// NOTE: below ~64K elements (~1.8 MB of traffic) a parallel region costs more than it saves: on the
// 2-core dev VM, 64K elements take ~15 us on one thread, about the cost of waking the OpenMP team.
constexpr int64_t kChunk = int64_t{1} << 16;

// Moment storage: fp32, or bf16 bits (moment_dtype=bfloat16, stochastic rounding on store).
template <bool kBf16>
using MomentT = std::conditional_t<kBf16, uint16_t, float>;

template <bool kBf16>
inline float load_moment(const MomentT<kBf16>* p, int64_t i) {
  if constexpr (kBf16) return bf16_to_float(p[i]);
  return p[i];
}

// exp_avg_sq's stored bits: with param_remainders (kSplit) its sign bit is the master's tie bit
// (master_split.h), which load_moment_sq takes out and store_moment_sq puts back.
template <bool kBf16>
constexpr uint32_t kSignBit = kBf16 ? 0x8000u : 0x80000000u;

template <bool kBf16, bool kSplit>
inline float load_moment_sq(const MomentT<kBf16>* p, int64_t i, uint32_t& tie) {
  if constexpr (!kSplit) return load_moment<kBf16>(p, i);
  if constexpr (kBf16) {
    tie = p[i] >> 15;
    return bf16_to_float(p[i] & 0x7FFFu);
  } else {
    const uint32_t u = float_bits(p[i]);
    tie = u >> 31;
    return bits_float(u & 0x7FFFFFFFu);
  }
}

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + tie.
// kBf16: the moments are bf16, stored with sr_bf16 (exp_avg with the low 16 random bits,
// exp_avg_sq and max_exp_avg_sq with the high 16).
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16>
void scalar_range(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  constexpr bool kSplit = kOut == 3;
  using M = MomentT<kBf16>;
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  M* const exp_avg = static_cast<M*>(b.exp_avg);
  M* const exp_avg_sq = static_cast<M*>(b.exp_avg_sq);
  M* const max_exp_avg_sq = static_cast<M*>(b.max_exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    uint32_t tie = 0;
    float v = load_moment_sq<kBf16, kSplit>(exp_avg_sq, i, tie);
    float p = kSplit ? bits_float(join_master_bits(param[i], b.remainder[i], tie)) : b.master[i];
    float m = load_moment<kBf16>(exp_avg, i);
    float v_max = kAmsgrad ? load_moment<kBf16>(max_exp_avg_sq, i) : 0.0f;
    adamw_update<kAmsgrad>(p, load_as_float(b.grad, kGrad, i), m, v, v_max, c);
    if constexpr (kSplit) {
      const uint32_t u = float_bits(p);
      param[i] = param_of_master_bits(u);
      b.remainder[i] = remainder_of_master_bits(u);
      tie = tie_of_master_bits(u);
    } else {
      b.master[i] = p;
    }
    if constexpr (kBf16) {
      const uint32_t h = random_bits(b.rounding_key, b.element_offset + static_cast<uint64_t>(i));
      exp_avg[i] = sr_bf16(m, h & 0xFFFFu);
      const uint16_t sq = sr_bf16(v, h >> 16);
      exp_avg_sq[i] = kSplit ? static_cast<uint16_t>((sq & 0x7FFFu) | (tie << 15)) : sq;
      if constexpr (kAmsgrad) max_exp_avg_sq[i] = sr_bf16(v_max, h >> 16);
    } else {
      exp_avg[i] = m;
      exp_avg_sq[i] = kSplit ? bits_float((float_bits(v) & 0x7FFFFFFFu) | (tie << 31)) : v;
      if constexpr (kAmsgrad) max_exp_avg_sq[i] = v_max;
    }
    if constexpr (kOut == 1) param[i] = float_to_bf16(p);
    if constexpr (kOut == 2) param[i] = float_to_fp16(p);
  }
}

template <DType kGrad, bool kAmsgrad, bool kBf16>
void scalar_range_out(const AdamWBuffers& b, int64_t begin, int64_t end,
                      const AdamWCoefficients& c) {
  if (b.remainder != nullptr) {
    scalar_range<kGrad, 3, kAmsgrad, kBf16>(b, begin, end, c);
  } else if (b.param_out == nullptr) {
    scalar_range<kGrad, 0, kAmsgrad, kBf16>(b, begin, end, c);
  } else if (b.param_out_dtype == DType::kBFloat16) {
    scalar_range<kGrad, 1, kAmsgrad, kBf16>(b, begin, end, c);
  } else {
    scalar_range<kGrad, 2, kAmsgrad, kBf16>(b, begin, end, c);
  }
}

template <DType kGrad, bool kBf16>
void scalar_range_amsgrad(const AdamWBuffers& b, int64_t begin, int64_t end,
                          const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq == nullptr) {
    scalar_range_out<kGrad, false, kBf16>(b, begin, end, c);
  } else {
    scalar_range_out<kGrad, true, kBf16>(b, begin, end, c);
  }
}

template <DType kGrad>
void scalar_range_moments(const AdamWBuffers& b, int64_t begin, int64_t end,
                          const AdamWCoefficients& c) {
  if (b.moment_dtype == DType::kBFloat16) {
    scalar_range_amsgrad<kGrad, true>(b, begin, end, c);
  } else {
    scalar_range_amsgrad<kGrad, false>(b, begin, end, c);
  }
}

void run_range(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c,
               Isa isa) {
  if (isa == Isa::kAvx512) {
    begin = fused_adamw_avx512(b, begin, end, c);
  } else if (isa == Isa::kAvx2) {
    begin = fused_adamw_avx2(b, begin, end, c);
  }
  fused_adamw_scalar(b, begin, end, c);
}

}  // namespace

int64_t fused_adamw_scalar(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      scalar_range_moments<DType::kBFloat16>(b, begin, end, c);
      break;
    case DType::kFloat16:
      scalar_range_moments<DType::kFloat16>(b, begin, end, c);
      break;
    default:
      scalar_range_moments<DType::kFloat32>(b, begin, end, c);
      break;
  }
  return end;
}

void fused_adamw(const AdamWTensors& t, int64_t n, const AdamWCoefficients& coeffs,
                 int num_threads) {
  if (n <= 0) return;
  // NOTE: non-temporal param_out stores (the SIMD paths) skip the write-allocate read of its lines.
  // On the 2-core dev VM (Zen 4, 2 MB L2, 32 MB L3), zero_ext / torch AdamW(fused=True) median
  // time, alternating processes: 2^26 elements 1.00 (0.90-1.14) with them vs 1.07 (1.03-1.15)
  // without, lower in all 9 pairs; 2^22: 0.92 vs 0.96; 2^20: 0.76 vs 0.81 (noisy). A call that
  // fits in L2 (2^16) was ~1% slower with them, hence only from 2^20 elements up. Tried at 2^26
  // and dropped: software prefetch 128/256/1024 elements ahead (no consistent change), one
  // contiguous range per thread instead of 64K chunks (none), 16K chunks round-robin (worse),
  // non-temporal master/m/v stores too (1.7x slower: those lines are read first anyway).
  AdamWBuffers b;
  static_cast<AdamWTensors&>(b) = t;
  b.stream_out = n >= (int64_t{1} << 20);
  const Isa isa = active_isa();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1 || num_threads <= 1) {
    run_range(b, 0, n, coeffs, isa);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, chunks));
  // Static schedule: thread t streams one contiguous run of chunks, so the hardware prefetcher
  // sees long sequential streams.
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t k = 0; k < chunks; ++k) {
    run_range(b, k * kChunk, std::min(n, (k + 1) * kChunk), coeffs, isa);
  }
}

}  // namespace zero_ext::cpu
