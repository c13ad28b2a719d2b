// AVX2 lane helpers shared by the AVX2 kernels (fused_adamw_avx2.cpp, fused_adamw_int8_avx2.cpp):
// bf16/fp16 loads widened to fp32 lanes, float_to_bf16's rounding (rne_bf16_high), and the 16-bit
// stores. Include it after the file's `#pragma GCC target("avx2,f16c,fma")`: these are AVX2
// functions, and every file that includes it compiles them for the same target.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "../dtype.h"

namespace zero_ext::cpu::avx2 {

constexpr int64_t kWidth = 8;

// 8 bf16 (or 16-bit) values widened to the high half of 32-bit lanes (bits << 16, exact): the 16
// bytes broadcast to both halves by the load itself (VBROADCASTI128), then one in-lane byte
// shuffle puts elements 0-3 (low half) and 4-7 (high half) in place with zeros below. Same bits as
// VPMOVZXWD + VPSLLD 16, one shift fewer on the shift/shuffle pipes.
inline __m256i widen_bf16_bits(const uint16_t* p) {
  const __m256i x =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i to_high =
      _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, -1, -1, 8, 9, -1, -1,
                       10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return _mm256_shuffle_epi8(x, to_high);
}

template <DType kGrad>
inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(grad) + i;
    if constexpr (kGrad == DType::kFloat16) {  // exact, subnormals too
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    return _mm256_castsi256_ps(widen_bf16_bits(p));
  }
}

// ---- 16-bit results are computed in the high half of 32-bit lanes ("high-half form": bf16 bits
// << 16 plus low bits that the store drops) and narrowed with in-lane byte shuffles instead of a
// shift and a pack. NOTE: the bf16-moment step was compute-bound, not memory-bound: in L2 (8K
// elements, one thread, 2-core Zen 3 EPYC) it took 1.34 ns/element against the default's 0.78,
// and 57 instructions per vector issue fine; what it waited on is the vector shifts and shuffles:
// 18 per vector (on this EPYC one VPSHUFB ymm and one VPSRLD a cycle, ~1.4 a cycle mixed, and not
// slowed by divisions in flight: 24 shuffles an iteration take 22 cycles alone, 19 with 4 VDIVPS).
// With 10.5 (these narrowings, widen_bf16_bits, mix32_split, the 16-wide stores) and the pointers
// held in registers: 1.07-1.11 (default 0.68-0.72, remainders 1.16 -> 0.97-1.05), bitwise the
// same.

// Per 128-bit half: the high 16 bits of its 4 lanes to bytes 0-7 (kHighToLow) or 8-15
// (kHighToHigh), the low 16 bits to bytes 8-15 (kLowToHigh); the other bytes zero.
inline __m256i high_to_low8() {
  return _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,  //
                          2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
}
inline __m256i high_to_high8() {
  return _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15,  //
                          -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15);
}
inline __m256i low_to_high8() {
  return _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13,  //
                          -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13);
}

// The high halves of a's 8 lanes as 8 uint16 (a's lanes 0-3 are in the low 128 bits, 4-7 high).
inline __m128i narrow_high(__m256i a) {
  const __m256i x = _mm256_shuffle_epi8(a, high_to_low8());  // [a0-3 0 | a4-7 0]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(x, 0x08));
}

// Two 8 x uint16 stores: lo16 = a's halves picked by `a_mask` into bytes 0-7 of each 128-bit
// half, b's by `b_mask` into bytes 8-15, then one lane permute: [a0-7 | b0-7].
inline void store_pair(uint16_t* p, uint16_t* q, int64_t i, __m256i a, __m256i b, __m256i b_mask) {
  const __m256i ab = _mm256_or_si256(_mm256_shuffle_epi8(a, high_to_low8()),
                                     _mm256_shuffle_epi8(b, b_mask));  // [a0-3 b0-3 | a4-7 b4-7]
  const __m256i x = _mm256_permute4x64_epi64(ab, 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), _mm256_castsi256_si128(x));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm256_extracti128_si256(x, 1));
}

// 16 uint16 from two vectors of 8 (a: elements 0-7, b: 8-15) in one 256-bit store: the halves
// picked by a_mask / b_mask into bytes 0-7 / 8-15 of each 128-bit half give
// [a0-3 b0-3 | a4-7 b4-7], and one lane permute puts them in order.
inline __m256i join16(__m256i a, __m256i b, __m256i a_mask, __m256i b_mask) {
  const __m256i ab =
      _mm256_or_si256(_mm256_shuffle_epi8(a, a_mask), _mm256_shuffle_epi8(b, b_mask));
  return _mm256_permute4x64_epi64(ab, 0xD8);
}
inline __m256i low_to_low8() {
  return _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
}
inline void store16(void* p, int64_t i, __m256i x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), x);
}

// float_to_bf16's round to nearest even with integer math, in high-half form: bits + 0x7FFF +
// bit 16 (added as minus the all-ones compare mask: no shift), all ones for NaN (-> 0xFFFF).
// VCVTNEPS2BF16 would flush subnormals to zero.
inline __m256i rne_bf16_high(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bit16 = _mm256_set1_epi32(0x10000);
  const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(u, bit16), bit16);
  const __m256i r = _mm256_sub_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
  return _mm256_or_si256(r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

}  // namespace zero_ext::cpu::avx2
