// AVX-512 (AVX512F only) body of cpu::fused_adamw_int8, 16 elements per vector, full blocks only
// (the caller's scalar path takes a short last block). Compiled for AVX-512 by the target pragma
// alone, like fused_adamw_avx512.cpp; isa.cpp only selects it when cpuid reports AVX512F.
//
// Bitwise the scalar path (fused_adamw_int8.cpp): the same IEEE operations in the same order (FMA
// exactly where adamw_math.h calls fmaf; contraction off), the block absmax with the scalar's
// NaN-propagating comparison (max of non-NaN values does not depend on the order; a NaN is
// replaced by the canonical NaN), and the same quantizer (Int8Quantizer, fused_adamw_int8_math.h)
// lane by lane, its 8-entry tables repeated to 16 for VPERMPS/VPERMD. The structure of
// fused_adamw_int8_avx2.cpp: per block, decode the old codes, then update 16 lanes at a time,
// keeping the new moments and their absmax; then encode each moment, one 16-byte store per vector.
// NOTE: not measured on an AVX-512 machine (the dev machine of this change is AVX2-only). The old
// binary search gathered: 16.0 vs 4.1 ns/element against the fp32 op with 3 gathers per search on
// the Xeon dev VM, 42.8 with 8 (its NOTE), so ~40 ns per 16-lane gather there; this has none.
#pragma GCC target("avx512f")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "../fused_adamw_int8_math.h"
#include "fused_adamw_int8.h"

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

// ---- the quantizer (Int8Quantizer) lane by lane: each function is its scalar namesake in
// fused_adamw_int8_math.h with the same operations.
inline __m512i i32(int32_t x) { return _mm512_set1_epi32(x); }
inline __m512 f32(uint32_t bits) { return _mm512_castsi512_ps(i32(static_cast<int32_t>(bits))); }

// An 8-entry table twice, so a 16-lane permute by an index reads entry index & 7, as VPERMPS
// does with 8 lanes.
struct Table16 {
  alignas(64) uint32_t v[16];
};
constexpr Table16 twice(const uint32_t (&t)[8]) {
  Table16 r{};
  for (int i = 0; i < 16; ++i) r.v[i] = t[i & 7];
  return r;
}
constexpr Table16 kLadderSlope = twice(kInt8Quantizer.ladder_slope);
constexpr Table16 kLadderOffset = twice(kInt8Quantizer.ladder_offset);
constexpr Table16 kLadderDeltas = twice(kInt8Quantizer.ladder_deltas);
constexpr Table16 kDecadeBound = twice(kInt8Quantizer.decade_bound);
constexpr Table16 kDecadeScale = twice(kInt8Quantizer.decade_scale);
constexpr Table16 kDecadeShift = twice(kInt8Quantizer.decade_shift);
constexpr Table16 kDecadeStep = twice(kInt8Quantizer.decade_step);
constexpr Table16 kThresholdDeltas = twice(kInt8Quantizer.threshold_deltas);

inline __m512i table(const Table16& t) { return _mm512_load_si512(t.v); }
inline __m512 lookup(const Table16& t, __m512i index) {  // t[index & 7]
  return _mm512_permutexvar_ps(index, _mm512_castsi512_ps(table(t)));
}

// int8_delta
inline __m512i delta(const Table16& words, __m512i i) {
  const __m512i word = _mm512_permutexvar_epi32(_mm512_srli_epi32(i, 4), table(words));
  const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(i, i32(15)), 1);
  return _mm512_and_si512(_mm512_srlv_epi32(word, shift), i32(3));
}

// int8_ladder_bits
inline __m512 ladder_value(__m512i j) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(j, i32(1)));
  const __m512i slot = _mm512_srli_epi32(_mm512_castps_si512(f), 23);
  const __m512 approx = _mm512_fmadd_ps(f, lookup(kLadderSlope, slot), lookup(kLadderOffset, slot));
  return _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(approx), delta(kLadderDeltas, j)));
}

inline __m512i load_codes(const int8_t* codes) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}

// int8_exp_avg_sq_times
inline __m512 exp_avg_sq_times(__m512i codes, __m512 scale) {
  return _mm512_mul_ps(ladder_value(_mm512_and_si512(codes, i32(0x7F))), scale);
}

// int8_exp_avg_times
inline __m512 exp_avg_times(__m512i codes, __m512 scale) {
  const __m512i x = _mm512_sub_epi32(codes, i32(128));
  const __m512i j = _mm512_xor_si512(x, _mm512_srai_epi32(x, 31));
  const __mmask16 positive = _mm512_cmpgt_epi32_mask(x, _mm512_setzero_si512());
  const __mmask16 negative = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());
  const __m512 sign = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(positive, _mm512_set1_ps(1.0f)),
                                         negative, _mm512_set1_ps(-1.0f));
  return _mm512_mul_ps(ladder_value(j), _mm512_mul_ps(sign, scale));
}

// int8_ladder_count, except for a NaN: its count is INT32_MIN, which store_codes clamps to code 0
// (exp_avg's 128 +- INT32_MIN is negative too).
inline __m512i ladder_count(__m512 a) {
  const Int8Quantizer& q = kInt8Quantizer;
  const __m512 log10 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(a)),
                                       f32(q.decade_log[0]), f32(q.decade_log[1]));
  const __m512i estimate = _mm512_cvttps_epi32(_mm512_max_ps(log10, _mm512_setzero_ps()));
  const __mmask16 above = _mm512_cmp_ps_mask(lookup(kDecadeBound, estimate), a, _CMP_LT_OQ);
  const __m512i d = _mm512_mask_add_epi32(estimate, above, estimate, i32(1));
  const __m512 shift = lookup(kDecadeShift, d);
  const __m512i j = _mm512_cvtps_epi32(_mm512_fmadd_ps(a, lookup(kDecadeScale, d), shift));
  const __m512 approx =
      _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(j), shift), lookup(kDecadeStep, d));
  const __m512 t = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(approx), delta(kThresholdDeltas, j)));
  const __mmask16 at_or_below = _mm512_cmp_ps_mask(a, t, _CMP_LE_OQ);
  const __m512i raw = _mm512_mask_sub_epi32(j, at_or_below, j, i32(1));
  const __m512i hi = _mm512_sub_epi32(_mm512_sllv_epi32(i32(2), d), i32(2));
  return _mm512_min_epi32(raw, hi);
}

// int8_encode_exp_avg_sq
inline __m512i encode_exp_avg_sq(__m512 y) { return ladder_count(y); }

// int8_encode_exp_avg
inline __m512i encode_exp_avg(__m512 y) {
  const Int8Quantizer& q = kInt8Quantizer;
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i negative = _mm512_srai_epi32(bits, 31);
  const __mmask16 is_negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
  // |y|'s bits + 1 for y < 0; the min keeps the NaN 0xFFFFFFFF a NaN (not 0x80000000, -0)
  const __m512 a = _mm512_castsi512_ps(_mm512_min_epu32(
      _mm512_sub_epi32(_mm512_and_si512(bits, i32(0x7FFFFFFF)), negative), i32(0x7FFFFFFF)));
  const __m512 lo =
      _mm512_mask_blend_ps(is_negative, f32(q.exp_avg_near_zero[0]), f32(q.exp_avg_near_zero[1]));
  const __m512 hi = _mm512_mask_blend_ps(is_negative, f32(q.decade_bound[0]), _mm512_set1_ps(2.0f));
  // count + (lo < a) - (hi < a)
  __m512i x = ladder_count(a);
  x = _mm512_mask_add_epi32(x, _mm512_cmp_ps_mask(lo, a, _CMP_LT_OQ), x, i32(1));
  x = _mm512_mask_sub_epi32(x, _mm512_cmp_ps_mask(hi, a, _CMP_LT_OQ), x, i32(1));
  // 128 + x, or 128 - x for y < 0
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_xor_si512(x, negative), negative), i32(128));
}

// 16 codes (lanes <= 255; negative lanes become 0, as AVX2's unsigned saturation makes them).
inline void store_codes(int8_t* dst, __m512i codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm512_cvtepi32_epi8(_mm512_max_epi32(codes, _mm512_setzero_si512())));
}

// codes[j] = encode(x[j] / divisor) | extra[j] (the tie bits, or null), j < n (a multiple of 16).
template <bool kExpAvgSq>
inline void encode(const float* x, float divisor, const uint8_t* extra, int8_t* codes, int64_t n) {
  const __m512 div = _mm512_set1_ps(divisor);
  for (int64_t j = 0; j < n; j += kWidth) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + j), div);
    __m512i c = kExpAvgSq ? encode_exp_avg_sq(y) : encode_exp_avg(y);
    if (extra != nullptr)
      c = _mm512_or_si512(c, load_codes(reinterpret_cast<const int8_t*>(extra + j)));
    store_codes(codes + j, c);
  }
}

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
void block(const Int8AdamWBuffers& b, int64_t blk, const AdamWCoefficients& c) {
  alignas(64) float m_new[kInt8MaxBlock];
  alignas(64) float v_new[kInt8MaxBlock];
  alignas(64) float vmax_new[kAmsgrad ? kInt8MaxBlock : kWidth];
  alignas(64) uint8_t tie[kOut == 3 ? kInt8MaxBlock : kWidth];
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
  // Decode (into the new moments' buffers), then update, as fused_adamw_int8_avx2.cpp does.
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    _mm512_store_ps(m_new + j, exp_avg_times(load_codes(b.exp_avg_codes + i), m_scale));
    _mm512_store_ps(v_new + j, exp_avg_sq_times(load_codes(b.exp_avg_sq_codes + i), v_scale));
    if constexpr (kAmsgrad) {
      _mm512_store_ps(vmax_new + j,
                      exp_avg_sq_times(load_codes(b.max_exp_avg_sq_codes + i), vmax_scale));
    }
  }
  for (int64_t j = 0; j < b.block; j += kWidth) {
    const int64_t i = begin + j;
    __m512 m = _mm512_load_ps(m_new + j);
    __m512 v = _mm512_load_ps(v_new + j);
    __m512 master;
    if constexpr (kOut == 3) {  // join_master_bits (master_split.h); the tie is bit 7 of the code
      const __m512i hi = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(param + i))),
          16);
      const __m512i rem = _mm512_cvtepi16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.remainder + i)));
      const __m512i tie_in =
          _mm512_slli_epi32(_mm512_srli_epi32(load_codes(b.exp_avg_sq_codes + i), 7), 16);
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
      const __m512 old = _mm512_load_ps(vmax_new + j);
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
  encode<false>(m_new, encode_divisor(m_max), nullptr, b.exp_avg_codes + begin, b.block);
  encode<true>(v_new, encode_divisor(v_max), kOut == 3 ? tie : nullptr, b.exp_avg_sq_codes + begin,
               b.block);
  b.exp_avg_scales[blk] = m_max;
  b.exp_avg_sq_scales[blk] = v_max;
  if constexpr (kAmsgrad) {
    const float vmax_absmax = reduce_absmax(vmax_amax);
    encode<true>(vmax_new, encode_divisor(vmax_absmax), nullptr, b.max_exp_avg_sq_codes + begin,
                 b.block);
    b.max_exp_avg_sq_scales[blk] = vmax_absmax;
  }
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

int64_t int8_encode_avx512(bool exp_avg_sq, const float* x, float divisor, int8_t* codes,
                           int64_t n) {
  const int64_t done = n - n % kWidth;
  if (exp_avg_sq) {
    encode<true>(x, divisor, nullptr, codes, done);
  } else {
    encode<false>(x, divisor, nullptr, codes, done);
  }
  return done;
}

int64_t int8_decode_avx512(bool exp_avg_sq, const int8_t* codes, float scale, float* out,
                           int64_t n) {
  const int64_t done = n - n % kWidth;
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < done; j += kWidth) {
    const __m512i c = load_codes(codes + j);
    _mm512_storeu_ps(out + j, exp_avg_sq ? exp_avg_sq_times(c, s) : exp_avg_times(c, s));
  }
  return done;
}

}  // namespace zero_ext::cpu
