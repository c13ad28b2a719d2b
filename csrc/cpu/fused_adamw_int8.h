// cpu::fused_adamw_int8: one fused AdamW step over a shard whose moments are block-quantized to
// int8 (csrc/fused_adamw_int8_math.h, tests/helpers/int8_reference.py). Torch-free, like kernels.h.
//
// Per block of `block` elements: dequantize exp_avg / exp_avg_sq with the block's old scales, run
// adamw_update (adamw_math.h, the fp32 kernels' formula) into a stack buffer while taking the
// new absmax, then encode the block with the new scales (two passes over a block that is in L1).
// The last block may be short (n not a multiple of block).
#pragma once
#include <cstdint>

#include "../adamw_math.h"
#include "../dtype.h"
#include "../fused_adamw_int8_math.h"  // Int8AdamWBuffers

namespace zero_ext::cpu {

// Largest block the kernels take (their per-block stack buffers: 2 * 4096 floats + 4096 bytes).
constexpr int64_t kInt8MaxBlock = 4096;

// Runs whole blocks [block_begin, block_end) (the last block of the tensor may be short), chunked
// over `num_threads` OpenMP threads, each chunk on the active SIMD path (isa.cpp) with the scalar
// path finishing what it leaves. Every path gives the same bits.
void fused_adamw_int8(const Int8AdamWBuffers& b, const AdamWCoefficients& c, int num_threads);

// The per-ISA bodies: each processes full blocks from block_begin while they fit before
// block_end, and returns the first block it did not process (the scalar one does them all).
int64_t fused_adamw_int8_scalar(const Int8AdamWBuffers& b, int64_t block_begin, int64_t block_end,
                                const AdamWCoefficients& c);
int64_t fused_adamw_int8_avx2(const Int8AdamWBuffers& b, int64_t block_begin, int64_t block_end,
                              const AdamWCoefficients& c);

// The quantizer of each path, as its kernel runs it (csrc/cpu/tests/test_int8_quantizer.cpp runs
// them over every code and every fp32 pattern of |x| <= 1). exp_avg_sq picks the map.
//  - encode: codes[j] = the code of x[j] * reciprocal;
//  - decode: out[j] = map[codes[j]] * scale (exp_avg_sq's: bit 7 ignored).
// Each does what its vectors cover and returns how many it did (the scalar ones all n).
int64_t int8_encode_scalar(bool exp_avg_sq, const float* x, float reciprocal, int8_t* codes,
                           int64_t n);
int64_t int8_encode_avx2(bool exp_avg_sq, const float* x, float reciprocal, int8_t* codes,
                         int64_t n);
int64_t int8_decode_scalar(bool exp_avg_sq, const int8_t* codes, float scale, float* out,
                           int64_t n);
int64_t int8_decode_avx2(bool exp_avg_sq, const int8_t* codes, float scale, float* out, int64_t n);

}  // namespace zero_ext::cpu
