// AVX-512 (AVX512F only) body of cpu::fused_adamw_int8, 16 elements per vector, full blocks only
// (the caller's scalar path takes a short last block). Compiled for AVX-512 by the target pragma
// alone, like fused_adamw_avx512.cpp; isa.cpp only selects it when cpuid reports AVX512F.
//
// Bitwise the scalar path (fused_adamw_int8.cpp): the same IEEE operations in the same order (FMA
// exactly where adamw_math.h calls fmaf; contraction off), map values fetched by gather, the block
// absmax with the scalar's NaN-propagating comparison (max of non-NaN values does not depend on the
// order; a NaN is replaced by the canonical NaN), codes by the same binary search (a gather of the
// thresholds and a compare per step).
#pragma GCC target("avx512f")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "../fused_adamw_int8_math.h"
#include "fused_adamw_int8.h"

namespace zero_ext::cpu {
namespace {

constexpr int64_t kWidth = 16;
constexpr float kExpAvgMap[] = ZERO_EXT_INT8_EXP_AVG_MAP;
constexpr float kExpAvgThresholds[] = ZERO_EXT_INT8_EXP_AVG_THRESHOLDS;
constexpr float kExpAvgSqMap[] = ZERO_EXT_INT8_EXP_AVG_SQ_MAP;
constexpr float kExpAvgSqThresholds[] = ZERO_EXT_INT8_EXP_AVG_SQ_THRESHOLDS;

template <DType kGrad>
inline __m512 load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kFloat16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Round to nearest even with integer math (NaN -> 0xFFFF), as float_to_bf16 / param_of_master_bits;
// the result in the low 16 bits of each lane.
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  return _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
}

inline __m512i load_codes(const int8_t* codes, int64_t i) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
}

// nan_propagating_max(|x|, amax) lane by lane (absmax_step).
inline __m512 absmax_step(__m512 amax, __m512 x) {
  const __m512 a =
      _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  const __mmask16 take =
      _mm512_cmp_ps_mask(a, amax, _CMP_GT_OQ) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(take, amax, a);
}

inline float reduce_absmax(__m512 amax) {
  alignas(64) float lanes[kWidth];
  _mm512_store_ps(lanes, amax);
  float r = 0.0f;
  for (float a : lanes) r = zero_ext::absmax_step(r, a);
  return finish_absmax(r);
}

// Every 8th threshold, thresholds[8e + 7] for e = 0..30 (the rest 0): the candidates of the binary
// search's steps of 8 and more, which one VPERMT2PS reads from two registers without a gather.
struct CoarseThresholds {
  alignas(64) float values[32];
};

template <int kCodes>
const CoarseThresholds& coarse_thresholds(const float* thresholds) {
  static const CoarseThresholds table = [thresholds] {
    CoarseThresholds t{};
    for (int e = 0; 8 * e + 7 < kCodes - 1; ++e) t.values[e] = thresholds[8 * e + 7];
    return t;
  }();
  return table;
}

// encode_code: the count of thresholds below y, by the same binary search. At a step of s >= 8 the
// candidate thresholds[pos + s - 1] is coarse[(pos + s) / 8 - 1] (pos is a multiple of 2s), read
// by a permute from (lo, hi) = coarse_thresholds<kCodes>; the last three steps gather.
// NOTE: 2^22 elements, bf16 grad, param_out, one thread, the (loaded) 2-core dev VM, each run
// timing the fp32 op and this one alternately (median of 5): with eight gathers per search (17 per
// 16 elements) 42.8 vs 3.7 ns/element (11.7x the fp32 op); with three, 16.0 vs 4.1 (3.9x).
template <int kCodes>
inline __m512i encode(const float* thresholds, __m512 lo, __m512 hi, __m512 y) {
  __m512i pos = _mm512_setzero_si512();
  for (int step = kCodes / 2; step >= 8; step /= 2) {
    const __m512i e = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(pos, _mm512_set1_epi32(step)), 3), _mm512_set1_epi32(1));
    const __m512 t = _mm512_permutex2var_ps(lo, e, hi);
    const __mmask16 below = _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ);
    pos = _mm512_mask_add_epi32(pos, below, pos, _mm512_set1_epi32(step));
  }
  for (int step = 4; step >= 1; step /= 2) {
    const __m512i idx = _mm512_add_epi32(pos, _mm512_set1_epi32(step - 1));
    const __m512 t = _mm512_i32gather_ps(idx, thresholds, 4);
    const __mmask16 below = _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ);
    pos = _mm512_mask_add_epi32(pos, below, pos, _mm512_set1_epi32(step));
  }
  return pos;
}

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
void block(const Int8AdamWBuffers& b, int64_t blk, const AdamWCoefficients& c) {
  alignas(64) float m_new[kInt8MaxBlock];
  alignas(64) float v_new[kInt8MaxBlock];
  alignas(64) float vmax_new[kAmsgrad ? kInt8MaxBlock : kWidth];
  alignas(64) uint8_t tie[kInt8MaxBlock];
  const int64_t begin = blk * b.block;
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 weight = _mm512_set1_ps(c.lerp_weight);
  const __m512 one_minus_weight = _mm512_set1_ps(1.0f - c.lerp_weight);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const __m512 m_scale = _mm512_set1_ps(b.exp_avg_scales[blk]);
  const __m512 v_scale = _mm512_set1_ps(b.exp_avg_sq_scales[blk]);
  const __m512 vmax_scale = _mm512_set1_ps(kAmsgrad ? b.max_exp_avg_sq_scales[blk] : 0.0f);
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  __m512 m_amax = _mm512_setzero_ps();
  __m512 v_amax = _mm512_setzero_ps();
  __m512 vmax_amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    const __m512i v_codes = load_codes(b.exp_avg_sq_codes, i);
    __m512 m =
        _mm512_mul_ps(_mm512_i32gather_ps(load_codes(b.exp_avg_codes, i), kExpAvgMap, 4), m_scale);
    __m512 v = _mm512_mul_ps(
        _mm512_i32gather_ps(_mm512_and_si512(v_codes, _mm512_set1_epi32(0x7F)), kExpAvgSqMap, 4),
        v_scale);
    __m512 master;
    if constexpr (kOut == 3) {  // join_master_bits (master_split.h)
      const __m512i hi = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(param + i))),
          16);
      const __m512i rem = _mm512_cvtepi16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.remainder + i)));
      const __m512i tie_in = _mm512_slli_epi32(_mm512_srli_epi32(v_codes, 7), 16);
      master = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_add_epi32(hi, rem), tie_in));
    } else {
      master = _mm512_loadu_ps(b.master + i);
    }
    // adamw_update (adamw_math.h), as in fused_adamw_avx512.cpp.
    const __m512 g = _mm512_mul_ps(load_grad<kGrad>(b.grad, i), grad_scale);
    const __m512 p = _mm512_mul_ps(master, decay);
    const __m512 diff = _mm512_sub_ps(g, m);
    m = kSmallWeight ? _mm512_fmadd_ps(weight, diff, m)
                     : _mm512_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));
    __m512 v_hat = v;  // the denominator's moment: v, or with amsgrad max_exp_avg_sq's new value
    if constexpr (kAmsgrad) {
      const __m512i codes =
          _mm512_and_si512(load_codes(b.max_exp_avg_sq_codes, i), _mm512_set1_epi32(0x7F));
      const __m512 old = _mm512_mul_ps(_mm512_i32gather_ps(codes, kExpAvgSqMap, 4), vmax_scale);
      // nan_propagating_max(old, v) (adamw_math.h): old where old > v or old is NaN.
      const __mmask16 keep =
          _mm512_cmp_ps_mask(old, v, _CMP_GT_OQ) | _mm512_cmp_ps_mask(old, old, _CMP_UNORD_Q);
      v_hat = _mm512_mask_blend_ps(keep, v, old);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m512 p_new = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    if constexpr (kOut == 3) {  // master_split.h: param, remainder, tie of the master
      const __m512i u = _mm512_castps_si512(p_new);
      const __m512i hi = bf16_bits(p_new);
      const __m512i d = _mm512_sub_epi32(u, _mm512_slli_epi32(hi, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(param + i), _mm512_cvtepi32_epi16(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.remainder + i), _mm512_cvtepi32_epi16(d));
      const __mmask16 is_tie = _mm512_cmpeq_epi32_mask(d, _mm512_set1_epi32(0x8000));
      _mm_store_si128(
          reinterpret_cast<__m128i*>(tie + j),
          _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(is_tie, _mm512_set1_epi32(0x80))));
    } else {
      _mm512_storeu_ps(b.master + i, p_new);
    }
    if constexpr (kOut == 1) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(param + i),
                          _mm512_cvtepi32_epi16(bf16_bits(p_new)));
    }
    if constexpr (kOut == 2) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(param + i),
                          _mm512_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT));
    }
    _mm512_store_ps(m_new + j, m);
    _mm512_store_ps(v_new + j, v);
    m_amax = absmax_step(m_amax, m);
    v_amax = absmax_step(v_amax, v);
    if constexpr (kAmsgrad) {
      _mm512_store_ps(vmax_new + j, v_hat);
      vmax_amax = absmax_step(vmax_amax, v_hat);
    }
  }
  const float m_max = reduce_absmax(m_amax);
  const float v_max = reduce_absmax(v_amax);
  const float vmax_absmax = kAmsgrad ? reduce_absmax(vmax_amax) : 0.0f;
  const __m512 m_div = _mm512_set1_ps(encode_divisor(m_max));
  const __m512 v_div = _mm512_set1_ps(encode_divisor(v_max));
  const __m512 vmax_div = _mm512_set1_ps(encode_divisor(vmax_absmax));
  const CoarseThresholds& m_coarse = coarse_thresholds<kInt8ExpAvgCodes>(kExpAvgThresholds);
  const CoarseThresholds& v_coarse = coarse_thresholds<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds);
  const __m512 m_lo = _mm512_load_ps(m_coarse.values);
  const __m512 m_hi = _mm512_load_ps(m_coarse.values + 16);
  const __m512 v_lo = _mm512_load_ps(v_coarse.values);
  const __m512 v_hi = _mm512_load_ps(v_coarse.values + 16);
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    const __m512i mc = encode<kInt8ExpAvgCodes>(kExpAvgThresholds, m_lo, m_hi,
                                                _mm512_div_ps(_mm512_load_ps(m_new + j), m_div));
    __m512i vc = encode<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds, v_lo, v_hi,
                                            _mm512_div_ps(_mm512_load_ps(v_new + j), v_div));
    if constexpr (kOut == 3) {
      vc = _mm512_or_si512(
          vc, _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tie + j))));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.exp_avg_codes + i), _mm512_cvtepi32_epi8(mc));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.exp_avg_sq_codes + i), _mm512_cvtepi32_epi8(vc));
    if constexpr (kAmsgrad) {
      const __m512i xc = encode<kInt8ExpAvgSqCodes>(
          kExpAvgSqThresholds, v_lo, v_hi, _mm512_div_ps(_mm512_load_ps(vmax_new + j), vmax_div));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.max_exp_avg_sq_codes + i),
                       _mm512_cvtepi32_epi8(xc));
    }
  }
  b.exp_avg_scales[blk] = m_max;
  b.exp_avg_sq_scales[blk] = v_max;
  if constexpr (kAmsgrad) b.max_exp_avg_sq_scales[blk] = vmax_absmax;
}

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
int64_t blocks(const Int8AdamWBuffers& b, int64_t first, int64_t last, const AdamWCoefficients& c) {
  int64_t blk = first;
  for (; blk < last && (blk + 1) * b.block <= b.n; ++blk)
    block<kGrad, kOut, kSmallWeight, kAmsgrad>(b, blk, c);
  return blk;
}

template <DType kGrad, int kOut, bool kAmsgrad>
int64_t blocks_lerp(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                    const AdamWCoefficients& c) {
  // The branch of torch's lerp (adamw_math.h) depends only on the weight: pick it once per call.
  return __builtin_fabsf(c.lerp_weight) < 0.5f
             ? blocks<kGrad, kOut, true, kAmsgrad>(b, first, last, c)
             : blocks<kGrad, kOut, false, kAmsgrad>(b, first, last, c);
}

template <DType kGrad, bool kAmsgrad>
int64_t blocks_out(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                   const AdamWCoefficients& c) {
  if (b.remainder != nullptr) return blocks_lerp<kGrad, 3, kAmsgrad>(b, first, last, c);
  if (b.param_out == nullptr) return blocks_lerp<kGrad, 0, kAmsgrad>(b, first, last, c);
  if (b.param_out_dtype == DType::kBFloat16) {
    return blocks_lerp<kGrad, 1, kAmsgrad>(b, first, last, c);
  }
  return blocks_lerp<kGrad, 2, kAmsgrad>(b, first, last, c);
}

// amsgrad is a template flag, as in fused_adamw_avx512.cpp: the plain path is the code it was.
template <DType kGrad>
int64_t blocks_amsgrad(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                       const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq_codes != nullptr) return blocks_out<kGrad, true>(b, first, last, c);
  return blocks_out<kGrad, false>(b, first, last, c);
}

}  // namespace

int64_t fused_adamw_int8_avx512(const Int8AdamWBuffers& b, int64_t block_begin, int64_t block_end,
                                const AdamWCoefficients& c) {
  if (b.block % kWidth != 0) return block_begin;
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return blocks_amsgrad<DType::kBFloat16>(b, block_begin, block_end, c);
    case DType::kFloat16:
      return blocks_amsgrad<DType::kFloat16>(b, block_begin, block_end, c);
    default:
      return blocks_amsgrad<DType::kFloat32>(b, block_begin, block_end, c);
  }
}

}  // namespace zero_ext::cpu
