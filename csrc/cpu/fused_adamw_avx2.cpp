// AVX2 (+F16C, FMA) body of cpu::fused_adamw, 8 floats per vector. Compiled for AVX2 by
// the target pragma alone, so the rest of the library needs no -march flag and runs on any x86-64;
// isa.cpp only calls this when cpuid reports AVX2, F16C and FMA.
//
// Same operations in the same order as adamw_update (adamw_math.h): FMA exactly where it has fmaf,
// nowhere else (contraction is off), so the result is bitwise that of the scalar path.
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include "fused_adamw_paths.h"

namespace zero_ext::cpu {
namespace {

constexpr int64_t kWidth = 8;

template <DType kGrad>
inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kFloat16) return _mm256_cvtph_ps(h);  // exact, subnormals too
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Every lane <= 0xFFFF: the unsigned-saturating pack is an exact narrowing.
inline __m128i narrow(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// ---- moments: fp32 loads and stores stay in the float domain (VMOVUPS, as before bf16 moments
// existed); bf16 moments are widened to fp32 exactly (bits << 16), so their sign bit (the tie bit
// with param_remainders) lands in bit 31 either way.
template <bool kBf16>
inline __m256 load_moment(const void* p, int64_t i) {
  if constexpr (kBf16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

// bf16 bits, one per 32-bit lane.
inline void store_bf16_lanes(void* p, int64_t i, __m256i bits) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), narrow(bits));
}

// stochastic_rounding.h's mix32 on 8 lanes (VPMULLD: the low 32 bits of each product).
inline __m256i mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
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

// stochastic_rounding.h's sr_bf16 with r in [0, 2^16) per lane: (bits + r) >> 16, NaN -> 0xFFFF.
inline __m256i sr_bf16(__m256 x, __m256i r) {
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
  const __m256 ordered = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), rounded, _mm256_castps_si256(ordered));
}

// float_to_bf16's round to nearest even with integer math, one 32-bit lane per result (NaN ->
// 0xFFFF); VCVTNEPS2BF16 would flush subnormals to zero.
inline __m256i rne_bf16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256 ordered = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, _mm256_castps_si256(ordered));
}

inline __m128i float_to_bf16(__m256 x) { return narrow(rne_bf16_lanes(x)); }

// The master of a remainder run (kOut 3): param bits << 16 plus the sign-extended remainder plus
// the tie bit (0 or 1 per lane) << 16 (master_split.h join_master_bits).
inline __m256 load_joined_master(const AdamWBuffers& b, int64_t i, __m256i tie) {
  const __m128i param =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<uint16_t*>(b.param_out) + i));
  const __m128i rem = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.remainder + i));
  const __m256i hi = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtepu16_epi32(param), tie), 16);
  return _mm256_castsi256_ps(_mm256_add_epi32(hi, _mm256_cvtepi16_epi32(rem)));
}

// master_split.h's split: param = RNE (0xFFFF for NaN), d = bits - (param << 16), remainder = the
// low 16 bits of d, tie = (d == 0x8000). Returns the tie bits (0 or 1 per lane).
inline __m256i store_split_master(const AdamWBuffers& b, int64_t i, __m256 x) {
  const __m256i param = rne_bf16_lanes(x);
  const __m256i delta = _mm256_sub_epi32(_mm256_castps_si256(x), _mm256_slli_epi32(param, 16));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.param_out) + i),
                   narrow(param));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(b.remainder + i),
                   narrow(_mm256_and_si256(delta, _mm256_set1_epi32(0xFFFF))));
  return _mm256_srli_epi32(_mm256_cmpeq_epi32(delta, _mm256_set1_epi32(0x8000)), 31);
}

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + the
// tie bit in exp_avg_sq's sign bit. kBf16: bf16 moments, stored with stochastic rounding.
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kSmallWeight, bool kStream>
int64_t body(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  constexpr bool kSplit = kOut == 3;
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
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const __m256 g = _mm256_mul_ps(load_grad<kGrad>(b.grad, i), grad_scale);
    __m256 v = load_moment<kBf16>(b.exp_avg_sq, i);
    __m256i tie = _mm256_setzero_si256();
    if constexpr (kSplit) {  // the tie bit out of exp_avg_sq's sign (bit 31 once widened)
      const __m256i bits = _mm256_castps_si256(v);
      tie = _mm256_srli_epi32(bits, 31);
      v = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)));
    }
    const __m256 master = kSplit ? load_joined_master(b, i, tie) : _mm256_loadu_ps(b.master + i);
    const __m256 p = _mm256_mul_ps(master, decay);
    __m256 m = load_moment<kBf16>(b.exp_avg, i);
    const __m256 diff = _mm256_sub_ps(g, m);
    // fnmadd(a, b, c) = -(a*b) + c rounded once: fmaf(-diff, 1 - w, g) of lerp (adamw_math.h).
    m = kSmallWeight ? _mm256_fmadd_ps(weight, diff, m)
                     : _mm256_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));
    __m256 v_hat = v;
    __m256 v_max = v;
    if constexpr (kAmsgrad) {
      v_max = load_moment<kBf16>(b.max_exp_avg_sq, i);
      // nan_propagating_max(v_max, v) (adamw_math.h): v_max where v_max > v or v_max is NaN.
      const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(v_max, v, _CMP_GT_OQ),
                                       _mm256_cmp_ps(v_max, v_max, _CMP_UNORD_Q));
      v_max = _mm256_blendv_ps(v, v_max, keep);
      v_hat = v_max;
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m256 p_new = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    if constexpr (kSplit) {
      tie = store_split_master(b, i, p_new);
    } else {
      _mm256_storeu_ps(b.master + i, p_new);
    }
    if constexpr (kBf16) {
      const __m256i h = random_bits(b.element_offset + static_cast<uint64_t>(i));
      const __m256i r_v = _mm256_srli_epi32(h, 16);
      __m256i v_bits = sr_bf16(v, r_v);
      if constexpr (kSplit) {
        v_bits = _mm256_or_si256(_mm256_and_si256(v_bits, _mm256_set1_epi32(0x7FFF)),
                                 _mm256_slli_epi32(tie, 15));
      }
      store_bf16_lanes(b.exp_avg, i, sr_bf16(m, _mm256_and_si256(h, low16)));
      store_bf16_lanes(b.exp_avg_sq, i, v_bits);
      if constexpr (kAmsgrad) store_bf16_lanes(b.max_exp_avg_sq, i, sr_bf16(v_max, r_v));
    } else {
      if constexpr (kSplit) {
        const __m256i bits =
            _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
        v = _mm256_castsi256_ps(_mm256_or_si256(bits, _mm256_slli_epi32(tie, 31)));
      }
      _mm256_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
      _mm256_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
      if constexpr (kAmsgrad) _mm256_storeu_ps(static_cast<float*>(b.max_exp_avg_sq) + i, v_max);
    }
    if constexpr (kOut == 1 || kOut == 2) {
      const __m128i h =
          kOut == 1 ? float_to_bf16(p_new) : _mm256_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT);
      __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.param_out) + i);
      if constexpr (kStream) {
        _mm_stream_si128(dst, h);
      } else {
        _mm_storeu_si128(dst, h);
      }
    }
  }
  if constexpr (kStream) _mm_sfence();  // order the streaming stores before the caller's
  return i;
}

template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kStream>
int64_t body_lerp(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  // The branch of torch's lerp (adamw_math.h) depends only on the weight: pick it once per call.
  return __builtin_fabsf(c.lerp_weight) < 0.5f
             ? body<kGrad, kOut, kAmsgrad, kBf16, true, kStream>(b, begin, end, c)
             : body<kGrad, kOut, kAmsgrad, kBf16, false, kStream>(b, begin, end, c);
}

// Non-temporal stores for the write-only param_out stream of a large call (b.stream_out) when this
// range of it is 16-byte aligned: they skip the read (write-allocate) of param_out's cache lines
// (numbers in fused_adamw.cpp). Same values either way.
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16>
int64_t body_store(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.param_out) + begin);
  if (b.stream_out && addr % 16 == 0)
    return body_lerp<kGrad, kOut, kAmsgrad, kBf16, true>(b, begin, end, c);
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
