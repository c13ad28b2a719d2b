// cpu::flatten: copies many tensors into / out of one flat buffer, with an optional cast and scale.
// The work is split across threads by total element count (a thread's range may start in the
// middle of one tensor and end in another), so a few huge tensors and many tiny ones both balance.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cstring>

#include "float_convert.h"
#include "kernels.h"

namespace zero_ext::cpu {
namespace {

// NOTE: a thread needs ~32K elements (~256 KB moved) before waking a second one pays off.
constexpr int64_t kMinPerThread = int64_t{1} << 15;

template <DType kDst>
inline void store_from_float(void* dst, int64_t i, float x) {
  if constexpr (kDst == DType::kFloat32) static_cast<float*>(dst)[i] = x;
  if constexpr (kDst == DType::kBFloat16) static_cast<uint16_t*>(dst)[i] = float_to_bf16(x);
  if constexpr (kDst == DType::kFloat16) static_cast<uint16_t*>(dst)[i] = float_to_fp16(x);
}

template <DType kSrc, DType kDst>
void convert(const void* src, void* dst, int64_t n, float scale) {
  if (scale == 1.0f) {
    for (int64_t i = 0; i < n; ++i) store_from_float<kDst>(dst, i, load_as_float(src, kSrc, i));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      store_from_float<kDst>(dst, i, load_as_float(src, kSrc, i) * scale);
    }
  }
}

template <DType kSrc>
void convert_to(const void* src, void* dst, DType dst_dtype, int64_t n, float scale) {
  switch (dst_dtype) {
    case DType::kBFloat16:
      return convert<kSrc, DType::kBFloat16>(src, dst, n, scale);
    case DType::kFloat16:
      return convert<kSrc, DType::kFloat16>(src, dst, n, scale);
    default:
      return convert<kSrc, DType::kFloat32>(src, dst, n, scale);
  }
}

// n elements from src to dst: an exact byte copy when nothing changes, else fp32 math + rounding.
void copy_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                   float scale) {
  if (src_dtype == dst_dtype && scale == 1.0f) {
    std::memcpy(dst, src, static_cast<size_t>(n * element_size(src_dtype)));
    return;
  }
  switch (src_dtype) {
    case DType::kBFloat16:
      return convert_to<DType::kBFloat16>(src, dst, dst_dtype, n, scale);
    case DType::kFloat16:
      return convert_to<DType::kFloat16>(src, dst, dst_dtype, n, scale);
    default:
      return convert_to<DType::kFloat32>(src, dst, dst_dtype, n, scale);
  }
}

// Copies elements [begin, end) of the concatenation of all slices.
void copy_range(void* flat, DType flat_dtype, const TensorSlice* slices, int64_t count, float scale,
                bool to_flat, int64_t begin, int64_t end) {
  char* flat_bytes = static_cast<char*>(flat);
  const int64_t flat_size = element_size(flat_dtype);
  int64_t start = 0;  // position of slice k in the concatenation
  for (int64_t k = 0; k < count && start < end; ++k) {
    const TensorSlice& s = slices[k];
    const int64_t lo = std::max(begin, start) - start;
    const int64_t hi = std::min(end, start + s.numel) - start;
    start += s.numel;
    if (lo >= hi) continue;
    char* t = static_cast<char*>(s.data) + lo * element_size(s.dtype);
    char* f = flat_bytes + (s.offset + lo) * flat_size;
    if (to_flat) {
      copy_elements(t, s.dtype, f, flat_dtype, hi - lo, scale);
    } else {
      copy_elements(f, flat_dtype, t, s.dtype, hi - lo, scale);
    }
  }
}

}  // namespace

void flatten(void* flat, DType flat_dtype, const TensorSlice* slices, int64_t count, float scale,
             bool to_flat, int num_threads) {
  int64_t total = 0;
  for (int64_t k = 0; k < count; ++k) total += slices[k].numel;
  if (total == 0) return;
  const int threads =
      static_cast<int>(std::clamp<int64_t>(total / kMinPerThread, 1, std::max(num_threads, 1)));
  if (threads == 1) {
    copy_range(flat, flat_dtype, slices, count, scale, to_flat, 0, total);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    copy_range(flat, flat_dtype, slices, count, scale, to_flat, total * t / threads,
               total * (t + 1) / threads);
  }
}

}  // namespace zero_ext::cpu
