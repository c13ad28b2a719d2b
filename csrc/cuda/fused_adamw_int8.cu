// CUDA body of the int8 fused AdamW step: the CPU scalar path's arithmetic
// (csrc/cpu/fused_adamw_int8.cpp, csrc/fused_adamw_int8_math.h) with one thread block per
// quantization block. NEVER RUN: written on a machine without a GPU, compile-checked with nvcc.
//
// Per quantization block: every thread reads the block's old scales, then takes elements
// j = threadIdx.x, + blockDim.x, ...: dequantize, adamw_update, write the master/param, keep the
// new moments in shared memory and a running |x| max; the block absmax by warp shuffles + shared
// memory (NaN-propagating, so order does not matter; a NaN becomes the canonical NaN); then encode
// and thread 0 writes the new scales. Dequantize and encode are the CPU's minifloat codes
// (fused_adamw_int8_math.h): integer operations on a register, no table. Expected bitwise equal to
// the CPU (same IEEE operations; explicit fmaf only, __fmul_rn where a product meets an add; sqrtf
// and '/' are correctly rounded under nvcc's defaults -prec-sqrt=true -prec-div=true);
// cuda_test_launchers checks the quantizer on every pattern.
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

__device__ __forceinline__ float warp_absmax(float x) {
  for (int offset = 16; offset >= 1; offset /= 2) {
    x = nan_propagating_max(__shfl_xor_sync(0xFFFFFFFFu, x, offset), x);
  }
  return x;
}

// The block-wide NaN-propagating max of every thread's `x` (blockDim.x a multiple of 32).
__device__ __forceinline__ float block_absmax(float x, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  x = warp_absmax(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.0f;
    x = warp_absmax(x);
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
  const AdamWCoefficients c =
      adamw_coefficients(read_scalar(args.lr), read_scalar(args.beta1), read_scalar(args.beta2),
                         read_scalar(args.eps), read_scalar(args.weight_decay),
                         read_scalar(args.step), read_scalar(args.grad_scale), args.maximize);
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

template <int kOut, bool kAmsgrad>
cudaError_t launch(const Int8AdamWBuffers& b, const AdamWArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
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
