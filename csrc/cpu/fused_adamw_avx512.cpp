// AVX-512 (AVX512F only) body of cpu::fused_adamw, 16 floats per vector. Compiled for AVX-512 by
// the target pragma alone, so the rest of the library needs no -march flag and runs on any x86-64;
// isa.cpp only calls this when cpuid reports AVX512F.
//
// Same operations in the same order as adamw_update (adamw_math.h): FMA exactly where it has fmaf,
// nowhere else (contraction is off), so the result is bitwise that of the scalar path.
// NOTE: without the fp-contract pragma GCC 12 fused 45 mul+add pairs of the non-FMA form of this
// loop into VFMADD (objdump), and the results stopped matching the scalar path bit for bit.
#pragma GCC target("avx512f")
#pragma GCC optimize("fp-contract=off")

// GCC 12 warns about the deliberately undefined pass-through operand inside avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "fused_adamw_paths.h"

namespace zero_ext::cpu {
namespace {

constexpr int64_t kWidth = 16;

template <DType kGrad>
inline __m512 load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kFloat16) return _mm512_cvtph_ps(h);  // exact, subnormals too
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// ---- moments: fp32 loads and stores stay in the float domain (VMOVUPS, as before bf16 moments
// existed); bf16 moments are widened to fp32 exactly (bits << 16), so their sign bit (the tie bit
// with param_remainders) lands in bit 31 either way.
template <bool kBf16>
inline __m512 load_moment(const void* p, int64_t i) {
  if constexpr (kBf16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  }
}

// bf16 bits, one per 32-bit lane (every lane <= 0xFFFF: VPMOVDW's truncation is exact).
inline void store_bf16_lanes(void* p, int64_t i, __m512i bits) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i),
                      _mm512_cvtepi32_epi16(bits));
}

// stochastic_rounding.h's mix32 on 16 lanes (VPMULLD: the low 32 bits of each product).
inline __m512i mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// random_bits(key, first + lane) for 16 lanes at a time: the index's low word wraps per lane, and
// a lane that wrapped carries one into its high word (an offset can cross 2^32 inside a vector).
// The inner hash mix32(key ^ high) is hashed when the high word changes, not per vector, as in
// fused_adamw_avx2.cpp.
class RandomBits {
 public:
  explicit RandomBits(uint32_t key) : key_(key) {}

  __m512i operator()(uint64_t first) {
    const uint32_t high = static_cast<uint32_t>(first >> 32);
    if (!started_ || high != high_) {  // once per call, unless it crosses a multiple of 2^32
      started_ = true;
      high_ = high;
      inner_ = mix32(_mm512_set1_epi32(static_cast<int>(key_ ^ high)));
      inner_next_ = mix32(_mm512_set1_epi32(static_cast<int>(key_ ^ (high + 1))));
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lane);
    const __mmask16 wrapped = _mm512_cmplt_epu32_mask(low, lane);
    const __m512i inner = _mm512_mask_blend_epi32(wrapped, inner_, inner_next_);
    return mix32(_mm512_xor_si512(inner, low));
  }

 private:
  uint32_t key_;
  uint32_t high_ = 0;
  bool started_ = false;
  __m512i inner_ = _mm512_setzero_si512();
  __m512i inner_next_ = _mm512_setzero_si512();
};

// stochastic_rounding.h's sr_bf16 with r in [0, 2^16) per lane: (bits + r) >> 16, NaN -> 0xFFFF.
inline __m512i sr_bf16(__m512 x, __m512i r) {
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  return _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), rounded);
}

// float_to_bf16's round to nearest even, one 32-bit lane per result (NaN -> 0xFFFF).
inline __m512i rne_bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  return _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
}

// Round to nearest even with integer math: VCVTNEPS2BF16 would flush subnormals to zero.
inline __m256i float_to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(rne_bf16_lanes(x)); }

// The master of a remainder run (kOut 3): param bits << 16 plus the sign-extended remainder plus
// the tie bit (0 or 1 per lane) << 16 (master_split.h join_master_bits).
inline __m512 load_joined_master(const AdamWBuffers& b, int64_t i, __m512i tie) {
  const __m256i param =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<uint16_t*>(b.param_out) + i));
  const __m256i rem = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.remainder + i));
  const __m512i hi = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtepu16_epi32(param), tie), 16);
  return _mm512_castsi512_ps(_mm512_add_epi32(hi, _mm512_cvtepi16_epi32(rem)));
}

// master_split.h's split: param = RNE (0xFFFF for NaN), d = bits - (param << 16), remainder = the
// low 16 bits of d (VPMOVDW truncates), tie = (d == 0x8000). Returns the tie bits (0 or 1 per
// lane).
inline __m512i store_split_master(const AdamWBuffers& b, int64_t i, __m512 x) {
  const __m512i param = rne_bf16_lanes(x);
  const __m512i delta = _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_slli_epi32(param, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.param_out) + i),
                      _mm512_cvtepi32_epi16(param));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.remainder + i), _mm512_cvtepi32_epi16(delta));
  const __mmask16 tie = _mm512_cmpeq_epi32_mask(delta, _mm512_set1_epi32(0x8000));
  return _mm512_maskz_mov_epi32(tie, _mm512_set1_epi32(1));
}

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + the
// tie bit in exp_avg_sq's sign bit. kBf16: bf16 moments, stored with stochastic rounding.
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16, bool kSmallWeight, bool kStream>
int64_t body(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  constexpr bool kSplit = kOut == 3;
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 weight = _mm512_set1_ps(c.lerp_weight);
  const __m512 one_minus_weight = _mm512_set1_ps(1.0f - c.lerp_weight);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  RandomBits random_bits(b.rounding_key);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const __m512 g = _mm512_mul_ps(load_grad<kGrad>(b.grad, i), grad_scale);
    __m512 v = load_moment<kBf16>(b.exp_avg_sq, i);
    __m512i tie = _mm512_setzero_si512();
    if constexpr (kSplit) {  // the tie bit out of exp_avg_sq's sign (bit 31 once widened)
      const __m512i bits = _mm512_castps_si512(v);
      tie = _mm512_srli_epi32(bits, 31);
      v = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
    }
    const __m512 master = kSplit ? load_joined_master(b, i, tie) : _mm512_loadu_ps(b.master + i);
    const __m512 p = _mm512_mul_ps(master, decay);
    __m512 m = load_moment<kBf16>(b.exp_avg, i);
    const __m512 diff = _mm512_sub_ps(g, m);
    // fnmadd(a, b, c) = -(a*b) + c rounded once: fmaf(-diff, 1 - w, g) of lerp (adamw_math.h).
    m = kSmallWeight ? _mm512_fmadd_ps(weight, diff, m)
                     : _mm512_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));
    __m512 v_hat = v;
    __m512 v_max;
    if constexpr (kAmsgrad) {
      v_max = load_moment<kBf16>(b.max_exp_avg_sq, i);
      // nan_propagating_max(v_max, v) (adamw_math.h): v_max where v_max > v or v_max is NaN.
      const __mmask16 keep =
          _mm512_cmp_ps_mask(v_max, v, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v_max, v_max, _CMP_UNORD_Q);
      v_max = _mm512_mask_blend_ps(keep, v, v_max);
      v_hat = v_max;
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m512 p_new = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    if constexpr (kSplit) {
      tie = store_split_master(b, i, p_new);
    } else {
      _mm512_storeu_ps(b.master + i, p_new);
    }
    if constexpr (kBf16) {
      const __m512i h = random_bits(b.element_offset + static_cast<uint64_t>(i));
      const __m512i r_v = _mm512_srli_epi32(h, 16);
      __m512i v_bits = sr_bf16(v, r_v);
      if constexpr (kSplit) {
        v_bits = _mm512_or_si512(_mm512_and_si512(v_bits, _mm512_set1_epi32(0x7FFF)),
                                 _mm512_slli_epi32(tie, 15));
      }
      store_bf16_lanes(b.exp_avg, i, sr_bf16(m, _mm512_and_si512(h, low16)));
      store_bf16_lanes(b.exp_avg_sq, i, v_bits);
      if constexpr (kAmsgrad) store_bf16_lanes(b.max_exp_avg_sq, i, sr_bf16(v_max, r_v));
    } else {
      if constexpr (kSplit) {
        const __m512i bits =
            _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
        v = _mm512_castsi512_ps(_mm512_or_si512(bits, _mm512_slli_epi32(tie, 31)));
      }
      _mm512_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
      _mm512_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
      if constexpr (kAmsgrad) _mm512_storeu_ps(static_cast<float*>(b.max_exp_avg_sq) + i, v_max);
    }
    if constexpr (kOut == 1 || kOut == 2) {
      const __m256i h =
          kOut == 1 ? float_to_bf16(p_new) : _mm512_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT);
      __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.param_out) + i);
      if constexpr (kStream) {
        _mm256_stream_si256(dst, h);
      } else {
        _mm256_storeu_si256(dst, h);
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
// range of it is 32-byte aligned: they skip the read (write-allocate) of param_out's cache lines
// (numbers in fused_adamw.cpp). Same values either way.
template <DType kGrad, int kOut, bool kAmsgrad, bool kBf16>
int64_t body_store(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.param_out) + begin);
  if (b.stream_out && addr % 32 == 0)
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

int64_t fused_adamw_avx512(const AdamWBuffers& b, int64_t begin, int64_t end,
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
