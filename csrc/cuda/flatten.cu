// Multi-tensor copy between a flat buffer and `count` tensors, in ONE launch however many tensors.
// NOTE: a model has hundreds of tensors, and a launch through torch's dispatcher costs a few us of
// host time (the commonly quoted 2-5 us; not measured here, no GPU), so per-tensor launches would
// cost ~1 ms per step for the copy alone while the copy itself is tens of us.
//
// Work split: every tensor is cut into chunks of kChunk elements and the chunks of all tensors form
// one virtual list, dealt round-robin to a persistent grid. Each block walks the slice records in
// order keeping a running chunk count, so it needs no host-side prefix sum and no block is launched
// for nothing however uneven the tensor sizes are (a 2-D grid sized by the largest tensor would
// launch count x max_chunks blocks, almost all empty for a model with one big embedding).
#include "common.cuh"
#include "kernels.h"

namespace zero_ext::cuda {
namespace {

// NOTE: 4096 elements = 4 vector iterations of a 256-thread block: large enough that the per-chunk
// bookkeeping (a few integer ops per thread) is noise, small enough that a 768-element bias wastes
// at most one partly idle block-iteration. Not tuned on hardware (no GPU here).
constexpr int64_t kChunk = 4096;

// dst[i] = convert(src[i] * scale) for i in [begin, end) of one slice, by this block.
template <typename S, typename D>
__device__ __forceinline__ void copy_range(const S* __restrict__ src, D* __restrict__ dst,
                                           int64_t begin, int64_t end, float scale,
                                           bool vectorized) {
  if (vectorized) {
    // begin is a multiple of kChunk (hence of kVec); both base pointers are vector-aligned.
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kVec; i < vec_end;
         i += static_cast<int64_t>(blockDim.x) * kVec) {
      float x[kVec];
      load4(src + i, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] *= scale;
      store4(dst + i, x);
    }
    begin = vec_end;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    dst[i] = from_float<D>(to_float(src[i]) * scale);
  }
}

// Raw copy for equal dtypes at scale 1: bit-exact, NaN payloads included (a round trip through
// fp32 and __float2bfloat16_rn would canonicalise them).
// Bits is uint32_t (fp32) or uint16_t (bf16/fp16); Vec holds kVec of them (uint4 / uint2).
template <typename Bits, typename Vec>
__device__ __forceinline__ void copy_bits(const void* src_base, void* dst_base, int64_t begin,
                                          int64_t end) {
  static_assert(sizeof(Vec) == kVec * sizeof(Bits), "one Vec = kVec elements");
  const Bits* __restrict__ src = static_cast<const Bits*>(src_base);
  Bits* __restrict__ dst = static_cast<Bits*>(dst_base);
  if (vec_aligned(src, sizeof(Bits)) && vec_aligned(dst, sizeof(Bits))) {
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kVec; i < vec_end;
         i += static_cast<int64_t>(blockDim.x) * kVec) {
      *reinterpret_cast<Vec*>(dst + i) = *reinterpret_cast<const Vec*>(src + i);
    }
    begin = vec_end;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
}

template <typename S, typename D>
__device__ __forceinline__ void copy_slice_range(const void* src, void* dst, int64_t src_off,
                                                 int64_t dst_off, int64_t begin, int64_t end,
                                                 float scale) {
  const S* s = static_cast<const S*>(src) + src_off;
  D* d = static_cast<D*>(dst) + dst_off;
  copy_range(s, d, begin, end, scale, vec_aligned(s, sizeof(S)) && vec_aligned(d, sizeof(D)));
}

template <typename S>
__device__ __forceinline__ void dispatch_dst(const void* src, void* dst, DType dst_dtype,
                                             int64_t src_off, int64_t dst_off, int64_t begin,
                                             int64_t end, float scale) {
  switch (dst_dtype) {
    case DType::kFloat32:
      copy_slice_range<S, float>(src, dst, src_off, dst_off, begin, end, scale);
      break;
    case DType::kBFloat16:
      copy_slice_range<S, __nv_bfloat16>(src, dst, src_off, dst_off, begin, end, scale);
      break;
    case DType::kFloat16:
      copy_slice_range<S, __half>(src, dst, src_off, dst_off, begin, end, scale);
      break;
  }
}

__global__ void __launch_bounds__(kThreads)
    flatten_kernel(void* flat, DType flat_dtype, const TensorSlice* __restrict__ slices,
                   int64_t count, float scale, bool to_flat) {
  int64_t chunk_base = 0;  // chunks of all slices before slice s
  for (int64_t s = 0; s < count; ++s) {
    const TensorSlice sl = slices[s];  // same address for the whole block: one broadcast load
    const int64_t chunks = (sl.numel + kChunk - 1) / kChunk;
    // First chunk of this slice dealt to this block: (chunk_base + c) % gridDim.x == blockIdx.x.
    int64_t c = (static_cast<int64_t>(blockIdx.x) - chunk_base) % gridDim.x;
    if (c < 0) c += gridDim.x;
    const DType src_dtype = to_flat ? sl.dtype : flat_dtype;
    const DType dst_dtype = to_flat ? flat_dtype : sl.dtype;
    const void* src = to_flat ? sl.data : flat;
    void* dst = to_flat ? flat : sl.data;
    const int64_t src_off = to_flat ? 0 : sl.offset;
    const int64_t dst_off = to_flat ? sl.offset : 0;
    for (; c < chunks; c += gridDim.x) {
      const int64_t begin = c * kChunk;
      const int64_t end = begin + kChunk < sl.numel ? begin + kChunk : sl.numel;
      if (src_dtype == dst_dtype && scale == 1.0f) {
        if (src_dtype == DType::kFloat32) {
          copy_bits<uint32_t, uint4>(static_cast<const uint32_t*>(src) + src_off,
                                     static_cast<uint32_t*>(dst) + dst_off, begin, end);
        } else {
          copy_bits<uint16_t, uint2>(static_cast<const uint16_t*>(src) + src_off,
                                     static_cast<uint16_t*>(dst) + dst_off, begin, end);
        }
        continue;
      }
      switch (src_dtype) {
        case DType::kFloat32:
          dispatch_dst<float>(src, dst, dst_dtype, src_off, dst_off, begin, end, scale);
          break;
        case DType::kBFloat16:
          dispatch_dst<__nv_bfloat16>(src, dst, dst_dtype, src_off, dst_off, begin, end, scale);
          break;
        case DType::kFloat16:
          dispatch_dst<__half>(src, dst, dst_dtype, src_off, dst_off, begin, end, scale);
          break;
      }
    }
    chunk_base += chunks;
  }
}

}  // namespace

cudaError_t launch_flatten(void* flat, DType flat_dtype, const TensorSlice* device_slices,
                           int64_t count, int64_t max_numel, float scale, bool to_flat,
                           cudaStream_t stream) {
  if (count <= 0 || max_numel <= 0) return cudaSuccess;  // nothing to copy
  // One block per chunk up to kBlocksPerSm per SM; count * max_chunks bounds the chunk total (far
  // below 2^63 for any tensor list that fits in memory, even times kThreads).
  const int64_t max_chunks = (max_numel + kChunk - 1) / kChunk;
  cudaError_t err = cudaSuccess;
  const unsigned grid = grid_for(max_chunks * count * kThreads, &err);
  if (err != cudaSuccess) return err;
  flatten_kernel<<<grid, kThreads, 0, stream>>>(flat, flat_dtype, device_slices, count, scale,
                                                to_flat);
  return cudaGetLastError();
}

}  // namespace zero_ext::cuda
