// Fused AdamW step over one contiguous shard: fp32 master, fp32 or bf16 exp_avg/exp_avg_sq (and
// max_exp_avg_sq for amsgrad) updated in place, bf16/fp16/fp32 grad, optional bf16/fp16 copy of the
// new master; with param_remainders the master is the bf16 parameter + remainder + tie bit. bf16
// moments are stored with stochastic rounding (stochastic_rounding.h, the CPU kernel's formula).
// One pass over memory: the step is bandwidth-bound (16 B read + 12 B written per element for fp32
// state + bf16 grad, plus 2 B if param_out, plus 8 B with amsgrad), so the kernel's only jobs are
// wide accesses and enough bytes in flight.
#include <type_traits>

#include "../adamw_math.h"
#include "../master_split.h"
#include "../stochastic_rounding.h"
#include "common.cuh"
#include "kernels.h"

namespace zero_ext::cuda {
namespace {

struct NoParamOut {};  // param_out == nullptr: the store is compiled out.

// P = uint16_t: param_remainders. `master` is null, `param_out` holds the bf16 parameter's bits and
// the master is it joined with `remainder` and the tie bit in exp_avg_sq's sign bit
// (master_split.h), read and written back split.
template <typename P>
constexpr bool kSplit = std::is_same_v<P, uint16_t>;

// M: how the moments are stored, float (fp32) or uint16_t (bf16 bits, stochastic rounding on store,
// stochastic_rounding.h). The kernel moves every moment as raw bits (uint32 per element) so the
// tie bit and the bf16 rounding are integer operations on them.
template <typename M>
constexpr bool kBf16 = std::is_same_v<M, uint16_t>;
template <typename M>
constexpr uint32_t kSignShift = kBf16<M> ? 15 : 31;

template <typename M>
__device__ __forceinline__ void load4_raw(const M* p, uint32_t (&out)[kVec]) {
  if constexpr (kBf16<M>) {
    const ushort4 v = *reinterpret_cast<const ushort4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
}

template <typename M>
__device__ __forceinline__ void store4_raw(M* p, const uint32_t (&in)[kVec]) {
  if constexpr (kBf16<M>) {
    *reinterpret_cast<ushort4*>(p) = make_ushort4(in[0], in[1], in[2], in[3]);
  } else {
    *reinterpret_cast<uint4*>(p) = make_uint4(in[0], in[1], in[2], in[3]);
  }
}

template <typename M>
__device__ __forceinline__ uint32_t load_raw(const M* p, int64_t i) {
  if constexpr (kBf16<M>) {
    return p[i];
  } else {
    return __float_as_uint(p[i]);
  }
}

template <typename M>
__device__ __forceinline__ void store_raw(M* p, int64_t i, uint32_t raw) {
  if constexpr (kBf16<M>) {
    p[i] = static_cast<uint16_t>(raw);
  } else {
    p[i] = __uint_as_float(raw);
  }
}

// A stored moment's value (fp32 bits as they are; bf16 bits are the high half of an fp32).
template <typename M>
__device__ __forceinline__ float moment_value(uint32_t raw) {
  return __uint_as_float(kBf16<M> ? raw << 16 : raw);
}

// The stored bits of a new moment: fp32 as is, bf16 rounded stochastically with the 16 random bits
// r.
template <typename M>
__device__ __forceinline__ uint32_t moment_bits(float x, uint32_t r) {
  if constexpr (kBf16<M>) {
    return sr_bf16(x, r);
  } else {
    return __float_as_uint(x);
  }
}

// With param_remainders: takes the tie bit out of exp_avg_sq's stored bits.
template <typename M>
__device__ __forceinline__ uint32_t take_tie(uint32_t& v_raw) {
  const uint32_t tie = v_raw >> kSignShift<M>;
  v_raw &= ~(1u << kSignShift<M>);
  return tie;
}

// ... and puts the new one back as the sign bit (replacing the sign of a NaN).
template <typename M>
__device__ __forceinline__ uint32_t put_tie(uint32_t v_raw, uint32_t tie) {
  return (v_raw & ~(1u << kSignShift<M>)) | (tie << kSignShift<M>);
}

// One element: the stored moments in, the update (adamw_math.h), the stored moments out. `idx` is
// the element's canonical index (element_offset + i), used only for bf16 moments.
template <typename M, bool kAmsgrad>
__device__ __forceinline__ void update_element(float& p, float g, uint32_t& m_raw, uint32_t& v_raw,
                                               uint32_t& v_max_raw, const AdamWCoefficients& c,
                                               uint32_t key, uint64_t idx) {
  float m = moment_value<M>(m_raw);
  float v = moment_value<M>(v_raw);
  float v_max = kAmsgrad ? moment_value<M>(v_max_raw) : 0.0f;
  adamw_update<kAmsgrad>(p, g, m, v, v_max, c);
  const uint32_t h = kBf16<M> ? random_bits(key, idx) : 0u;
  m_raw = moment_bits<M>(m, h & 0xFFFFu);
  v_raw = moment_bits<M>(v, h >> 16);
  if constexpr (kAmsgrad) v_max_raw = moment_bits<M>(v_max, h >> 16);
}

__device__ __forceinline__ void load4_joined(const uint16_t* param, const int16_t* remainder,
                                             const uint32_t (&tie)[kVec], float (&out)[kVec]) {
  const ushort4 p = *reinterpret_cast<const ushort4*>(param);
  const short4 r = *reinterpret_cast<const short4*>(remainder);
  out[0] = __uint_as_float(join_master_bits(p.x, r.x, tie[0]));
  out[1] = __uint_as_float(join_master_bits(p.y, r.y, tie[1]));
  out[2] = __uint_as_float(join_master_bits(p.z, r.z, tie[2]));
  out[3] = __uint_as_float(join_master_bits(p.w, r.w, tie[3]));
}

__device__ __forceinline__ void store4_split(uint16_t* param, int16_t* remainder,
                                             const float (&in)[kVec], uint32_t (&tie)[kVec]) {
  ushort4 p;
  short4 r;
  uint32_t u[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    u[k] = __float_as_uint(in[k]);
    tie[k] = tie_of_master_bits(u[k]);
  }
  p.x = param_of_master_bits(u[0]);
  p.y = param_of_master_bits(u[1]);
  p.z = param_of_master_bits(u[2]);
  p.w = param_of_master_bits(u[3]);
  r.x = remainder_of_master_bits(u[0]);
  r.y = remainder_of_master_bits(u[1]);
  r.z = remainder_of_master_bits(u[2]);
  r.w = remainder_of_master_bits(u[3]);
  *reinterpret_cast<ushort4*>(param) = p;
  *reinterpret_cast<short4*>(remainder) = r;
}

__device__ __forceinline__ double read_scalar(const DeviceScalar& s) {
  return s.ptr != nullptr ? static_cast<double>(*s.ptr) : s.value;
}

// kAmsgrad: max_exp_avg_sq is read, updated and used (adamw_update<true>); otherwise it is null and
// never touched, so the plain kernel pays nothing for it. M: the moments' storage (float or bf16
// bits); the fp32 kernel computes no hash.
template <typename G, typename P, typename M, bool kVectorized, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
    fused_adamw_kernel(float* __restrict__ master, const G* __restrict__ grad,
                       M* __restrict__ exp_avg, M* __restrict__ exp_avg_sq,
                       M* __restrict__ max_exp_avg_sq, P* __restrict__ param_out,
                       int16_t* __restrict__ remainder, int64_t n, AdamWArgs args) {
  // found_inf is read by every thread (one cached 4-byte load) so that a skipped step never needs
  // the host: nonzero (NaN included) => return before any write.
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;

  // Coefficients in double from the scalars, once per thread, with the CPU kernel's host code
  // (adamw_coefficients). CUDA's double pow is within 2 ulp of glibc's, so the rounded float
  // coefficients agree unless a double lies within ~1e-16 of a float rounding boundary.
  const double step = read_scalar(args.step);
  const AdamWCoefficients c = adamw_coefficients(
      read_scalar(args.lr), read_scalar(args.beta1), read_scalar(args.beta2), read_scalar(args.eps),
      read_scalar(args.weight_decay), step, read_scalar(args.grad_scale), args.maximize);
  // The step is a whole number (the engine's count), so the key is the CPU kernel's exactly.
  const uint32_t key = kBf16<M> ? rounding_key(args.rounding_seed, step) : 0u;
  const uint64_t offset = args.element_offset;

  // 64-bit indices throughout: a shard may exceed 2^31 elements.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;

  if constexpr (kVectorized) {
    const int64_t nvec = n / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      const int64_t base = i * kVec;
      float p[kVec], g[kVec];
      uint32_t m[kVec], v[kVec], v_max[kVec] = {}, tie[kVec] = {};
      load4_raw(exp_avg + base, m);
      load4_raw(exp_avg_sq + base, v);
      if constexpr (kAmsgrad) load4_raw(max_exp_avg_sq + base, v_max);
      if constexpr (kSplit<P>) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) tie[k] = take_tie<M>(v[k]);
        load4_joined(param_out + base, remainder + base, tie, p);
      } else {
        load4(master + base, p);
      }
      load4(grad + base, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        update_element<M, kAmsgrad>(p[k], g[k], m[k], v[k], v_max[k], c, key,
                                    offset + static_cast<uint64_t>(base + k));
      }
      if constexpr (kSplit<P>) {
        store4_split(param_out + base, remainder + base, p, tie);
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = put_tie<M>(v[k], tie[k]);
      } else {
        store4(master + base, p);
      }
      store4_raw(exp_avg + base, m);
      store4_raw(exp_avg_sq + base, v);
      if constexpr (kAmsgrad) store4_raw(max_exp_avg_sq + base, v_max);
      if constexpr (!std::is_same_v<P, NoParamOut> && !kSplit<P>) store4(param_out + base, p);
    }
    scalar_begin = nvec * kVec;  // the < kVec-element tail
  }

  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    uint32_t m = load_raw(exp_avg, i);
    uint32_t v = load_raw(exp_avg_sq, i);
    uint32_t v_max = kAmsgrad ? load_raw(max_exp_avg_sq, i) : 0u;
    float p;
    uint32_t tie = 0;
    if constexpr (kSplit<P>) {
      tie = take_tie<M>(v);
      p = __uint_as_float(join_master_bits(param_out[i], remainder[i], tie));
    } else {
      p = master[i];
    }
    update_element<M, kAmsgrad>(p, to_float(grad[i]), m, v, v_max, c, key,
                                offset + static_cast<uint64_t>(i));
    if constexpr (kSplit<P>) {
      const uint32_t u = __float_as_uint(p);
      param_out[i] = param_of_master_bits(u);
      remainder[i] = remainder_of_master_bits(u);
      v = put_tie<M>(v, tie_of_master_bits(u));
    } else {
      master[i] = p;
    }
    store_raw(exp_avg, i, m);
    store_raw(exp_avg_sq, i, v);
    if constexpr (kAmsgrad) store_raw(max_exp_avg_sq, i, v_max);
    if constexpr (!std::is_same_v<P, NoParamOut> && !kSplit<P>) param_out[i] = from_float<P>(p);
  }
}

// The buffers of one launch, typed by the dispatch below.
struct Buffers {
  float* master;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null unless amsgrad
  void* param_out;       // null when there is no low-precision copy
  int16_t* remainder;    // null unless param_remainders (then master is null)
};

template <typename G, typename P, typename M, bool kAmsgrad>
cudaError_t launch_typed(const Buffers& b, int64_t n, const AdamWArgs& args, cudaStream_t stream) {
  const G* g = static_cast<const G*>(b.grad);
  P* out = static_cast<P*>(b.param_out);
  M* m = static_cast<M*>(b.exp_avg);
  M* v = static_cast<M*>(b.exp_avg_sq);
  M* v_max = static_cast<M*>(b.max_exp_avg_sq);
  // The vector path needs every stream aligned to its 4-element width (16 B fp32, 8 B bf16/fp16).
  // Views at odd offsets (possible through the op API, never for the engine's own flat buffers)
  // take the scalar path: correct, about half the bandwidth.
  const bool vectorized = vec_aligned(b.master, 4) && vec_aligned(m, sizeof(M)) &&
                          vec_aligned(v, sizeof(M)) && vec_aligned(v_max, sizeof(M)) &&
                          vec_aligned(g, sizeof(G)) && (out == nullptr || vec_aligned(out, 2)) &&
                          vec_aligned(b.remainder, 2);
  cudaError_t err = cudaSuccess;
  const unsigned grid = grid_for(vectorized ? (n + kVec - 1) / kVec : n, &err);
  if (err != cudaSuccess) return err;
  if (vectorized) {
    fused_adamw_kernel<G, P, M, true, kAmsgrad>
        <<<grid, kThreads, 0, stream>>>(b.master, g, m, v, v_max, out, b.remainder, n, args);
  } else {
    fused_adamw_kernel<G, P, M, false, kAmsgrad>
        <<<grid, kThreads, 0, stream>>>(b.master, g, m, v, v_max, out, b.remainder, n, args);
  }
  return cudaGetLastError();
}

template <typename G, typename P, typename M>
cudaError_t launch_for_amsgrad(const Buffers& b, int64_t n, const AdamWArgs& args,
                               cudaStream_t stream) {
  if (b.max_exp_avg_sq == nullptr) return launch_typed<G, P, M, false>(b, n, args, stream);
  return launch_typed<G, P, M, true>(b, n, args, stream);
}

template <typename G, typename P>
cudaError_t launch_for_moments(const Buffers& b, DType moment_dtype, int64_t n,
                               const AdamWArgs& args, cudaStream_t stream) {
  if (moment_dtype == DType::kBFloat16) {
    return launch_for_amsgrad<G, P, uint16_t>(b, n, args, stream);
  }
  return launch_for_amsgrad<G, P, float>(b, n, args, stream);
}

template <typename G>
cudaError_t launch_for_grad(const Buffers& b, DType param_out_dtype, DType moment_dtype, int64_t n,
                            const AdamWArgs& args, cudaStream_t stream) {
  if (b.remainder != nullptr) {
    return launch_for_moments<G, uint16_t>(b, moment_dtype, n, args, stream);
  }
  if (b.param_out == nullptr) {
    return launch_for_moments<G, NoParamOut>(b, moment_dtype, n, args, stream);
  }
  switch (param_out_dtype) {
    case DType::kBFloat16:
      return launch_for_moments<G, __nv_bfloat16>(b, moment_dtype, n, args, stream);
    case DType::kFloat16:
      return launch_for_moments<G, __half>(b, moment_dtype, n, args, stream);
    default:
      return cudaErrorInvalidValue;  // the binding allows only bf16/fp16 param_out
  }
}

}  // namespace

cudaError_t launch_fused_adamw(float* master, const void* grad, DType grad_dtype, void* exp_avg,
                               void* exp_avg_sq, void* max_exp_avg_sq, void* param_out,
                               DType param_out_dtype, int64_t n, const AdamWArgs& args,
                               cudaStream_t stream, int16_t* remainder, DType moment_dtype) {
  if (n <= 0) return cudaSuccess;  // nothing to launch
  if (moment_dtype != DType::kFloat32 && moment_dtype != DType::kBFloat16) {
    return cudaErrorInvalidValue;  // the binding allows only fp32/bf16 moments
  }
  const Buffers b{master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, remainder};
  switch (grad_dtype) {
    case DType::kFloat32:
      return launch_for_grad<float>(b, param_out_dtype, moment_dtype, n, args, stream);
    case DType::kBFloat16:
      return launch_for_grad<__nv_bfloat16>(b, param_out_dtype, moment_dtype, n, args, stream);
    case DType::kFloat16:
      return launch_for_grad<__half>(b, param_out_dtype, moment_dtype, n, args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace zero_ext::cuda
