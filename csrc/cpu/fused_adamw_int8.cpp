// cpu::fused_adamw_int8 (fused_adamw_int8.h): the scalar path, which is the reference of the SIMD
// path (fused_adamw_int8_avx2.cpp, which AVX-512 machines run too: the same IEEE operations in the
// same order, FMA exactly where adamw_math.h calls fmaf), and the OpenMP driver.
#pragma GCC optimize("fp-contract=off")

#include "fused_adamw_int8.h"

#include <algorithm>

#include "../fused_adamw_int8_math.h"
#include "float_convert.h"
#include "kernels.h"

namespace zero_ext::cpu {
namespace {

// NOTE: one task = 1024 blocks of 64 (64K elements), as cpu::fused_adamw's chunks: below that a
// parallel region costs more than it saves on the 2-core dev VM.
constexpr int64_t kChunkElements = int64_t{1} << 16;

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + tie.
// kAmsgrad: max_exp_avg_sq is dequantized, updated by adamw_update<true> and requantized like
// exp_avg_sq (a template flag, so the plain path is the code it was).
template <DType kGrad, int kOut, bool kAmsgrad>
void scalar_block(const Int8AdamWBuffers& b, int64_t blk, const AdamWCoefficients& c) {
  const int64_t begin = blk * b.block;
  const int64_t len = std::min(b.n - begin, b.block);
  float m_new[kInt8MaxBlock];
  float v_new[kInt8MaxBlock];
  float vmax_new[kAmsgrad ? kInt8MaxBlock : 1];
  uint8_t tie[kInt8MaxBlock];
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  const uint8_t* const m_codes = reinterpret_cast<const uint8_t*>(b.exp_avg_codes) + begin;
  const uint8_t* const v_codes = reinterpret_cast<const uint8_t*>(b.exp_avg_sq_codes) + begin;
  const float m_scale = b.exp_avg_scales[blk];
  const float v_scale = b.exp_avg_sq_scales[blk];
  const uint8_t* const vmax_codes =
      kAmsgrad ? reinterpret_cast<const uint8_t*>(b.max_exp_avg_sq_codes) + begin : nullptr;
  const float vmax_scale = kAmsgrad ? b.max_exp_avg_sq_scales[blk] : 0.0f;
  float m_amax = 0.0f;
  float v_amax = 0.0f;
  float vmax_amax = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = begin + j;
    float m = int8_exp_avg_times(m_codes[j], m_scale);
    float v = int8_exp_avg_sq_times(v_codes[j], v_scale);
    float v_max = kAmsgrad ? int8_exp_avg_sq_times(vmax_codes[j], vmax_scale) : 0.0f;
    float p = kOut == 3 ? bits_float(join_master_bits(param[i], b.remainder[i], v_codes[j] >> 7))
                        : b.master[i];
    adamw_update<kAmsgrad>(p, load_as_float(b.grad, kGrad, i), m, v, v_max, c);
    if constexpr (kOut == 3) {
      const uint32_t bits = float_bits(p);
      param[i] = param_of_master_bits(bits);
      b.remainder[i] = remainder_of_master_bits(bits);
      tie[j] = static_cast<uint8_t>(tie_of_master_bits(bits) << 7);
    } else {
      b.master[i] = p;
      tie[j] = 0;
    }
    if constexpr (kOut == 1) param[i] = float_to_bf16(p);
    if constexpr (kOut == 2) param[i] = float_to_fp16(p);
    m_new[j] = m;
    v_new[j] = v;
    m_amax = absmax_step(m_amax, m);
    v_amax = absmax_step(v_amax, v);
    if constexpr (kAmsgrad) {
      vmax_new[j] = v_max;
      vmax_amax = absmax_step(vmax_amax, v_max);
    }
  }
  m_amax = finish_absmax(m_amax);
  v_amax = finish_absmax(v_amax);
  const float m_rcp = encode_reciprocal(m_amax);
  const float v_rcp = encode_reciprocal(v_amax);
  uint8_t* const m_out = reinterpret_cast<uint8_t*>(b.exp_avg_codes) + begin;
  uint8_t* const v_out = reinterpret_cast<uint8_t*>(b.exp_avg_sq_codes) + begin;
  for (int64_t j = 0; j < len; ++j) {
    m_out[j] = static_cast<uint8_t>(int8_encode_exp_avg(m_new[j] * m_rcp));
    v_out[j] = static_cast<uint8_t>(int8_encode_exp_avg_sq(v_new[j] * v_rcp) | tie[j]);
  }
  b.exp_avg_scales[blk] = m_amax;
  b.exp_avg_sq_scales[blk] = v_amax;
  if constexpr (kAmsgrad) {
    vmax_amax = finish_absmax(vmax_amax);
    const float vmax_rcp = encode_reciprocal(vmax_amax);
    uint8_t* const vmax_out = reinterpret_cast<uint8_t*>(b.max_exp_avg_sq_codes) + begin;
    for (int64_t j = 0; j < len; ++j) {
      vmax_out[j] = static_cast<uint8_t>(int8_encode_exp_avg_sq(vmax_new[j] * vmax_rcp));
    }
    b.max_exp_avg_sq_scales[blk] = vmax_amax;
  }
}

template <DType kGrad, bool kAmsgrad>
void scalar_blocks_out(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                       const AdamWCoefficients& c) {
  for (int64_t blk = first; blk < last; ++blk) {
    if (b.remainder != nullptr) {
      scalar_block<kGrad, 3, kAmsgrad>(b, blk, c);
    } else if (b.param_out == nullptr) {
      scalar_block<kGrad, 0, kAmsgrad>(b, blk, c);
    } else if (b.param_out_dtype == DType::kBFloat16) {
      scalar_block<kGrad, 1, kAmsgrad>(b, blk, c);
    } else {
      scalar_block<kGrad, 2, kAmsgrad>(b, blk, c);
    }
  }
}

template <DType kGrad>
void scalar_blocks(const Int8AdamWBuffers& b, int64_t first, int64_t last,
                   const AdamWCoefficients& c) {
  if (b.max_exp_avg_sq_codes != nullptr) {
    scalar_blocks_out<kGrad, true>(b, first, last, c);
  } else {
    scalar_blocks_out<kGrad, false>(b, first, last, c);
  }
}

void run_blocks(const Int8AdamWBuffers& b, int64_t first, int64_t last, const AdamWCoefficients& c,
                Isa isa) {
  // AVX-512 machines run the AVX2 body too: a 16-lane body would be a path this repository's
  // AVX2-only machine cannot test (whether it would be faster is unmeasured: the AVX2 body is
  // compute-bound on the EPYC, bench/results/precision_kernel_cost_avx2.md).
  if (isa == Isa::kAvx512 || isa == Isa::kAvx2) first = fused_adamw_int8_avx2(b, first, last, c);
  fused_adamw_int8_scalar(b, first, last, c);
}

}  // namespace

int64_t fused_adamw_int8_scalar(const Int8AdamWBuffers& b, int64_t block_begin, int64_t block_end,
                                const AdamWCoefficients& c) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      scalar_blocks<DType::kBFloat16>(b, block_begin, block_end, c);
      break;
    case DType::kFloat16:
      scalar_blocks<DType::kFloat16>(b, block_begin, block_end, c);
      break;
    default:
      scalar_blocks<DType::kFloat32>(b, block_begin, block_end, c);
      break;
  }
  return block_end;
}

int64_t int8_encode_scalar(bool exp_avg_sq, const float* x, float reciprocal, int8_t* codes,
                           int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float y = x[j] * reciprocal;
    const uint32_t code = exp_avg_sq ? int8_encode_exp_avg_sq(y) : int8_encode_exp_avg(y);
    codes[j] = static_cast<int8_t>(static_cast<uint8_t>(code));
  }
  return n;
}

int64_t int8_decode_scalar(bool exp_avg_sq, const int8_t* codes, float scale, float* out,
                           int64_t n) {
  const uint8_t* const u = reinterpret_cast<const uint8_t*>(codes);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = exp_avg_sq ? int8_exp_avg_sq_times(u[j], scale) : int8_exp_avg_times(u[j], scale);
  }
  return n;
}

void fused_adamw_int8(const Int8AdamWBuffers& b, const AdamWCoefficients& c, int num_threads) {
  if (b.n <= 0) return;
  const int64_t blocks = (b.n + b.block - 1) / b.block;
  const int64_t per_chunk = std::max<int64_t>(1, kChunkElements / b.block);
  const int64_t chunks = (blocks + per_chunk - 1) / per_chunk;
  const Isa isa = active_isa();
  if (chunks <= 1 || num_threads <= 1) {
    run_blocks(b, 0, blocks, c, isa);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, chunks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t k = 0; k < chunks; ++k) {
    run_blocks(b, k * per_chunk, std::min(blocks, (k + 1) * per_chunk), c, isa);
  }
}

}  // namespace zero_ext::cpu
