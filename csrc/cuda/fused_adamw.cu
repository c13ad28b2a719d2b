// Fused AdamW step over one contiguous shard: fp32 master/exp_avg/exp_avg_sq (and max_exp_avg_sq
// for amsgrad) updated in place, bf16/fp16/fp32 grad, optional bf16/fp16 copy of the new master.
// One pass over memory: the step is bandwidth-bound (16 B read + 12 B written per element for fp32
// state + bf16 grad, plus 2 B if param_out, plus 8 B with amsgrad), so the kernel's only jobs are
// wide accesses and enough bytes in flight.
#include <type_traits>

#include "../adamw_math.h"
#include "../master_split.h"
#include "common.cuh"
#include "kernels.h"

namespace zero_ext::cuda {
namespace {

struct NoParamOut {};  // param_out == nullptr: the store is compiled out.

// P = uint16_t: param_remainders. `master` is null, `param_out` holds the bf16 parameter's bits and
// the master is it joined with `remainder` (master_split.h), read and written back split.
template <typename P>
constexpr bool kSplit = std::is_same_v<P, uint16_t>;

__device__ __forceinline__ void load4_joined(const uint16_t* param, const int16_t* remainder,
                                             float (&out)[kVec]) {
  const ushort4 p = *reinterpret_cast<const ushort4*>(param);
  const short4 r = *reinterpret_cast<const short4*>(remainder);
  out[0] = __uint_as_float(join_master_bits(p.x, r.x));
  out[1] = __uint_as_float(join_master_bits(p.y, r.y));
  out[2] = __uint_as_float(join_master_bits(p.z, r.z));
  out[3] = __uint_as_float(join_master_bits(p.w, r.w));
}

__device__ __forceinline__ void store4_split(uint16_t* param, int16_t* remainder,
                                             const float (&in)[kVec]) {
  ushort4 p;
  short4 r;
  p.x = param_of_master_bits(__float_as_uint(in[0]));
  p.y = param_of_master_bits(__float_as_uint(in[1]));
  p.z = param_of_master_bits(__float_as_uint(in[2]));
  p.w = param_of_master_bits(__float_as_uint(in[3]));
  r.x = remainder_of_master_bits(__float_as_uint(in[0]));
  r.y = remainder_of_master_bits(__float_as_uint(in[1]));
  r.z = remainder_of_master_bits(__float_as_uint(in[2]));
  r.w = remainder_of_master_bits(__float_as_uint(in[3]));
  *reinterpret_cast<ushort4*>(param) = p;
  *reinterpret_cast<short4*>(remainder) = r;
}

__device__ __forceinline__ double read_scalar(const DeviceScalar& s) {
  return s.ptr != nullptr ? static_cast<double>(*s.ptr) : s.value;
}

// kAmsgrad: max_exp_avg_sq is read, updated and used (adamw_update<true>); otherwise it is null and
// never touched, so the plain kernel pays nothing for it.
template <typename G, typename P, bool kVectorized, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
    fused_adamw_kernel(float* __restrict__ master, const G* __restrict__ grad,
                       float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                       float* __restrict__ max_exp_avg_sq, P* __restrict__ param_out,
                       int16_t* __restrict__ remainder, int64_t n, AdamWArgs args) {
  // found_inf is read by every thread (one cached 4-byte load) so that a skipped step never needs
  // the host: nonzero (NaN included) => return before any write.
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;

  // Coefficients in double from the scalars, once per thread, with the CPU kernel's host code
  // (adamw_coefficients). CUDA's double pow is within 2 ulp of glibc's, so the rounded float
  // coefficients agree unless a double lies within ~1e-16 of a float rounding boundary.
  const AdamWCoefficients c =
      adamw_coefficients(read_scalar(args.lr), read_scalar(args.beta1), read_scalar(args.beta2),
                         read_scalar(args.eps), read_scalar(args.weight_decay),
                         read_scalar(args.step), read_scalar(args.grad_scale), args.maximize);

  // 64-bit indices throughout: a shard may exceed 2^31 elements.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;

  if constexpr (kVectorized) {
    const int64_t nvec = n / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      const int64_t base = i * kVec;
      float p[kVec], g[kVec], m[kVec], v[kVec], v_max[kVec] = {};
      if constexpr (kSplit<P>) {
        load4_joined(param_out + base, remainder + base, p);
      } else {
        load4(master + base, p);
      }
      load4(grad + base, g);
      load4(exp_avg + base, m);
      load4(exp_avg_sq + base, v);
      if constexpr (kAmsgrad) load4(max_exp_avg_sq + base, v_max);
#pragma unroll
      for (int k = 0; k < kVec; ++k) adamw_update<kAmsgrad>(p[k], g[k], m[k], v[k], v_max[k], c);
      if constexpr (kSplit<P>) {
        store4_split(param_out + base, remainder + base, p);
      } else {
        store4(master + base, p);
      }
      store4(exp_avg + base, m);
      store4(exp_avg_sq + base, v);
      if constexpr (kAmsgrad) store4(max_exp_avg_sq + base, v_max);
      if constexpr (!std::is_same_v<P, NoParamOut> && !kSplit<P>) store4(param_out + base, p);
    }
    scalar_begin = nvec * kVec;  // the < kVec-element tail
  }

  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    float p;
    if constexpr (kSplit<P>) {
      p = __uint_as_float(join_master_bits(param_out[i], remainder[i]));
    } else {
      p = master[i];
    }
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    float v_max = 0.0f;
    if constexpr (kAmsgrad) v_max = max_exp_avg_sq[i];
    adamw_update<kAmsgrad>(p, to_float(grad[i]), m, v, v_max, c);
    if constexpr (kSplit<P>) {
      param_out[i] = param_of_master_bits(__float_as_uint(p));
      remainder[i] = remainder_of_master_bits(__float_as_uint(p));
    } else {
      master[i] = p;
    }
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kAmsgrad) max_exp_avg_sq[i] = v_max;
    if constexpr (!std::is_same_v<P, NoParamOut> && !kSplit<P>) param_out[i] = from_float<P>(p);
  }
}

// The buffers of one launch, typed by the dispatch below.
struct Buffers {
  float* master;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  void* param_out;        // null when there is no low-precision copy
  int16_t* remainder;     // null unless param_remainders (then master is null)
};

template <typename G, typename P, bool kAmsgrad>
cudaError_t launch_typed(const Buffers& b, int64_t n, const AdamWArgs& args, cudaStream_t stream) {
  const G* g = static_cast<const G*>(b.grad);
  P* out = static_cast<P*>(b.param_out);
  // The vector path needs every stream aligned to its 4-element width (16 B fp32, 8 B bf16/fp16).
  // Views at odd offsets (possible through the op API, never for the engine's own flat buffers)
  // take the scalar path: correct, about half the bandwidth.
  const bool vectorized = vec_aligned(b.master, 4) && vec_aligned(b.exp_avg, 4) &&
                          vec_aligned(b.exp_avg_sq, 4) && vec_aligned(b.max_exp_avg_sq, 4) &&
                          vec_aligned(g, sizeof(G)) && (out == nullptr || vec_aligned(out, 2)) &&
                          vec_aligned(b.remainder, 2);
  cudaError_t err = cudaSuccess;
  const unsigned grid = grid_for(vectorized ? (n + kVec - 1) / kVec : n, &err);
  if (err != cudaSuccess) return err;
  if (vectorized) {
    fused_adamw_kernel<G, P, true, kAmsgrad><<<grid, kThreads, 0, stream>>>(
        b.master, g, b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq, out, b.remainder, n, args);
  } else {
    fused_adamw_kernel<G, P, false, kAmsgrad><<<grid, kThreads, 0, stream>>>(
        b.master, g, b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq, out, b.remainder, n, args);
  }
  return cudaGetLastError();
}

template <typename G, typename P>
cudaError_t launch_for_amsgrad(const Buffers& b, int64_t n, const AdamWArgs& args,
                               cudaStream_t stream) {
  if (b.max_exp_avg_sq == nullptr) return launch_typed<G, P, false>(b, n, args, stream);
  return launch_typed<G, P, true>(b, n, args, stream);
}

template <typename G>
cudaError_t launch_for_grad(const Buffers& b, DType param_out_dtype, int64_t n,
                            const AdamWArgs& args, cudaStream_t stream) {
  if (b.remainder != nullptr) return launch_for_amsgrad<G, uint16_t>(b, n, args, stream);
  if (b.param_out == nullptr) return launch_for_amsgrad<G, NoParamOut>(b, n, args, stream);
  switch (param_out_dtype) {
    case DType::kBFloat16:
      return launch_for_amsgrad<G, __nv_bfloat16>(b, n, args, stream);
    case DType::kFloat16:
      return launch_for_amsgrad<G, __half>(b, n, args, stream);
    default:
      return cudaErrorInvalidValue;  // the binding allows only bf16/fp16 param_out
  }
}

}  // namespace

cudaError_t launch_fused_adamw(float* master, const void* grad, DType grad_dtype, float* exp_avg,
                               float* exp_avg_sq, float* max_exp_avg_sq, void* param_out,
                               DType param_out_dtype, int64_t n, const AdamWArgs& args,
                               cudaStream_t stream, int16_t* remainder) {
  if (n <= 0) return cudaSuccess;  // nothing to launch
  const Buffers b{master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, remainder};
  switch (grad_dtype) {
    case DType::kFloat32:
      return launch_for_grad<float>(b, param_out_dtype, n, args, stream);
    case DType::kBFloat16:
      return launch_for_grad<__nv_bfloat16>(b, param_out_dtype, n, args, stream);
    case DType::kFloat16:
      return launch_for_grad<__half>(b, param_out_dtype, n, args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace zero_ext::cuda
