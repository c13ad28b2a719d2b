// CUDA body of the int8 fused AdamW step: the CPU scalar path's arithmetic
// (csrc/cpu/fused_adamw_int8.cpp, csrc/fused_adamw_int8_math.h). NEVER RUN: written on a machine
// without a GPU, compile-checked with nvcc (sm_80, sm_90). Two kernels, the same bits:
//  - 64-element blocks (the engine's; zero_ext/ops/int8.py BLOCK): fused_adamw_int8_lanes_kernel,
//    one pass in registers: a half-warp per quantization block, 4 consecutive elements per lane
//    with vector loads and stores, the block absmax by shuffles within the half-warp, no shared
//    memory and no barrier (bench/bench_fused_adamw.py --device cuda --precision holds it to 85 %
//    of the copy bandwidth on an H100, issue 37);
//  - any other block size (a multiple of 16 up to 4096): fused_adamw_int8_kernel, one thread block
//    per quantization block. Every thread reads the block's old scales, then takes elements
//    j = threadIdx.x, + blockDim.x, ...: dequantize, adamw_update, write the master/param, keep the
//    new moments in shared memory and a running |x| max; the block absmax by warp shuffles +
//    shared memory (NaN-propagating, so order does not matter; a NaN becomes the canonical NaN);
//    then encode and thread 0 writes the new scales.
// Dequantize and encode are the CPU's minifloat codes (fused_adamw_int8_math.h): integer
// operations on a register, no table. Expected bitwise equal to the CPU (same IEEE operations;
// explicit fmaf only, __fmul_rn where a product meets an add; sqrtf and '/' are correctly rounded
// under nvcc's defaults -prec-sqrt=true -prec-div=true); cuda_test_launchers checks the quantizer
// on every pattern, tests/kernels/test_fused_adamw_int8.py both kernels against the CPU's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "fused_adamw_int8.h"

namespace zero_ext::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarps = kMaxThreads / 32;

__device__ __forceinline__ double read_scalar(const DeviceScalar& s) {
  return s.ptr != nullptr ? static_cast<double>(*s.ptr) : s.value;
}

// The step's coefficients from its arguments (device scalars or values), in fp64 as on the CPU.
__device__ __forceinline__ AdamWCoefficients step_coefficients(const AdamWArgs& args) {
  return adamw_coefficients(read_scalar(args.lr), read_scalar(args.beta1), read_scalar(args.beta2),
                            read_scalar(args.eps), read_scalar(args.weight_decay),
                            read_scalar(args.step), read_scalar(args.grad_scale), args.maximize);
}

__device__ __forceinline__ float load_grad(const void* grad, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(grad)[i]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(grad)[i]);
    default:
      return static_cast<const float*>(grad)[i];
  }
}

// The NaN-propagating max over aligned groups of kLanes lanes (a power of two up to 32: xor offsets
// below kLanes stay inside the group). Every lane of the warp calls it (a full mask).
template <int kLanes>
__device__ __forceinline__ float lanes_absmax(float x) {
  for (int offset = kLanes / 2; offset >= 1; offset /= 2) {
    x = nan_propagating_max(__shfl_xor_sync(0xFFFFFFFFu, x, offset), x);
  }
  return x;
}

// The block-wide NaN-propagating max of every thread's `x` (blockDim.x a multiple of 32).
__device__ __forceinline__ float block_absmax(float x, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  x = lanes_absmax<32>(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.0f;
    x = lanes_absmax<32>(x);
    if (lane == 0) scratch[kWarps] = x;
  }
  __syncthreads();
  return finish_absmax(scratch[kWarps]);
}

// kOut: 0 = no param_out, 1 = bf16, 2 = fp16, 3 = the master is bf16 param_out + remainder + tie.
// kAmsgrad: max_exp_avg_sq is dequantized, updated by adamw_update<true> and requantized with its
// own block absmax, as exp_avg_sq (a template flag: the plain kernel is the code it was).
template <int kOut, bool kAmsgrad>
__global__ void __launch_bounds__(kMaxThreads)
    fused_adamw_int8_kernel(Int8AdamWBuffers b, AdamWArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const AdamWCoefficients c = step_coefficients(args);
  __shared__ float scratch[kAmsgrad ? 3 : 2][kWarps + 1];
  // m_new[block], v_new[block], (amsgrad) vmax_new[block], tie[block] (bytes): launch()'s smem.
  extern __shared__ float dynamic[];
  float* const m_new = dynamic;
  float* const v_new = dynamic + b.block;
  float* const vmax_new = dynamic + 2 * b.block;  // unused without amsgrad
  uint8_t* const tie = reinterpret_cast<uint8_t*>(dynamic + (kAmsgrad ? 3 : 2) * b.block);
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  const uint8_t* const m_codes_in = reinterpret_cast<const uint8_t*>(b.exp_avg_codes);
  const uint8_t* const v_codes_in = reinterpret_cast<const uint8_t*>(b.exp_avg_sq_codes);
  const uint8_t* const vmax_codes_in = reinterpret_cast<const uint8_t*>(b.max_exp_avg_sq_codes);
  const int64_t blocks = (b.n + b.block - 1) / b.block;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const int64_t begin = blk * b.block;
    const int64_t len = b.n - begin < b.block ? b.n - begin : b.block;
    const float m_scale = b.exp_avg_scales[blk];
    const float v_scale = b.exp_avg_sq_scales[blk];
    const float vmax_scale = kAmsgrad ? b.max_exp_avg_sq_scales[blk] : 0.0f;
    float m_amax = 0.0f;
    float v_amax = 0.0f;
    float vmax_amax = 0.0f;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const int64_t i = begin + j;
      const uint32_t vc = v_codes_in[i];
      // map[code] * scale, its products __fmul_rn (mul_rn): never contracted with adamw_update's
      // first add (g - m), so the dequantized moments round like the CPU's.
      float m = int8_exp_avg_times(m_codes_in[i], m_scale);
      float v = int8_exp_avg_sq_times(vc, v_scale);
      float v_max = kAmsgrad ? int8_exp_avg_sq_times(vmax_codes_in[i], vmax_scale) : 0.0f;
      float p = kOut == 3 ? __uint_as_float(join_master_bits(param[i], b.remainder[i], vc >> 7))
                          : b.master[i];
      adamw_update<kAmsgrad>(p, load_grad(b.grad, b.grad_dtype, i), m, v, v_max, c);
      if constexpr (kOut == 3) {
        const uint32_t bits = __float_as_uint(p);
        param[i] = param_of_master_bits(bits);
        b.remainder[i] = remainder_of_master_bits(bits);
        tie[j] = static_cast<uint8_t>(tie_of_master_bits(bits) << 7);
      } else {
        b.master[i] = p;
        tie[j] = 0;
      }
      if constexpr (kOut == 1) param[i] = param_of_master_bits(__float_as_uint(p));
      if constexpr (kOut == 2) {
        const __half h = __float2half_rn(p);
        param[i] = *reinterpret_cast<const uint16_t*>(&h);
      }
      m_new[j] = m;
      v_new[j] = v;
      m_amax = absmax_step(m_amax, m);
      v_amax = absmax_step(v_amax, v);
      if constexpr (kAmsgrad) {
        vmax_new[j] = v_max;
        vmax_amax = absmax_step(vmax_amax, v_max);
      }
    }
    // block_absmax's barriers also order every thread's read of the old scales before thread 0
    // writes the new ones, and the shared-memory moments before the encode below.
    m_amax = block_absmax(m_amax, scratch[0]);
    v_amax = block_absmax(v_amax, scratch[1]);
    if constexpr (kAmsgrad) vmax_amax = block_absmax(vmax_amax, scratch[2]);
    const float m_rcp = encode_reciprocal(m_amax);
    const float v_rcp = encode_reciprocal(v_amax);
    const float vmax_rcp = encode_reciprocal(vmax_amax);
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const int64_t i = begin + j;
      b.exp_avg_codes[i] =
          static_cast<int8_t>(static_cast<uint8_t>(int8_encode_exp_avg(mul_rn(m_new[j], m_rcp))));
      b.exp_avg_sq_codes[i] = static_cast<int8_t>(
          static_cast<uint8_t>(int8_encode_exp_avg_sq(mul_rn(v_new[j], v_rcp)) | tie[j]));
      if constexpr (kAmsgrad) {
        b.max_exp_avg_sq_codes[i] = static_cast<int8_t>(
            static_cast<uint8_t>(int8_encode_exp_avg_sq(mul_rn(vmax_new[j], vmax_rcp))));
      }
    }
    if (threadIdx.x == 0) {
      b.exp_avg_scales[blk] = m_amax;
      b.exp_avg_sq_scales[blk] = v_amax;
      if constexpr (kAmsgrad) b.max_exp_avg_sq_scales[blk] = vmax_amax;
    }
    __syncthreads();  // the next block reuses the shared buffers and the scratch
  }
}

// ---- The step for 64-element blocks (the engine's only block size, BLOCK in
// zero_ext/ops/int8.py), all in registers, one pass: each half-warp takes one quantization block,
// each lane 4 consecutive elements with vector loads and stores (master float4, grad and param 8
// bytes, codes 4 bytes), the block absmax by 4 shuffles within the half-warp. No shared memory, no
// barrier. The same per-element functions in the same order as fused_adamw_int8_kernel above and
// the CPU's scalar path, so the same bits. NEVER RUN (no GPU here).
constexpr int kLanesPerBlock = 16;  // 16 lanes x 4 elements = one 64-element block
constexpr int kLaneBlock = kLanesPerBlock * kVec;

// One lane's 4 elements from i (all < n when kFull, with every stream aligned for its vector
// access; otherwise each element guarded by i + k < n, one at a time).
template <int kOut, bool kAmsgrad, bool kFull>
__device__ __forceinline__ void lane_step(const Int8AdamWBuffers& b, const AdamWCoefficients& c,
                                          int64_t blk, int64_t i, bool active) {
  uint16_t* const param = static_cast<uint16_t*>(b.param_out);
  uint8_t* const m_codes = reinterpret_cast<uint8_t*>(b.exp_avg_codes);
  uint8_t* const v_codes = reinterpret_cast<uint8_t*>(b.exp_avg_sq_codes);
  uint8_t* const vmax_codes = reinterpret_cast<uint8_t*>(b.max_exp_avg_sq_codes);
  bool in[kVec];
  for (int k = 0; k < kVec; ++k) in[k] = active && (kFull || i + k < b.n);
  uint8_t mc[kVec] = {}, vc[kVec] = {}, xc[kVec] = {};
  float p[kVec] = {}, g[kVec] = {};
  if (kFull && active) {
    const uint32_t m4 = *reinterpret_cast<const uint32_t*>(m_codes + i);
    const uint32_t v4 = *reinterpret_cast<const uint32_t*>(v_codes + i);
    const uint32_t x4 = kAmsgrad ? *reinterpret_cast<const uint32_t*>(vmax_codes + i) : 0u;
    for (int k = 0; k < kVec; ++k) {
      mc[k] = static_cast<uint8_t>(m4 >> (8 * k));
      vc[k] = static_cast<uint8_t>(v4 >> (8 * k));
      xc[k] = static_cast<uint8_t>(x4 >> (8 * k));
    }
    if constexpr (kOut == 3) {
      const uint2 hp = *reinterpret_cast<const uint2*>(param + i);
      const uint2 hr = *reinterpret_cast<const uint2*>(b.remainder + i);
      const uint32_t pw[2] = {hp.x, hp.y};
      const uint32_t rw[2] = {hr.x, hr.y};
      for (int k = 0; k < kVec; ++k) {
        const uint16_t ph = static_cast<uint16_t>(pw[k / 2] >> (16 * (k % 2)));
        const int16_t rh = static_cast<int16_t>(static_cast<uint16_t>(rw[k / 2] >> (16 * (k % 2))));
        p[k] = __uint_as_float(join_master_bits(ph, rh, vc[k] >> 7));
      }
    } else {
      load4<float>(b.master + i, p);
    }
    switch (b.grad_dtype) {
      case DType::kBFloat16:
        load4<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(b.grad) + i, g);
        break;
      case DType::kFloat16:
        load4<__half>(static_cast<const __half*>(b.grad) + i, g);
        break;
      default:
        load4<float>(static_cast<const float*>(b.grad) + i, g);
        break;
    }
  } else {
    for (int k = 0; k < kVec; ++k) {
      if (!in[k]) continue;
      mc[k] = m_codes[i + k];
      vc[k] = v_codes[i + k];
      if constexpr (kAmsgrad) xc[k] = vmax_codes[i + k];
      p[k] = kOut == 3
                 ? __uint_as_float(join_master_bits(param[i + k], b.remainder[i + k], vc[k] >> 7))
                 : b.master[i + k];
      g[k] = load_grad(b.grad, b.grad_dtype, i + k);
    }
  }
  // Every lane reads its block's old scales before the absmax shuffles; the lane that writes the
  // new ones (below) does so after them, and its values depend on every lane's decode.
  const float m_scale = active ? b.exp_avg_scales[blk] : 0.0f;
  const float v_scale = active ? b.exp_avg_sq_scales[blk] : 0.0f;
  const float vmax_scale = kAmsgrad && active ? b.max_exp_avg_sq_scales[blk] : 0.0f;
  float m[kVec], v[kVec], vm[kVec];
  uint32_t tie[kVec] = {};
  float m_amax = 0.0f, v_amax = 0.0f, vmax_amax = 0.0f;
  for (int k = 0; k < kVec; ++k) {
    m[k] = int8_exp_avg_times(mc[k], m_scale);
    v[k] = int8_exp_avg_sq_times(vc[k], v_scale);
    vm[k] = kAmsgrad ? int8_exp_avg_sq_times(xc[k], vmax_scale) : 0.0f;
    if (!in[k]) continue;
    adamw_update<kAmsgrad>(p[k], g[k], m[k], v[k], vm[k], c);
    if constexpr (kOut == 3) tie[k] = tie_of_master_bits(__float_as_uint(p[k])) << 7;
    m_amax = absmax_step(m_amax, m[k]);
    v_amax = absmax_step(v_amax, v[k]);
    if constexpr (kAmsgrad) vmax_amax = absmax_step(vmax_amax, vm[k]);
  }
  m_amax = finish_absmax(lanes_absmax<kLanesPerBlock>(m_amax));
  v_amax = finish_absmax(lanes_absmax<kLanesPerBlock>(v_amax));
  if constexpr (kAmsgrad) vmax_amax = finish_absmax(lanes_absmax<kLanesPerBlock>(vmax_amax));
  if (!active) return;
  const float m_rcp = encode_reciprocal(m_amax);
  const float v_rcp = encode_reciprocal(v_amax);
  const float vmax_rcp = encode_reciprocal(vmax_amax);
  uint32_t m4 = 0, v4 = 0, x4 = 0;
  uint16_t ph[kVec], rh[kVec];
  for (int k = 0; k < kVec; ++k) {
    const uint32_t bits = __float_as_uint(p[k]);
    m4 |= int8_encode_exp_avg(mul_rn(m[k], m_rcp)) << (8 * k);
    v4 |= (int8_encode_exp_avg_sq(mul_rn(v[k], v_rcp)) | tie[k]) << (8 * k);
    if constexpr (kAmsgrad) x4 |= int8_encode_exp_avg_sq(mul_rn(vm[k], vmax_rcp)) << (8 * k);
    ph[k] = param_of_master_bits(bits);
    rh[k] = static_cast<uint16_t>(remainder_of_master_bits(bits));
    if constexpr (kOut == 2) {
      const __half h = __float2half_rn(p[k]);
      ph[k] = *reinterpret_cast<const uint16_t*>(&h);
    }
  }
  if (kFull) {
    *reinterpret_cast<uint32_t*>(m_codes + i) = m4;
    *reinterpret_cast<uint32_t*>(v_codes + i) = v4;
    if constexpr (kAmsgrad) *reinterpret_cast<uint32_t*>(vmax_codes + i) = x4;
    if constexpr (kOut == 0 || kOut == 1 || kOut == 2) store4<float>(b.master + i, p);
    if constexpr (kOut != 0) {
      *reinterpret_cast<uint2*>(param + i) =
          make_uint2(ph[0] | (static_cast<uint32_t>(ph[1]) << 16),
                     ph[2] | (static_cast<uint32_t>(ph[3]) << 16));
    }
    if constexpr (kOut == 3) {
      *reinterpret_cast<uint2*>(b.remainder + i) =
          make_uint2(rh[0] | (static_cast<uint32_t>(rh[1]) << 16),
                     rh[2] | (static_cast<uint32_t>(rh[3]) << 16));
    }
  } else {
    for (int k = 0; k < kVec; ++k) {
      if (!in[k]) continue;
      m_codes[i + k] = static_cast<uint8_t>(m4 >> (8 * k));
      v_codes[i + k] = static_cast<uint8_t>(v4 >> (8 * k));
      if constexpr (kAmsgrad) vmax_codes[i + k] = static_cast<uint8_t>(x4 >> (8 * k));
      if constexpr (kOut != 3) b.master[i + k] = p[k];
      if constexpr (kOut != 0) param[i + k] = ph[k];
      if constexpr (kOut == 3) b.remainder[i + k] = static_cast<int16_t>(rh[k]);
    }
  }
  if (i % kLaneBlock == 0) {  // the block's first lane
    b.exp_avg_scales[blk] = m_amax;
    b.exp_avg_sq_scales[blk] = v_amax;
    if constexpr (kAmsgrad) b.max_exp_avg_sq_scales[blk] = vmax_amax;
  }
}

// kAligned: every stream's base allows the lanes' vector accesses (launch checks lanes_aligned).
template <int kOut, bool kAmsgrad, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    fused_adamw_int8_lanes_kernel(Int8AdamWBuffers b, AdamWArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const AdamWCoefficients c = step_coefficients(args);
  const int64_t blocks = (b.n + kLaneBlock - 1) / kLaneBlock;
  const int64_t full_blocks = b.n / kLaneBlock;
  constexpr int64_t kBlocksPerCta = kThreads / kLanesPerBlock;
  // Whole warps iterate together (the shuffles take every lane): the loop runs over pairs of
  // blocks, a lane whose block is past the end takes part with no elements.
  const int lane_block = threadIdx.x / kLanesPerBlock;
  const int lane = threadIdx.x % kLanesPerBlock;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kBlocksPerCta; first < blocks;
       first += static_cast<int64_t>(gridDim.x) * kBlocksPerCta) {
    const int64_t blk = first + lane_block;
    const int64_t i = blk * kLaneBlock + lane * kVec;
    const bool active = blk < blocks;
    if (kAligned && blk < full_blocks) {
      lane_step<kOut, kAmsgrad, true>(b, c, blk, i, active);
    } else {
      lane_step<kOut, kAmsgrad, false>(b, c, blk, i, active);
    }
  }
}

// Whether every stream of b allows the lanes kernel's vector accesses at each lane's first element
// (a multiple of 4): 16 bytes for fp32, 8 for 16-bit streams, 4 for the codes.
inline bool lanes_aligned(const Int8AdamWBuffers& b) {
  const int64_t grad_bytes = b.grad_dtype == DType::kFloat32 ? 4 : 2;
  return vec_aligned(b.master, 4) && vec_aligned(b.grad, grad_bytes) &&
         vec_aligned(b.param_out, 2) && vec_aligned(b.remainder, 2) &&
         vec_aligned(b.exp_avg_codes, 1) && vec_aligned(b.exp_avg_sq_codes, 1) &&
         vec_aligned(b.max_exp_avg_sq_codes, 1);
}

template <int kOut, bool kAmsgrad>
cudaError_t launch(const Int8AdamWBuffers& b, const AdamWArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (b.block == kLaneBlock) {  // the engine's blocks: the register kernel
    const unsigned grid = grid_for(((b.n + kLaneBlock - 1) / kLaneBlock) * kLanesPerBlock, &err);
    if (err != cudaSuccess) return err;
    if (lanes_aligned(b)) {
      fused_adamw_int8_lanes_kernel<kOut, kAmsgrad, true><<<grid, kThreads, 0, stream>>>(b, args);
    } else {
      fused_adamw_int8_lanes_kernel<kOut, kAmsgrad, false><<<grid, kThreads, 0, stream>>>(b, args);
    }
    return cudaGetLastError();
  }
  const int sms = sm_count(&err);
  if (err != cudaSuccess) return err;
  const int64_t blocks = (b.n + b.block - 1) / b.block;
  // NOTE: 8 resident thread blocks per SM for 64-element blocks (64 threads each) is only 512
  // threads/SM; the grid-stride loop keeps them busy. Unmeasured (no GPU here).
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  const unsigned grid = static_cast<unsigned>(blocks < cap ? blocks : cap);
  // Whole warps (block_absmax shuffles with a full mask); threads past the block's end idle.
  const int64_t warps = (b.block + 31) / 32;
  const int threads = static_cast<int>(warps * 32 < kMaxThreads ? warps * 32 : kMaxThreads);
  const size_t smem = static_cast<size_t>(b.block) * ((kAmsgrad ? 3 : 2) * sizeof(float) + 1);
  // Above 48 KiB of dynamic shared memory a kernel must opt in: amsgrad at blocks > 3780 elements
  // (4096: 52 KiB, + 3.1 KiB static; sm_80 and sm_90 allow up to 163 and 227 KiB).
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(fused_adamw_int8_kernel<kOut, kAmsgrad>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  fused_adamw_int8_kernel<kOut, kAmsgrad><<<grid, threads, smem, stream>>>(b, args);
  return cudaGetLastError();
}

template <bool kAmsgrad>
cudaError_t launch_out(const Int8AdamWBuffers& b, const AdamWArgs& args, cudaStream_t stream) {
  if (b.remainder != nullptr) return launch<3, kAmsgrad>(b, args, stream);
  if (b.param_out == nullptr) return launch<0, kAmsgrad>(b, args, stream);
  if (b.param_out_dtype == DType::kBFloat16) return launch<1, kAmsgrad>(b, args, stream);
  return launch<2, kAmsgrad>(b, args, stream);
}

// The quantizer alone, as the step runs it (cuda_test_launchers checks every pattern with it):
// codes[i] = the code of x[i] * reciprocal, or out[i] = map[codes[i]] * scale.
__global__ void int8_encode_kernel(const float* x, float reciprocal, bool exp_avg_sq,
                                   uint8_t* codes, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float y = mul_rn(x[i], reciprocal);
    codes[i] =
        static_cast<uint8_t>(exp_avg_sq ? int8_encode_exp_avg_sq(y) : int8_encode_exp_avg(y));
  }
}

__global__ void int8_decode_kernel(const uint8_t* codes, float scale, bool exp_avg_sq, float* out,
                                   int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] =
        exp_avg_sq ? int8_exp_avg_sq_times(codes[i], scale) : int8_exp_avg_times(codes[i], scale);
  }
}

}  // namespace

cudaError_t launch_int8_encode(const float* x, float reciprocal, bool exp_avg_sq, uint8_t* codes,
                               int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  const unsigned grid = grid_for(n, &err);
  if (err != cudaSuccess) return err;
  int8_encode_kernel<<<grid, kThreads, 0, stream>>>(x, reciprocal, exp_avg_sq, codes, n);
  return cudaGetLastError();
}

cudaError_t launch_int8_decode(const uint8_t* codes, float scale, bool exp_avg_sq, float* out,
                               int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  const unsigned grid = grid_for(n, &err);
  if (err != cudaSuccess) return err;
  int8_decode_kernel<<<grid, kThreads, 0, stream>>>(codes, scale, exp_avg_sq, out, n);
  return cudaGetLastError();
}

cudaError_t launch_fused_adamw_int8(const Int8AdamWBuffers& b, const AdamWArgs& args,
                                    cudaStream_t stream) {
  if (b.n <= 0) return cudaSuccess;
  if (b.max_exp_avg_sq_codes != nullptr) return launch_out<true>(b, args, stream);
  return launch_out<false>(b, args, stream);
}

}  // namespace zero_ext::cuda
