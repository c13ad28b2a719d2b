// AVX2 (+F16C, FMA) body of cpu::fused_adamw, 8 floats per vector. Compiled for AVX2 by
// the target pragma alone, so the rest of the library needs no -march flag and runs on any x86-64;
// isa.cpp only calls this when cpuid reports AVX2, F16C and FMA.
//
// Same operations in the same order as adamw_update (adamw_math.h): FMA exactly where it has fmaf,
// nowhere else (contraction is off), so the result is bitwise that of the scalar path.
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <algorithm>

#include "avx2_lanes.h"  // after the target pragma: its functions are AVX2 code
#include "fused_adamw_paths.h"

namespace zero_ext::cpu {
namespace {

using namespace avx2;

// ---- moments: fp32 loads and stores stay in the float domain (VMOVUPS, as before bf16 moments
// existed); bf16 moments are widened to fp32 exactly (bits << 16), so their sign bit (the tie bit
// with param_remainders) lands in bit 31 either way.
template <bool kBf16>
inline __m256 load_moment(const void* p, int64_t i) {
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(widen_bf16_bits(static_cast<const uint16_t*>(p) + i));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

inline void store_bf16_high(void* p, int64_t i, __m256i high_form) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i),
                   narrow_high(high_form));
}

// stochastic_rounding.h's mix32 on 8 lanes (VPMULLD: the low 32 bits of each product).
inline __m256i mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// mix32 whose last step x ^= x >> 16 leaves the high 16 bits as they were: h >> 16 is that step's
// own shift, returned as high16 (the rounding bits of exp_avg_sq) instead of shifted again.
inline __m256i mix32_split(__m256i x, __m256i& high16) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  high16 = _mm256_srli_epi32(x, 16);
  return _mm256_xor_si256(x, high16);
}

// random_bits(key, first + lane) for 8 lanes at a time: the index's low word wraps per lane, and a
// lane that wrapped (low < lane, unsigned: max_epu32(low, lane) != low) carries one into its high
// word. The inner hash mix32(key ^ high) is the same for every index with that high word, so it is
// hashed when the high word changes (for it and for the lanes that wrap into the next), not per
// vector: one mix32 per 8 elements instead of two.
class RandomBits {
 public:
  explicit RandomBits(uint32_t key) : key_(key) {}

  __m256i operator()(uint64_t first) {
    const uint32_t high = static_cast<uint32_t>(first >> 32);
    if (!started_ || high != high_) {  // once per call, unless it crosses a multiple of 2^32
      started_ = true;
      high_ = high;
      inner_ = mix32(_mm256_set1_epi32(static_cast<int>(key_ ^ high)));
      inner_next_ = mix32(_mm256_set1_epi32(static_cast<int>(key_ ^ (high + 1))));
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), lane);
    const __m256i not_wrapped = _mm256_cmpeq_epi32(_mm256_max_epu32(low, lane), low);
    const __m256i inner = _mm256_blendv_epi8(inner_next_, inner_, not_wrapped);
    return mix32(_mm256_xor_si256(inner, low));
  }

 private:
  uint32_t key_;
  uint32_t high_ = 0;
  bool started_ = false;
  __m256i inner_ = _mm256_setzero_si256();
  __m256i inner_next_ = _mm256_setzero_si256();
};

// stochastic_rounding.h's sr_bf16 with r in [0, 2^16) per lane, in high-half form: bits + r (its
// high half is (bits + r) >> 16), all ones for NaN (high half 0xFFFF).
inline __m256i sr_bf16_high(__m256 x, __m256i r) {
  const __m256i rounded = _mm256_add_epi32(_mm256_castps_si256(x), r);
  return _mm256_or_si256(rounded, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// The master of a remainder run (kOut 3): param bits << 16 plus the sign-extended remainder plus
// the tie bit << 16 (master_split.h join_master_bits); tie is a mask (all ones or zero per lane).
inline __m256 load_joined_master(const uint16_t* param_p, const int16_t* rem_p, int64_t i,
                                 __m256i tie) {
  const __m128i rem = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rem_p + i));
  const __m256i hi = _mm256_add_epi32(widen_bf16_bits(param_p + i),
                                      _mm256_and_si256(tie, _mm256_set1_epi32(0x10000)));
  return _mm256_castsi256_ps(_mm256_add_epi32(hi, _mm256_cvtepi16_epi32(rem)));
}

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + the
// tie bit in exp_avg_sq's sign bit. kBf16: bf16 moments, stored with stochastic rounding.
// kOneHigh (bf16 moments only): every index of [begin, end) has the same high word, so the inner
// hash mix32(key ^ high) is one constant vector and the low words a counter (no wrap to handle).
//
// The buffers' pointers are copied to locals first: the stores go through __m128i* (may_alias),
// so the compiler would otherwise reload every pointer out of `b` after each store.
// The 16-bit outputs of 8 elements, in high-half form (param and remainder: low half of delta).
struct Narrow8 {
  __m256i param, delta, m, v, v_max;
  __m128i fp16;
};

template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kSmallWeight, bool kStream,
          bool kOneHigh>
int64_t body(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  constexpr bool kSplit = kOut == 3;
  const void* const grad = b.grad;
  float* const master_p = b.master;
  void* const exp_avg = b.exp_avg;
  void* const exp_avg_sq = b.exp_avg_sq;
  void* const max_exp_avg_sq = b.max_exp_avg_sq;
  uint16_t* const param_p = static_cast<uint16_t*>(b.param_out);
  int16_t* const rem_p = b.remainder;
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 weight = _mm256_set1_ps(c.lerp_weight);
  const __m256 one_minus_weight = _mm256_set1_ps(1.0f - c.lerp_weight);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  RandomBits random_bits(b.rounding_key);
  const uint64_t first = b.element_offset + static_cast<uint64_t>(begin);
  const __m256i inner_one = mix32(
      _mm256_set1_epi32(static_cast<int>(b.rounding_key ^ static_cast<uint32_t>(first >> 32))));
  __m256i low = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));

  // One vector of 8 elements: loads, the update, the fp32 stores; the 16-bit results go to `o`.
  // low_i: the low words of the 8 indices (kOneHigh).
  const auto update8 = [&](int64_t i, __m256i low_i, Narrow8& o) {
    const __m256 g = _mm256_mul_ps(load_grad<kGrad>(grad, i), grad_scale);
    __m256 v = load_moment<kBf16>(exp_avg_sq, i);
    __m256i tie = _mm256_setzero_si256();
    if constexpr (kSplit) {  // the tie bit out of exp_avg_sq's sign (bit 31 once widened)
      const __m256i bits = _mm256_castps_si256(v);
      tie = _mm256_cmpgt_epi32(_mm256_setzero_si256(), bits);  // sign as a mask
      v = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)));
    }
    const __m256 master =
        kSplit ? load_joined_master(param_p, rem_p, i, tie) : _mm256_loadu_ps(master_p + i);
    const __m256 p = _mm256_mul_ps(master, decay);
    __m256 m = load_moment<kBf16>(exp_avg, i);
    const __m256 diff = _mm256_sub_ps(g, m);
    // fnmadd(a, b, c) = -(a*b) + c rounded once: fmaf(-diff, 1 - w, g) of lerp (adamw_math.h).
    m = kSmallWeight ? _mm256_fmadd_ps(weight, diff, m)
                     : _mm256_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));
    __m256 v_hat = v;
    __m256 v_max = v;
    if constexpr (kAmsgrad) {
      v_max = load_moment<kBf16>(max_exp_avg_sq, i);
      // nan_propagating_max(v_max, v) (adamw_math.h): v_max where v_max > v or v_max is NaN.
      const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(v_max, v, _CMP_GT_OQ),
                                       _mm256_cmp_ps(v_max, v_max, _CMP_UNORD_Q));
      v_max = _mm256_blendv_ps(v, v_max, keep);
      v_hat = v_max;
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m256 p_new = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    if constexpr (kSplit) {
      // master_split.h's split: param = RNE, delta = bits - (param << 16) (the high-half form
      // with its low half cleared), remainder = delta's low 16 bits, tie = (delta == 0x8000).
      o.param = rne_bf16_high(p_new);
      o.delta = _mm256_sub_epi32(
          _mm256_castps_si256(p_new),
          _mm256_and_si256(o.param, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
      tie = _mm256_cmpeq_epi32(o.delta, _mm256_set1_epi32(0x8000));
    } else {
      _mm256_storeu_ps(master_p + i, p_new);
      if constexpr (kOut == 1) o.param = rne_bf16_high(p_new);
      if constexpr (kOut == 2) o.fp16 = _mm256_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT);
    }
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    if constexpr (kBf16) {
      __m256i h, r_v;  // r_v = h >> 16
      if constexpr (kOneHigh) {
        h = mix32_split(_mm256_xor_si256(inner_one, low_i), r_v);
      } else {
        h = random_bits(b.element_offset + static_cast<uint64_t>(i));
        r_v = _mm256_srli_epi32(h, 16);
      }
      o.v = sr_bf16_high(v, r_v);
      if constexpr (kSplit) {  // the tie bit into the stored sign (bit 31 of the high-half form)
        o.v = _mm256_or_si256(_mm256_andnot_si256(sign, o.v), _mm256_and_si256(tie, sign));
      }
      o.m = sr_bf16_high(m, _mm256_and_si256(h, low16));
      if constexpr (kAmsgrad) o.v_max = sr_bf16_high(v_max, r_v);
    } else {
      if constexpr (kSplit) {
        v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_andnot_si256(sign, _mm256_castps_si256(v)),
                                                _mm256_and_si256(tie, sign)));
      }
      _mm256_storeu_ps(static_cast<float*>(exp_avg) + i, m);
      _mm256_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      if constexpr (kAmsgrad) _mm256_storeu_ps(static_cast<float*>(max_exp_avg_sq) + i, v_max);
    }
  };

  int64_t i = begin;
  // 16 elements a step: the 16-bit outputs of two vectors leave in one 256-bit store each (one
  // byte shuffle per vector and one permute per pair, instead of a shuffle and a permute each).
  // NOTE: not for remainders with bf16 moments: two vectors of it do not fit the 16 registers
  // (in-L2 time 1.6 -> 2.0 ns/element unrolled on the 2-core EPYC).
  constexpr bool kUnroll = !(kSplit && kBf16);
  // NOTE: one loop over every element, not two passes. Tried (2026-11-29, 2-core EPYC): per 512
  // elements, a first loop of the moments and the step (sqrt and both divisions) into L1 buffers,
  // then a second of the master, the param and the rounding of bf16 moments, either one after the
  // other or interleaved (the first loop of the next 512 with the second of these). In L2, one
  // thread, ns/element: bf16 moments 1.06 -> 0.91-0.94, the default 0.64 -> 0.63 one after the
  // other and 0.53 interleaved; the two loops alone took 0.46 (the divider's bound) and 0.45
  // (bf16), so in one loop the update's divider chain and the rounding's shuffles do not overlap.
  // But at 16M elements, 2 threads, both kernels round-robin in one process: bf16 0.95x
  // / 1.06-1.10x, the default 1.04x / 0.95x (after, interleaved): no gain where the step is
  // memory-bound.
  for (; kUnroll && i + 2 * kWidth <= end; i += 2 * kWidth) {
    Narrow8 a, z;
    update8(i, low, a);
    update8(i + kWidth, _mm256_add_epi32(low, _mm256_set1_epi32(kWidth)), z);
    low = _mm256_add_epi32(low, _mm256_set1_epi32(2 * kWidth));
    if constexpr (kBf16) {
      store16(exp_avg, i, join16(a.m, z.m, high_to_low8(), high_to_high8()));
      store16(exp_avg_sq, i, join16(a.v, z.v, high_to_low8(), high_to_high8()));
      if constexpr (kAmsgrad) {
        store16(max_exp_avg_sq, i, join16(a.v_max, z.v_max, high_to_low8(), high_to_high8()));
      }
    }
    if constexpr (kSplit) {
      store16(param_p, i, join16(a.param, z.param, high_to_low8(), high_to_high8()));
      store16(rem_p, i, join16(a.delta, z.delta, low_to_low8(), low_to_high8()));
    }
    if constexpr (kOut == 1) {
      const __m256i x = join16(a.param, z.param, high_to_low8(), high_to_high8());
      __m256i* dst = reinterpret_cast<__m256i*>(param_p + i);
      if constexpr (kStream) {
        _mm256_stream_si256(dst, x);  // body_store: 32-byte aligned here
      } else {
        _mm256_storeu_si256(dst, x);
      }
    }
    if constexpr (kOut == 2) {
      __m128i* dst = reinterpret_cast<__m128i*>(param_p + i);
      if constexpr (kStream) {
        _mm_stream_si128(dst, a.fp16);
        _mm_stream_si128(dst + 1, z.fp16);
      } else {
        _mm_storeu_si128(dst, a.fp16);
        _mm_storeu_si128(dst + 1, z.fp16);
      }
    }
  }
  for (; i + kWidth <= end; i += kWidth) {  // the last vector: same values, stored 8 at a time
    Narrow8 a;
    update8(i, low, a);
    low = _mm256_add_epi32(low, _mm256_set1_epi32(kWidth));
    if constexpr (kBf16) {
      store_pair(static_cast<uint16_t*>(exp_avg), static_cast<uint16_t*>(exp_avg_sq), i, a.m, a.v,
                 high_to_high8());
      if constexpr (kAmsgrad) store_bf16_high(max_exp_avg_sq, i, a.v_max);
    }
    if constexpr (kSplit) {
      store_pair(param_p, reinterpret_cast<uint16_t*>(rem_p), i, a.param, a.delta, low_to_high8());
    }
    if constexpr (kOut == 1 || kOut == 2) {
      const __m128i h = kOut == 1 ? narrow_high(a.param) : a.fp16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param_p + i), h);
    }
  }
  if constexpr (kStream) _mm_sfence();  // order the streaming stores before the caller's
  return i;
}

template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kSmallWeight, bool kStream>
int64_t body_high(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  if constexpr (kBf16) {
    const uint64_t first = b.element_offset + static_cast<uint64_t>(begin);
    const uint64_t last = b.element_offset + static_cast<uint64_t>(end) - 1;
    if (end > begin && (first >> 32) != (last >> 32))  // crosses a multiple of 2^32: rare
      return body<kGrad, kOut, kAmsgrad, kBf16, kSmallWeight, kStream, false>(b, begin, end, c);
  }
  return body<kGrad, kOut, kAmsgrad, kBf16, kSmallWeight, kStream, true>(b, begin, end, c);
}

template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kStream>
int64_t body_lerp(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  // The branch of torch's lerp (adamw_math.h) depends only on the weight: pick it once per call.
  return __builtin_fabsf(c.lerp_weight) < 0.5f
             ? body_high<kGrad, kOut, kAmsgrad, kBf16, true, kStream>(b, begin, end, c)
             : body_high<kGrad, kOut, kAmsgrad, kBf16, false, kStream>(b, begin, end, c);
}

// Non-temporal stores for the write-only param_out stream of a large call (b.stream_out) when this
// range of it is 16-byte aligned: they skip the read (write-allocate) of param_out's cache lines
// (numbers in fused_adamw.cpp). Same values either way.
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16>
int64_t body_store(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.param_out) + begin);
  if (b.stream_out && addr % 16 == 0) {
    if (addr % 32 != 0) {  // one vector unstreamed, so the 256-bit streaming stores are aligned
      const int64_t next = body_lerp<kGrad, kOut, kAmsgrad, kBf16, false>(
          b, begin, std::min(end, begin + kWidth), c);
      if (next != begin + kWidth) return next;
      begin = next;
    }
    return body_lerp<kGrad, kOut, kAmsgrad, kBf16, true>(b, begin, end, c);
  }
  return body_lerp<kGrad, kOut, kAmsgrad, kBf16, false>(b, begin, end, c);
}

template <DType kGrad, bool kAmsgrad, bool kBf16>
int64_t body_out(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  if (b.remainder != nullptr) return body_lerp<kGrad, 3, kAmsgrad, kBf16, false>(b, begin, end, c);
  if (b.param_out == nullptr) return body_lerp<kGrad, 0, kAmsgrad, kBf16, false>(b, begin, end, c);
  if (b.param_out_dtype == DType::kBFloat16)
    return body_store<kGrad, 1, kAmsgrad, kBf16>(b, begin, end, c);
  return body_store<kGrad, 2, kAmsgrad, kBf16>(b, begin, end, c);
}

// amsgrad is a template flag, so the plain path pays nothing for it (no load, no branch).
template <DType kGrad, bool kBf16>
int64_t body_amsgrad(const AdamWBuffers& b, int64_t begin, int64_t end,
                     const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq == nullptr) return body_out<kGrad, false, kBf16>(b, begin, end, c);
  return body_out<kGrad, true, kBf16>(b, begin, end, c);
}

// bf16 moments are a template flag too: the fp32 path computes no hash and converts nothing.
template <DType kGrad>
int64_t body_moments(const AdamWBuffers& b, int64_t begin, int64_t end,
                     const AdamWCoefficients& c) {
  if (b.moment_dtype == DType::kBFloat16) return body_amsgrad<kGrad, true>(b, begin, end, c);
  return body_amsgrad<kGrad, false>(b, begin, end, c);
}

}  // namespace

int64_t fused_adamw_avx2(const AdamWBuffers& b, int64_t begin, int64_t end,
                         const AdamWCoefficients& c) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return body_moments<DType::kBFloat16>(b, begin, end, c);
    case DType::kFloat16:
      return body_moments<DType::kFloat16>(b, begin, end, c);
    default:
      return body_moments<DType::kFloat32>(b, begin, end, c);
  }
}

}  // namespace zero_ext::cpu
