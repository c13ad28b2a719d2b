// Deterministic sum of squares (fp32 accumulation) and a non-finite flag, for gradient-norm
// clipping and the inf/nan check without a host sync.
//
// Two passes, no atomics, so the same input on the same device gives the same bits every time:
//   1. a grid of at most kMaxPartials blocks; each thread accumulates a grid-stride subset in a
//      fixed order, the block reduces its threads in a fixed tree and writes (sum, flag) to the
//      workspace;
//   2. one block reads the partials in index order and reduces them the same way.
// The grid size depends only on n and the SM count, hence the partition (and the bits) only on the
// input and the GPU model.
#include "common.cuh"
#include "kernels.h"

namespace zero_ext::cuda {
namespace {

// NOTE: 2048 partials is more than kBlocksPerSm x SMs on any current GPU (4 x 132 = 528 on H100
// SXM, 4 x 144 on B200), so the cap never binds there; it only bounds the workspace size, which
// must not depend on the device (sum_squares_workspace_size takes n alone).
constexpr int64_t kMaxPartials = 2048;
constexpr int kFinalThreads = 1024;

// Sum over the block in a fixed order: warp shuffles (xor tree), then warp 0 reduces the per-warp
// results. Returns the total in thread 0.
template <int kBlock>
__device__ __forceinline__ float block_sum(float x, float* smem) {
  constexpr int kWarps = kBlock / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = threadIdx.x < kWarps ? smem[threadIdx.x] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  }
  return x;
}

__device__ __forceinline__ void accumulate(float x, float& sum, float& bad) {
  sum += x * x;
  // isfinite on the input, not the sum: a large finite input may overflow the sum to inf, which is
  // not a non-finite gradient.
  if (!isfinite(x)) bad = 1.0f;
}

template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    partial_sums_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ partials) {
  __shared__ float smem[kThreads / 32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float sum = 0.0f;
  float bad = 0.0f;
  int64_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const int64_t nvec = n / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
      float v[kVec];
      load4(x + i * kVec, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) accumulate(v[k], sum, bad);
    }
    scalar_begin = nvec * kVec;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) accumulate(to_float(x[i]), sum, bad);

  sum = block_sum<kThreads>(sum, smem);
  __syncthreads();  // smem is reused by the second reduction
  bad = block_sum<kThreads>(bad, smem);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = sum;
    partials[2 * blockIdx.x + 1] = bad;
  }
}

__global__ void __launch_bounds__(kFinalThreads)
    final_sum_kernel(const float* __restrict__ partials, int64_t num_partials,
                     float* __restrict__ sumsq, float* __restrict__ nonfinite) {
  __shared__ float smem[kFinalThreads / 32];
  float sum = 0.0f;
  float bad = 0.0f;
  for (int64_t i = threadIdx.x; i < num_partials; i += kFinalThreads) {
    sum += partials[2 * i];
    bad += partials[2 * i + 1];
  }
  sum = block_sum<kFinalThreads>(sum, smem);
  __syncthreads();
  bad = block_sum<kFinalThreads>(bad, smem);
  if (threadIdx.x == 0) {
    *sumsq = sum;
    *nonfinite = bad > 0.0f ? 1.0f : 0.0f;
  }
}

// Thread-iterations a launch over n elements needs (vector iterations when aligned).
int64_t partial_blocks_needed(int64_t n) {
  const int64_t items = (n + kVec - 1) / kVec;
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return blocks < kMaxPartials ? blocks : kMaxPartials;
}

template <typename T>
cudaError_t launch_typed(const T* x, int64_t n, float* sumsq, float* nonfinite, float* workspace,
                         cudaStream_t stream) {
  int64_t blocks = 0;
  if (n > 0) {
    cudaError_t err = cudaSuccess;
    const bool vectorized = vec_aligned(x, sizeof(T));
    const unsigned grid = grid_for(vectorized ? (n + kVec - 1) / kVec : n, &err);
    if (err != cudaSuccess) return err;
    // grid_for never exceeds the vector-iteration count, hence partial_blocks_needed(n), except
    // through the kMaxPartials cap applied here.
    blocks = grid < partial_blocks_needed(n) ? grid : partial_blocks_needed(n);
    if (vectorized) {
      partial_sums_kernel<T, true>
          <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, workspace);
    } else {
      partial_sums_kernel<T, false>
          <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, workspace);
    }
  }
  // Runs for n == 0 too: it writes the zeros, so the outputs never hold stale memory.
  final_sum_kernel<<<1, kFinalThreads, 0, stream>>>(workspace, blocks, sumsq, nonfinite);
  return cudaGetLastError();
}

}  // namespace

int64_t sum_squares_workspace_size(int64_t n) {
  return n > 0 ? 2 * partial_blocks_needed(n) : 0;  // (sum, flag) per block
}

cudaError_t launch_sum_squares(const void* x, DType dtype, int64_t n, float* sumsq,
                               float* nonfinite, float* workspace, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed(static_cast<const float*>(x), n, sumsq, nonfinite, workspace, stream);
    case DType::kBFloat16:
      return launch_typed(static_cast<const __nv_bfloat16*>(x), n, sumsq, nonfinite, workspace,
                          stream);
    case DType::kFloat16:
      return launch_typed(static_cast<const __half*>(x), n, sumsq, nonfinite, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace zero_ext::cuda
