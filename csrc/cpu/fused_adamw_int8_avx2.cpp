// AVX2 (+F16C, FMA) body of cpu::fused_adamw_int8, 8 elements per vector, full blocks only (the
// caller's scalar path takes a short last block). Compiled for AVX2 by the target pragma alone,
// like fused_adamw_avx2.cpp; isa.cpp only selects it when cpuid reports AVX2, F16C and FMA.
//
// Bitwise the scalar path (fused_adamw_int8.cpp): the same IEEE operations in the same order (FMA
// exactly where adamw_math.h calls fmaf; contraction off), and the minifloat codes
// (fused_adamw_int8_math.h) lane by lane, integer operations on the registers, no table. AVX-512
// machines run this body too. Blocks run in groups of ~1024 elements: decode the group's old codes
// (one loop), update it 16 elements a step keeping the new moments and each block's absmax, then
// encode both moments of the group in one pass.
// NOTE: the step is bound by the vector instructions it issues, not by the divider or memory (the
// in-cache time tracks their count, ~85 per 8 elements against the default step's ~40: 1.86x its
// time), the shifts and shuffles above all (avx2_lanes.h: about one of each a cycle on this EPYC,
// divisions in flight or not). AMD EPYC Zen 3 under KVM, one thread, 16K elements in cache, C++
// timing loop, min of 5 interleaved processes, ns/element: one block at a time 1.52 (the default
// 0.66); in groups 1.38; the encode of finite y without clamps or NaN tests, both moments from one
// pack, and the update 16 elements a step with avx2_lanes.h's widen/round/join 1.24. Tried and not
// kept: the group's decode fused into its update loop (no faster); the decode in 16-bit lanes with
// two unpacks to fp32 (fewer instructions but 5 shuffles per 16 codes against 4: 1.22
// against 1.20); one loop updating group g while encoding g - 1 and decoding g + 1 (1.94: the loop
// spills); non-temporal param stores (16M elements, 2 threads: 0.97x the default against 0.85x
// without); software prefetch 2K-8K elements ahead (no change beyond the noise). Memory-bound
// sizes: bench/results/precision_kernel_cost_avx2.md.
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <algorithm>

#include "../fused_adamw_int8_math.h"
#include "avx2_lanes.h"  // after the target pragma: its functions are AVX2 code
#include "fused_adamw_int8.h"

namespace zero_ext::cpu {
namespace {

using namespace avx2;

// absmax_step lane by lane, on the bits: |x|'s bits order as its value does, and every NaN's lie
// above inf's, so an integer max keeps a NaN once seen (finish_absmax makes it the canonical NaN).
// 2 operations instead of the float compare-and-blend's 5.
inline __m256i absmax_step(__m256i amax, __m256 x) {
  return _mm256_max_epi32(amax,
                          _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
}

// The block absmax from the lanes' running ones (the max of the lanes' bits).
inline float reduce_absmax(__m256i amax) {
  __m128i r = _mm_max_epi32(_mm256_castsi256_si128(amax), _mm256_extracti128_si256(amax, 1));
  r = _mm_max_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_max_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return finish_absmax(bits_float_hd(static_cast<uint32_t>(_mm_cvtsi128_si32(r))));
}

// ---- the codes lane by lane: each function is its scalar namesake in fused_adamw_int8_math.h
// with the same operations.
inline __m256i i32(uint32_t x) { return _mm256_set1_epi32(static_cast<int32_t>(x)); }

inline __m256i load_codes(const int8_t* codes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}

// int8_exp_avg_sq_times
inline __m256 exp_avg_sq_times(__m256i codes, __m256 scale) {
  const __m256i j = _mm256_and_si256(codes, i32(0x7F));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(j, i32(kInt8ExpAvgSqBias)), kInt8ExpAvgSqShift);
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), scale);
}

// int8_exp_avg_times
inline __m256 exp_avg_times(__m256i codes, __m256 scale) {
  const __m256i x = _mm256_sub_epi32(codes, i32(128));
  const __m256i j = _mm256_abs_epi32(x);
  const __m256i shifted =
      _mm256_slli_epi32(_mm256_add_epi32(j, i32(kInt8ExpAvgBias)), kInt8ExpAvgShift);
  const __m256i magnitude = _mm256_sign_epi32(shifted, j);  // 0 where j is 0 (G[0] = 0)
  const __m256i bits = _mm256_or_si256(magnitude, _mm256_and_si256(x, i32(0x80000000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), scale);
}

// The encodes below take finite y only (a NaN's code is the scalar path's business: see encode),
// and return the code before the saturation store_codes does: its two signed-saturating packs map
// every lane below 0 to 0 and above 255 to 255, the scalar codes' clamp to [0, 255]. So the
// clamps and the NaN test cost nothing here. (A block's y are |x| / absmax <= 1 + 2^-23.)

// (bits + half_down) >> shift - bias as one arithmetic shift: bits + kInt8ExpAvgHalfDown -
// (kInt8ExpAvgBias << shift) does not overflow for 0 <= bits <= inf's, and floor((u - B * 2^s) /
// 2^s) is floor(u / 2^s) - B.
constexpr int32_t kExpAvgRoundBias = static_cast<int32_t>(kInt8ExpAvgHalfDown) -
                                     static_cast<int32_t>(kInt8ExpAvgBias << kInt8ExpAvgShift);

// int8_encode_exp_avg of a finite y, before the saturation.
inline __m256i encode_exp_avg(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i negative = _mm256_srai_epi32(bits, 31);  // -1 or 0
  const __m256i a = _mm256_sub_epi32(_mm256_and_si256(bits, i32(0x7FFFFFFF)), negative);
  // int8_exp_avg_count(a)
  const __m256i rounded =
      _mm256_srai_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(kExpAvgRoundBias)), kInt8ExpAvgShift);
  const __m256i first = _mm256_srli_epi32(_mm256_cmpgt_epi32(a, i32(kInt8ExpAvgZeroThreshold)), 31);
  const __m256i count = _mm256_max_epi32(rounded, first);
  // 128 + count, or 128 - count for y < 0 (psignd: -count where bits < 0; count is 0 for +-0)
  return _mm256_add_epi32(_mm256_sign_epi32(count, bits), i32(128));
}

// int8_encode_exp_avg_sq of a finite y, before the saturation (y <= -0 has bits negative as an
// integer: its code is below 0, saturated to 0).
inline __m256i encode_exp_avg_sq(__m256 y) {
  const __m256i rounded = _mm256_add_epi32(_mm256_castps_si256(y), i32(kInt8ExpAvgSqHalfDown));
  return _mm256_sub_epi32(_mm256_srai_epi32(rounded, kInt8ExpAvgSqShift), i32(kInt8ExpAvgSqBias));
}

// 16 codes (two vectors of lanes <= 255; negative lanes saturate to 0) as 16 bytes.
inline void store_codes(int8_t* dst, __m256i a, __m256i b) {
  const __m256i words = _mm256_packus_epi32(a, b);  // a0-3 b0-3 | a4-7 b4-7
  const __m256i bytes =
      _mm256_packus_epi16(words, words);  // dwords 0, 1, 4, 5: a0-3 b0-3 a4-7 b4-7
  const __m256i order =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(order));
}

// codes[j] = encode(x[j] * reciprocal) | extra[j] (the tie bits, or null), j < n (a multiple of
// 16), every y = x[j] * reciprocal finite.
template <bool kExpAvgSq>
inline void encode_finite(const float* x, float reciprocal, const uint32_t* extra, int8_t* codes,
                          int64_t n) {
  const __m256 r = _mm256_set1_ps(reciprocal);
  for (int64_t j = 0; j < n; j += 2 * kWidth) {
    const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(x + j), r);
    const __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(x + j + kWidth), r);
    __m256i a = kExpAvgSq ? encode_exp_avg_sq(lo) : encode_exp_avg(lo);
    __m256i b = kExpAvgSq ? encode_exp_avg_sq(hi) : encode_exp_avg(hi);
    if (extra != nullptr) {
      a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(extra + j)));
      b = _mm256_or_si256(b,
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(extra + j + kWidth)));
    }
    store_codes(codes + j, a, b);
  }
}

inline bool finite(float x) { return (float_bits_hd(x) & 0x7F800000u) != 0x7F800000u; }

// A block's codes with its absmax `scale`: with scale and 1 / scale finite every y is finite and
// |y| <= 1 + 2^-23 (the vector codes); otherwise (a NaN or inf in the block, or a scale so small
// that its reciprocal overflows: some y are NaN) the scalar codes, with their NaN test and clamps.
template <bool kExpAvgSq>
inline void encode(const float* x, float scale, const uint32_t* extra, int8_t* codes, int64_t n) {
  const float reciprocal = encode_reciprocal(scale);
  if (finite(scale) && finite(reciprocal)) {
    encode_finite<kExpAvgSq>(x, reciprocal, extra, codes, n);
    return;
  }
  int8_encode_scalar(kExpAvgSq, x, reciprocal, codes, n);  // the scalar path's codes
  if (extra == nullptr) return;
  for (int64_t j = 0; j < n; ++j) codes[j] = static_cast<int8_t>(codes[j] | extra[j]);
}

// Both moments' codes of 8 elements (finite y) from one pack: words m0-3 v0-3 | m4-7 v4-7, bytes
// (dwords) m0-3 v0-3 . . | m4-7 v4-7 . ., dwords 0, 4, 1, 5: m0-7 v0-7.
template <bool kTie>
inline void encode_pair(const float* m, const float* v, const uint32_t* tie, __m256 m_rcp,
                        __m256 v_rcp, int8_t* m_codes, int8_t* v_codes) {
  const __m256i a = encode_exp_avg(_mm256_mul_ps(_mm256_load_ps(m), m_rcp));
  __m256i b = encode_exp_avg_sq(_mm256_mul_ps(_mm256_load_ps(v), v_rcp));
  if constexpr (kTie)
    b = _mm256_or_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(tie)));
  const __m256i words = _mm256_packus_epi32(a, b);
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const __m128i both = _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(m_codes), both);
  _mm_storeh_pi(reinterpret_cast<__m64*>(v_codes), _mm_castsi128_ps(both));
}

// Blocks are run in groups of about kGroupElements elements: each phase (decode, update, encode)
// runs over the whole group, so the update's divisions and square roots, whose latency tail would
// otherwise end every 64-element block, overlap the next ones, and the per-phase setup is paid once
// per group (256 to 2048 elements timed the same; 1024 keeps the group's moments in L1).
constexpr int64_t kGroupElements = 1024;

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
void group(const Int8AdamWBuffers& b, int64_t first, int64_t count, const AdamWCoefficients& c) {
  alignas(32) float m_new[kInt8MaxBlock];
  alignas(32) float v_new[kInt8MaxBlock];
  alignas(32) float vmax_new[kAmsgrad ? kInt8MaxBlock : kWidth];
  alignas(32) uint32_t tie[kOut == 3 ? kInt8MaxBlock : kWidth];
  float m_max[kGroupElements / 16];
  float v_max[kGroupElements / 16];
  float vmax_max[kAmsgrad ? kGroupElements / 16 : 1];
  const int64_t block = b.block;
  const int64_t begin = first * block;
  // The buffers in locals: a store through a code (a char type) could alias `b`, and the compiler
  // would reload every pointer from it each iteration.
  int8_t* const m_codes = b.exp_avg_codes + begin;
  int8_t* const v_codes = b.exp_avg_sq_codes + begin;
  int8_t* const vmax_codes = kAmsgrad ? b.max_exp_avg_sq_codes + begin : nullptr;
  float* const m_scales = b.exp_avg_scales + first;
  float* const v_scales = b.exp_avg_sq_scales + first;
  float* const vmax_scales = kAmsgrad ? b.max_exp_avg_sq_scales + first : nullptr;
  const void* const grad = b.grad;
  float* const master = b.master;
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  int16_t* const remainder = b.remainder;
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 weight = _mm256_set1_ps(c.lerp_weight);
  const __m256 one_minus_weight = _mm256_set1_ps(1.0f - c.lerp_weight);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  // Decode (into the new moments' buffers), then update: two short loops overlap more of their
  // iterations out of order than one long one.
  for (int64_t k = 0; k < count; ++k) {
    const __m256 m_scale = _mm256_set1_ps(m_scales[k]);
    const __m256 v_scale = _mm256_set1_ps(v_scales[k]);
    const __m256 vmax_scale = _mm256_set1_ps(kAmsgrad ? vmax_scales[k] : 0.0f);
    for (int64_t j = k * block; j < (k + 1) * block; j += kWidth) {
      _mm256_store_ps(m_new + j, exp_avg_times(load_codes(m_codes + j), m_scale));
      _mm256_store_ps(v_new + j, exp_avg_sq_times(load_codes(v_codes + j), v_scale));
      if constexpr (kAmsgrad) {
        _mm256_store_ps(vmax_new + j, exp_avg_sq_times(load_codes(vmax_codes + j), vmax_scale));
      }
    }
  }
  // The update, 16 elements a step (blocks are multiples of 16): the 16-bit outputs of two vectors
  // leave in one store each, as in fused_adamw_avx2.cpp.
  struct Out8 {
    __m256i param, delta;  // high-half form (avx2_lanes.h); delta: remainders only
    __m128i fp16;
  };
  const auto update8 = [&](int64_t j, __m256i& m_amax, __m256i& v_amax, __m256i& vmax_amax,
                           Out8& o) {
    const int64_t i = begin + j;
    __m256 m = _mm256_load_ps(m_new + j);
    __m256 v = _mm256_load_ps(v_new + j);
    __m256 p_old;
    if constexpr (kOut == 3) {  // join_master_bits (master_split.h); the tie is bit 7 of the code
      // sign-extended, a code with bit 7 set has bit 16 set: the tie bit's place in the master
      const __m256i tie_in = _mm256_and_si256(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v_codes + j))),
          _mm256_set1_epi32(0x10000));
      const __m256i rem =
          _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(remainder + i)));
      p_old = _mm256_castsi256_ps(
          _mm256_add_epi32(_mm256_add_epi32(widen_bf16_bits(param + i), tie_in), rem));
    } else {
      p_old = _mm256_loadu_ps(master + i);
    }
    // adamw_update (adamw_math.h), as in fused_adamw_avx2.cpp.
    const __m256 g = _mm256_mul_ps(load_grad<kGrad>(grad, i), grad_scale);
    const __m256 p = _mm256_mul_ps(p_old, decay);
    const __m256 diff = _mm256_sub_ps(g, m);
    m = kSmallWeight ? _mm256_fmadd_ps(weight, diff, m)
                     : _mm256_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));
    __m256 v_hat = v;  // the denominator's moment: v, or with amsgrad max_exp_avg_sq's new value
    if constexpr (kAmsgrad) {
      const __m256 old = _mm256_load_ps(vmax_new + j);
      // nan_propagating_max(old, v) (adamw_math.h): old where old > v or old is NaN.
      const __m256 keep =
          _mm256_or_ps(_mm256_cmp_ps(old, v, _CMP_GT_OQ), _mm256_cmp_ps(old, old, _CMP_UNORD_Q));
      v_hat = _mm256_blendv_ps(v, old, keep);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m256 p_new = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    if constexpr (kOut == 3) {
      // master_split.h's split: param = RNE, delta = bits - (param << 16) (the high-half form
      // with its low half cleared), remainder = delta's low 16 bits, tie = (delta == 0x8000).
      o.param = rne_bf16_high(p_new);
      o.delta = _mm256_sub_epi32(
          _mm256_castps_si256(p_new),
          _mm256_and_si256(o.param, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
      const __m256i is_tie = _mm256_cmpeq_epi32(o.delta, _mm256_set1_epi32(0x8000));
      _mm256_store_si256(reinterpret_cast<__m256i*>(tie + j),
                         _mm256_and_si256(is_tie, _mm256_set1_epi32(0x80)));
    } else {
      _mm256_storeu_ps(master + i, p_new);
      if constexpr (kOut == 1) o.param = rne_bf16_high(p_new);
      if constexpr (kOut == 2) o.fp16 = _mm256_cvtps_ph(p_new, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm256_store_ps(m_new + j, m);
    _mm256_store_ps(v_new + j, v);
    m_amax = absmax_step(m_amax, m);
    v_amax = absmax_step(v_amax, v);
    if constexpr (kAmsgrad) {
      _mm256_store_ps(vmax_new + j, v_hat);
      vmax_amax = absmax_step(vmax_amax, v_hat);
    }
  };
  for (int64_t k = 0; k < count; ++k) {
    __m256i m_amax = _mm256_setzero_si256();
    __m256i v_amax = _mm256_setzero_si256();
    __m256i vmax_amax = _mm256_setzero_si256();
    for (int64_t j = k * block; j < (k + 1) * block; j += 2 * kWidth) {
      Out8 a, z;
      update8(j, m_amax, v_amax, vmax_amax, a);
      update8(j + kWidth, m_amax, v_amax, vmax_amax, z);
      const int64_t i = begin + j;
      if constexpr (kOut == 1 || kOut == 3) {
        store16(param, i, join16(a.param, z.param, high_to_low8(), high_to_high8()));
      }
      if constexpr (kOut == 3) {
        store16(remainder, i, join16(a.delta, z.delta, low_to_low8(), low_to_high8()));
      }
      if constexpr (kOut == 2) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i), a.fp16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i + kWidth), z.fp16);
      }
    }
    m_max[k] = reduce_absmax(m_amax);
    v_max[k] = reduce_absmax(v_amax);
    if constexpr (kAmsgrad) vmax_max[k] = reduce_absmax(vmax_amax);
  }
  // The reciprocals first (divisions the compiler vectorizes, off the encode loop's path), then
  // both moments' codes in one pass when every block's scale and reciprocal are finite.
  alignas(32) float m_rcp[kGroupElements / 16];
  alignas(32) float v_rcp[kGroupElements / 16];
  uint32_t special = 0;  // some block's scale or reciprocal is inf or NaN
  for (int64_t k = 0; k < count; ++k) {
    m_rcp[k] = encode_reciprocal(m_max[k]);
    v_rcp[k] = encode_reciprocal(v_max[k]);
    special |= !finite(m_max[k]) | !finite(m_rcp[k]) | !finite(v_max[k]) | !finite(v_rcp[k]);
    m_scales[k] = m_max[k];
    v_scales[k] = v_max[k];
  }
  if (special == 0) {
    for (int64_t k = 0; k < count; ++k) {
      const __m256 mr = _mm256_set1_ps(m_rcp[k]);
      const __m256 vr = _mm256_set1_ps(v_rcp[k]);
      for (int64_t j = k * block; j < (k + 1) * block; j += kWidth) {
        encode_pair<kOut == 3>(m_new + j, v_new + j, kOut == 3 ? tie + j : nullptr, mr, vr,
                               m_codes + j, v_codes + j);
      }
    }
  } else {
    for (int64_t k = 0; k < count; ++k) {
      const int64_t j = k * block;
      encode<false>(m_new + j, m_max[k], nullptr, m_codes + j, block);
      encode<true>(v_new + j, v_max[k], kOut == 3 ? tie + j : nullptr, v_codes + j, block);
    }
  }
  if constexpr (kAmsgrad) {
    for (int64_t k = 0; k < count; ++k) {
      const int64_t j = k * block;
      encode<true>(vmax_new + j, vmax_max[k], nullptr, vmax_codes + j, block);
      vmax_scales[k] = vmax_max[k];
    }
  }
}

template <DType kGrad, int kOut, bool kSmallWeight, bool kAmsgrad>
int64_t blocks(const Int8AdamWBuffers& b, int64_t first, int64_t last, const AdamWCoefficients& c) {
  // The full blocks in [first, last), in groups of kGroupElements / block (at least 1).
  const int64_t end = std::min(last, b.n / b.block);
  const int64_t per_group = std::max<int64_t>(1, kGroupElements / b.block);
  int64_t blk = first;
  for (; blk < end; blk += per_group) {
    group<kGrad, kOut, kSmallWeight, kAmsgrad>(b, blk, std::min(per_group, end - blk), c);
  }
  return std::max(first, end);
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
  if (b.block % (2 * kWidth) != 0) return block_begin;
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return blocks_amsgrad<DType::kBFloat16>(b, block_begin, block_end, c);
    case DType::kFloat16:
      return blocks_amsgrad<DType::kFloat16>(b, block_begin, block_end, c);
    default:
      return blocks_amsgrad<DType::kFloat32>(b, block_begin, block_end, c);
  }
}

int64_t int8_encode_avx2(bool exp_avg_sq, const float* x, float reciprocal, int8_t* codes,
                         int64_t n) {
  // 16 lanes at a time through the kernel's vector codes where every y is finite with |y| <= 1 (in
  // the kernel: blocks with a finite scale and reciprocal), the scalar codes elsewhere.
  const int64_t done = n - n % (2 * kWidth);
  const __m256 r = _mm256_set1_ps(reciprocal);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 magnitude = _mm256_castsi256_ps(i32(0x7FFFFFFF));
  for (int64_t j = 0; j < done; j += 2 * kWidth) {
    const __m256 lo = _mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), r), magnitude);
    const __m256 hi = _mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + kWidth), r), magnitude);
    const __m256 in =
        _mm256_and_ps(_mm256_cmp_ps(lo, one, _CMP_LE_OQ), _mm256_cmp_ps(hi, one, _CMP_LE_OQ));
    if (_mm256_movemask_ps(in) != 0xFF) {
      int8_encode_scalar(exp_avg_sq, x + j, reciprocal, codes + j, 2 * kWidth);
    } else if (exp_avg_sq) {
      encode_finite<true>(x + j, reciprocal, nullptr, codes + j, 2 * kWidth);
    } else {
      encode_finite<false>(x + j, reciprocal, nullptr, codes + j, 2 * kWidth);
    }
  }
  return done;
}

int64_t int8_decode_avx2(bool exp_avg_sq, const int8_t* codes, float scale, float* out, int64_t n) {
  const int64_t done = n - n % kWidth;
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < done; j += kWidth) {
    const __m256i c = load_codes(codes + j);
    _mm256_storeu_ps(out + j, exp_avg_sq ? exp_avg_sq_times(c, s) : exp_avg_times(c, s));
  }
  return done;
}

}  // namespace zero_ext::cpu
