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

// Round to nearest even with integer math: VCVTNEPS2BF16 would flush subnormals to zero.
inline __m256i float_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);  // NaN -> 0xFFFF like ATen
  return _mm512_cvtepi32_epi16(r);
}

// The master of a remainder run (kOut 3): param bits << 16 plus the sign-extended remainder
// (master_split.h join_master_bits).
inline __m512 load_joined_master(const AdamWBuffers& b, int64_t i) {
  const __m256i param =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<uint16_t*>(b.param_out) + i));
  const __m256i rem = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.remainder + i));
  const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(param), 16);
  return _mm512_castsi512_ps(_mm512_add_epi32(hi, _mm512_cvtepi16_epi32(rem)));
}

// master_split.h's param_of_master_bits and remainder_of_master_bits: (u + 0x8000) >> 16 (0xFFFF
// for NaN) and the low 16 bits (VPMOVDW truncates).
inline void store_split_master(const AdamWBuffers& b, int64_t i, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  hi = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.param_out) + i),
                      _mm512_cvtepi32_epi16(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.remainder + i), _mm512_cvtepi32_epi16(u));
}

template <DType kGrad, int kOut, bool kAmsgrad, bool kSmallWeight, bool kStream>
int64_t body(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 weight = _mm512_set1_ps(c.lerp_weight);
  const __m512 one_minus_weight = _mm512_set1_ps(1.0f - c.lerp_weight);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const __m512 g = _mm512_mul_ps(load_grad<kGrad>(b.grad, i), grad_scale);
    const __m512 master = kOut == 3 ? load_joined_master(b, i) : _mm512_loadu_ps(b.master + i);
    const __m512 p = _mm512_mul_ps(master, decay);
    __m512 m = _mm512_loadu_ps(static_cast<float*>(b.exp_avg) + i);
    __m512 v = _mm512_loadu_ps(static_cast<float*>(b.exp_avg_sq) + i);
    const __m512 diff = _mm512_sub_ps(g, m);
    // fnmadd(a, b, c) = -(a*b) + c rounded once: fmaf(-diff, 1 - w, g) of lerp (adamw_math.h).
    m = kSmallWeight ? _mm512_fmadd_ps(weight, diff, m)
                     : _mm512_fnmadd_ps(diff, one_minus_weight, g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));
    __m512 v_hat = v;
    if constexpr (kAmsgrad) {
      __m512 v_max = _mm512_loadu_ps(static_cast<float*>(b.max_exp_avg_sq) + i);
      // nan_propagating_max(v_max, v) (adamw_math.h): v_max where v_max > v or v_max is NaN.
      const __mmask16 keep =
          _mm512_cmp_ps_mask(v_max, v, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v_max, v_max, _CMP_UNORD_Q);
      v_max = _mm512_mask_blend_ps(keep, v, v_max);
      _mm512_storeu_ps(static_cast<float*>(b.max_exp_avg_sq) + i, v_max);
      v_hat = v_max;
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_hat), bc2_sqrt), eps);
    const __m512 p_new = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    if constexpr (kOut == 3) {
      store_split_master(b, i, p_new);
    } else {
      _mm512_storeu_ps(b.master + i, p_new);
    }
    _mm512_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
    _mm512_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
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

template <DType kGrad, int kOut, bool kAmsgrad, bool kStream>
int64_t body_lerp(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  // The branch of torch's lerp (adamw_math.h) depends only on the weight: pick it once per call.
  return __builtin_fabsf(c.lerp_weight) < 0.5f
             ? body<kGrad, kOut, kAmsgrad, true, kStream>(b, begin, end, c)
             : body<kGrad, kOut, kAmsgrad, false, kStream>(b, begin, end, c);
}

// Non-temporal stores for the write-only param_out stream of a large call (b.stream_out) when this
// range of it is 32-byte aligned: they skip the read (write-allocate) of param_out's cache lines
// (numbers in fused_adamw.cpp). Same values either way.
template <DType kGrad, int kOut, bool kAmsgrad>
int64_t body_store(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.param_out) + begin);
  if (b.stream_out && addr % 32 == 0)
    return body_lerp<kGrad, kOut, kAmsgrad, true>(b, begin, end, c);
  return body_lerp<kGrad, kOut, kAmsgrad, false>(b, begin, end, c);
}

template <DType kGrad, bool kAmsgrad>
int64_t body_out(const AdamWBuffers& b, int64_t begin, int64_t end, const AdamWCoefficients& c) {
  if (b.remainder != nullptr) return body_lerp<kGrad, 3, kAmsgrad, false>(b, begin, end, c);
  if (b.param_out == nullptr) return body_lerp<kGrad, 0, kAmsgrad, false>(b, begin, end, c);
  if (b.param_out_dtype == DType::kBFloat16)
    return body_store<kGrad, 1, kAmsgrad>(b, begin, end, c);
  return body_store<kGrad, 2, kAmsgrad>(b, begin, end, c);
}

// amsgrad is a template flag, so the plain path pays nothing for it (no load, no branch).
template <DType kGrad>
int64_t body_amsgrad(const AdamWBuffers& b, int64_t begin, int64_t end,
                     const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq == nullptr) return body_out<kGrad, false>(b, begin, end, c);
  return body_out<kGrad, true>(b, begin, end, c);
}

}  // namespace

int64_t fused_adamw_avx512(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return body_amsgrad<DType::kBFloat16>(b, begin, end, c);
    case DType::kFloat16:
      return body_amsgrad<DType::kFloat16>(b, begin, end, c);
    default:
      return body_amsgrad<DType::kFloat32>(b, begin, end, c);
  }
}

}  // namespace zero_ext::cpu
