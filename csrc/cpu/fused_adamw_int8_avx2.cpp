// AVX2 (+F16C, FMA) body of cpu::fused_adamw_int8, 8 elements per vector, full blocks only (the
// caller's scalar path takes a short last block). Compiled for AVX2 by the target pragma alone,
// like fused_adamw_avx2.cpp; isa.cpp only selects it when cpuid reports AVX2, F16C and FMA.
//
// Bitwise the scalar path (fused_adamw_int8.cpp), for the reasons fused_adamw_int8_avx512.cpp
// gives: the same IEEE operations in the same order, gathers for the map and the thresholds.
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <cstring>

#include "../fused_adamw_int8_math.h"
#include "fused_adamw_int8.h"

namespace zero_ext::cpu {
namespace {

constexpr int64_t kWidth = 8;
constexpr float kExpAvgMap[] = ZERO_EXT_INT8_EXP_AVG_MAP;
constexpr float kExpAvgThresholds[] = ZERO_EXT_INT8_EXP_AVG_THRESHOLDS;
constexpr float kExpAvgSqMap[] = ZERO_EXT_INT8_EXP_AVG_SQ_MAP;
constexpr float kExpAvgSqThresholds[] = ZERO_EXT_INT8_EXP_AVG_SQ_THRESHOLDS;

template <DType kGrad>
inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kFloat16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Round to nearest even with integer math (NaN -> 0xFFFF), in the low 16 bits of each lane.
inline __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256 ordered = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, _mm256_castps_si256(ordered));
}

// The low 16 bits of each lane (truncating, like VPMOVDW).
inline __m128i narrow16(__m256i r) {
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The low byte of each lane, as 8 bytes.
inline void store_bytes(int8_t* dst, __m256i r) {
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i s = _mm256_shuffle_epi8(r, pick);
  const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(s, 0));
  const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(s, 4));
  const uint64_t bytes = lo | (static_cast<uint64_t>(hi) << 32);
  std::memcpy(dst, &bytes, sizeof(bytes));
}

inline __m256i load_codes(const int8_t* codes, int64_t i) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
}

// nan_propagating_max(|x|, amax) lane by lane (absmax_step).
inline __m256 absmax_step(__m256 amax, __m256 x) {
  const __m256 a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 take =
      _mm256_or_ps(_mm256_cmp_ps(a, amax, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_ps(amax, a, take);
}

inline float reduce_absmax(__m256 amax) {
  alignas(32) float lanes[kWidth];
  _mm256_store_ps(lanes, amax);
  float r = 0.0f;
  for (float a : lanes) r = zero_ext::absmax_step(r, a);
  return finish_absmax(r);
}

// Every 32nd threshold, thresholds[32e + 31] for e = 0..6 (the rest 0): the candidates of the
// binary search's steps of 32 and more, which one VPERMPS reads from a register without a gather.
struct CoarseThresholds {
  alignas(32) float values[8];
};

template <int kCodes>
const CoarseThresholds& coarse_thresholds(const float* thresholds) {
  static const CoarseThresholds table = [thresholds] {
    CoarseThresholds t{};
    for (int e = 0; 32 * e + 31 < kCodes - 1; ++e) t.values[e] = thresholds[32 * e + 31];
    return t;
  }();
  return table;
}

// encode_code: the count of thresholds below y, by the same binary search. At a step of s >= 32
// the candidate thresholds[pos + s - 1] is coarse[(pos + s) / 32 - 1] (pos is a multiple of 2s),
// read by a permute from `coarse` = coarse_thresholds<kCodes>; the smaller steps gather.
// NOTE: measured as in fused_adamw_int8_avx512.cpp: 75.7 vs 3.6 ns/element (20.8x the fp32 op)
// gathering at every step, 24.9 vs 3.2 (7.9x) with the permuted steps.
template <int kCodes>
inline __m256i encode(const float* thresholds, __m256 coarse, __m256 y) {
  __m256i pos = _mm256_setzero_si256();
  int step = kCodes / 2;
  for (; step >= 32; step /= 2) {
    const __m256i e = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(pos, _mm256_set1_epi32(step)), 5), _mm256_set1_epi32(1));
    const __m256 t = _mm256_permutevar8x32_ps(coarse, e);
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(t, y, _CMP_LT_OQ));
    pos = _mm256_add_epi32(pos, _mm256_and_si256(below, _mm256_set1_epi32(step)));
  }
  for (; step >= 1; step /= 2) {
    const __m256i idx = _mm256_add_epi32(pos, _mm256_set1_epi32(step - 1));
    const __m256 t = _mm256_i32gather_ps(thresholds, idx, 4);
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(t, y, _CMP_LT_OQ));
    pos = _mm256_add_epi32(pos, _mm256_and_si256(below, _mm256_set1_epi32(step)));
  }
  return pos;
}

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
void block(const Int8AdamWBuffers& b, int64_t blk, const AdamWCoefficients& c) {
  alignas(32) float m_new[kInt8MaxBlock];
  alignas(32) float v_new[kInt8MaxBlock];
  alignas(32) float vmax_new[kAmsgrad ? kInt8MaxBlock : kWidth];
  alignas(32) uint32_t tie[kInt8MaxBlock];
  const int64_t begin = blk * b.block;
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 weight = _mm256_set1_ps(c.lerp_weight);
  const __m256 one_minus_weight = _mm256_set1_ps(1.0f - c.lerp_weight);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  const __m256 m_scale = _mm256_set1_ps(b.exp_avg_scales[blk]);
  const __m256 v_scale = _mm256_set1_ps(b.exp_avg_sq_scales[blk]);
  const __m256 vmax_scale = _mm256_set1_ps(kAmsgrad ? b.max_exp_avg_sq_scales[blk] : 0.0f);
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  __m256 m_amax = _mm256_setzero_ps();
  __m256 v_amax = _mm256_setzero_ps();
  __m256 vmax_amax = _mm256_setzero_ps();
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    const __m256i v_codes = load_codes(b.exp_avg_sq_codes, i);
    __m256 m =
        _mm256_mul_ps(_mm256_i32gather_ps(kExpAvgMap, load_codes(b.exp_avg_codes, i), 4), m_scale);
    __m256 v = _mm256_mul_ps(
        _mm256_i32gather_ps(kExpAvgSqMap, _mm256_and_si256(v_codes, _mm256_set1_epi32(0x7F)), 4),
        v_scale);
    __m256 master;
    if constexpr (kOut == 3) {  // join_master_bits (master_split.h)
      const __m256i hi = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(param + i))), 16);
      const __m256i rem =
          _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.remainder + i)));
      const __m256i tie_in = _mm256_slli_epi32(_mm256_srli_epi32(v_codes, 7), 16);
      master = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_add_epi32(hi, rem), tie_in));
    } else {
      master = _mm256_loadu_ps(b.master + i);
    }
    // adamw_update (adamw_math.h), as in fused_adamw_avx2.cpp.
    const __m256 g = _mm256_mul_ps(load_grad<kGrad>(b.grad, i), grad_scale);
    const __m256 p = _mm256_mul_ps(master, decay);
    const __m256 diff = _mm256_sub_ps(g, m);
    m = kSmallWeight ? _mm256_fmadd_ps(weight, diff, m)
                     : _mm256_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));
    __m256 v_hat = v;  // the denominator's moment: v, or with amsgrad max_exp_avg_sq's new value
    if constexpr (kAmsgrad) {
      const __m256i codes =
          _mm256_and_si256(load_codes(b.max_exp_avg_sq_codes, i), _mm256_set1_epi32(0x7F));
      const __m256 old = _mm256_mul_ps(_mm256_i32gather_ps(kExpAvgSqMap, codes, 4), vmax_scale);
      // nan_propagating_max(old, v) (adamw_math.h): old where old > v or old is NaN.
      const __m256 keep =
          _mm256_or_ps(_mm256_cmp_ps(old, v, _CMP_GT_OQ), _mm256_cmp_ps(old, old, _CMP_UNORD_Q));
      v_hat = _mm256_blendv_ps(v, old, keep);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m256 p_new = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    if constexpr (kOut == 3) {  // master_split.h: param, remainder, tie of the master
      const __m256i u = _mm256_castps_si256(p_new);
      const __m256i hi = bf16_bits(p_new);
      const __m256i d = _mm256_sub_epi32(u, _mm256_slli_epi32(hi, 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i), narrow16(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.remainder + i), narrow16(d));
      const __m256i is_tie = _mm256_cmpeq_epi32(d, _mm256_set1_epi32(0x8000));
      _mm256_store_si256(reinterpret_cast<__m256i*>(tie + j),
                         _mm256_and_si256(is_tie, _mm256_set1_epi32(0x80)));
    } else {
      _mm256_storeu_ps(b.master + i, p_new);
    }
    if constexpr (kOut == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i), narrow16(bf16_bits(p_new)));
    }
    if constexpr (kOut == 2) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i),
                       _mm256_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT));
    }
    _mm256_store_ps(m_new + j, m);
    _mm256_store_ps(v_new + j, v);
    m_amax = absmax_step(m_amax, m);
    v_amax = absmax_step(v_amax, v);
    if constexpr (kAmsgrad) {
      _mm256_store_ps(vmax_new + j, v_hat);
      vmax_amax = absmax_step(vmax_amax, v_hat);
    }
  }
  const float m_max = reduce_absmax(m_amax);
  const float v_max = reduce_absmax(v_amax);
  const float vmax_absmax = kAmsgrad ? reduce_absmax(vmax_amax) : 0.0f;
  const __m256 m_div = _mm256_set1_ps(encode_divisor(m_max));
  const __m256 v_div = _mm256_set1_ps(encode_divisor(v_max));
  const __m256 vmax_div = _mm256_set1_ps(encode_divisor(vmax_absmax));
  const __m256 m_coarse =
      _mm256_load_ps(coarse_thresholds<kInt8ExpAvgCodes>(kExpAvgThresholds).values);
  const __m256 v_coarse =
      _mm256_load_ps(coarse_thresholds<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds).values);
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    store_bytes(b.exp_avg_codes + i,
                encode<kInt8ExpAvgCodes>(kExpAvgThresholds, m_coarse,
                                         _mm256_div_ps(_mm256_load_ps(m_new + j), m_div)));
    __m256i vc = encode<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds, v_coarse,
                                            _mm256_div_ps(_mm256_load_ps(v_new + j), v_div));
    if constexpr (kOut == 3) {
      vc = _mm256_or_si256(vc, _mm256_load_si256(reinterpret_cast<const __m256i*>(tie + j)));
    }
    store_bytes(b.exp_avg_sq_codes + i, vc);
    if constexpr (kAmsgrad) {
      store_bytes(
          b.max_exp_avg_sq_codes + i,
          encode<kInt8ExpAvgSqCodes>(kExpAvgSqThresholds, v_coarse,
                                     _mm256_div_ps(_mm256_load_ps(vmax_new + j), vmax_div)));
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

// amsgrad is a template flag, as in fused_adamw_avx2.cpp: the plain path is the code it was.
template <DType kGrad>
int64_t blocks_amsgrad(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                       const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq_codes != nullptr) return blocks_out<kGrad, true>(b, first, last, c);
  return blocks_out<kGrad, false>(b, first, last, c);
}

}  // namespace

int64_t fused_adamw_int8_avx2(const Int8AdamWBuffers& b, int64_t block_begin, int64_t block_end,
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
