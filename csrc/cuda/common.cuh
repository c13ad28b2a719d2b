// Device helpers shared by the CUDA kernels: element conversion (round to nearest-even), 4-wide
// vector loads/stores, alignment tests and the launch-grid size.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../dtype.h"

namespace zero_ext::cuda {

// Every vectorised path moves 4 elements per thread-iteration: one float4 (16 B) per fp32 stream
// and one 8-byte load per bf16/fp16 stream, so all streams of a kernel advance in lockstep.
constexpr int kVec = 4;

// NOTE: 256 threads x 4 resident blocks per SM = 1024 threads/SM. Each thread of fused_adamw keeps
// ~56 B in flight (3 float4 + one 8-byte grad load), i.e. ~57 KB per SM. Little's law for H100 SXM
// (3.35 TB/s x ~0.6 us DRAM latency, published figures) needs ~2 MB in flight over 132 SMs, ~15 KB
// per SM, so 1024 threads/SM saturates DRAM with margin while leaving registers for the fp64
// coefficient math (65536 regs / 1024 threads = 64 per thread). Not measured on this machine (no
// GPU); bench/bench_fused_adamw.py on the GPU machine is where this gets confirmed.
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

// fp32 -> T, round to nearest-even (the _rn intrinsics; a plain cast would be the same for these
// types, the explicit names make the rounding mode visible).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Loads/stores kVec consecutive elements; p must be aligned to kVec * sizeof(T).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[kVec]);
template <>
__device__ __forceinline__ void load4<float>(const float* p, float (&out)[kVec]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
template <>
__device__ __forceinline__ void load4<__nv_bfloat16>(const __nv_bfloat16* p, float (&out)[kVec]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  out[0] = lo.x;
  out[1] = lo.y;
  out[2] = hi.x;
  out[3] = hi.y;
}
template <>
__device__ __forceinline__ void load4<__half>(const __half* p, float (&out)[kVec]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  out[0] = lo.x;
  out[1] = lo.y;
  out[2] = hi.x;
  out[3] = hi.y;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&in)[kVec]);
template <>
__device__ __forceinline__ void store4<float>(float* p, const float (&in)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* p, const float (&in)[kVec]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(in[0], in[1]);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(in[2], in[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}
template <>
__device__ __forceinline__ void store4<__half>(__half* p, const float (&in)[kVec]) {
  const __half2 lo = __floats2half2_rn(in[0], in[1]);
  const __half2 hi = __floats2half2_rn(in[2], in[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}

// True when p may be accessed kVec elements of `elem_bytes` at a time (null counts as aligned: an
// absent stream never blocks the vector path).
__host__ __device__ __forceinline__ bool vec_aligned(const void* p, int64_t elem_bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(kVec * elem_bytes) == 0;
}

// Number of SMs of the current device, queried once per device (cudaDeviceGetAttribute is cheap but
// not free, and launchers run every step). Returns 0 and sets *err on failure.
inline int sm_count(cudaError_t* err) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  *err = cudaGetDevice(&device);
  if (*err != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int sms = 0;
  *err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (*err != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Grid for a grid-stride loop over `work_items` thread-iterations: enough blocks to cover the work,
// at most kBlocksPerSm per SM (the loop covers the rest). Returns 0 and sets *err on failure.
inline unsigned grid_for(int64_t work_items, cudaError_t* err) {
  const int sms = sm_count(err);
  if (*err != cudaSuccess) return 0;
  const int64_t needed = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * kBlocksPerSm;
  return static_cast<unsigned>(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

}  // namespace zero_ext::cuda
