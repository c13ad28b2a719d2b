// cpu::sum_squares: sum(x^2) in fp32, bitwise the same for any thread count, and a nonfinite flag.
//
// Determinism: the split into blocks depends only on n; each block is reduced the same way (32
// fp32 lanes, lane = index mod 32, sub-blocks of 1024 elements folded into the block's lanes, then
// a fixed pairwise tree), and the block partials are combined by a fixed pairwise tree. Threads
// only decide who computes which block. The lane loops vectorise without reassociation.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>

#include "float_convert.h"
#include "kernels.h"

namespace zero_ext::cpu {
namespace {

constexpr int kLanes = 32;
constexpr int64_t kSubBlock = 1024;   // elements summed per lane before folding: bounds the error
constexpr int64_t kMaxBlocks = 4096;  // partials live on the stack (16 KB)
// NOTE: 16K elements per block at least, so small inputs stay on one thread (a block is ~10 us).
constexpr int64_t kMinBlock = 16 * kSubBlock;

float tree_sum(float* values, int64_t n) {  // destroys values
  for (int64_t width = 1; width < n; width *= 2) {
    for (int64_t i = 0; i + width < n; i += 2 * width) values[i] += values[i + width];
  }
  return n > 0 ? values[0] : 0.0f;
}

inline bool is_nonfinite(float x) { return (float_bits(x) & 0x7F800000u) == 0x7F800000u; }

template <DType kDtype>
void sub_block(const void* x, int64_t begin, int64_t end, float* lanes, bool* nonfinite) {
  float acc[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = load_as_float(x, kDtype, i + j);
      acc[j] += v * v;
    }
  }
  for (int j = 0; i < end; ++i, ++j) {
    const float v = load_as_float(x, kDtype, i);
    acc[j] += v * v;
  }
  bool finite = true;
  for (int j = 0; j < kLanes; ++j) {
    finite &= !is_nonfinite(acc[j]);
    lanes[j] += acc[j];
  }
  // A nonfinite square sum has a nonfinite element or an overflow; only then look closer.
  if (!finite) {
    for (int64_t k = begin; k < end; ++k) {
      if (is_nonfinite(load_as_float(x, kDtype, k))) *nonfinite = true;
    }
  }
}

template <DType kDtype>
float block_sum(const void* x, int64_t begin, int64_t end, bool* nonfinite) {
  float lanes[kLanes] = {};
  for (int64_t s = begin; s < end; s += kSubBlock) {
    sub_block<kDtype>(x, s, std::min(end, s + kSubBlock), lanes, nonfinite);
  }
  return tree_sum(lanes, kLanes);
}

template <DType kDtype>
void sum_squares_typed(const void* x, int64_t n, float* sumsq, float* nonfinite, int num_threads) {
  int64_t block = std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks);
  block = (block + kSubBlock - 1) / kSubBlock * kSubBlock;
  const int64_t blocks = (n + block - 1) / block;
  float partials[kMaxBlocks];
  bool bad[kMaxBlocks] = {};
  const int threads = static_cast<int>(std::clamp<int64_t>(blocks, 1, std::max(num_threads, 1)));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t k = 0; k < blocks; ++k) {
    partials[k] = block_sum<kDtype>(x, k * block, std::min(n, (k + 1) * block), &bad[k]);
  }
  *sumsq = tree_sum(partials, blocks);
  *nonfinite = std::any_of(bad, bad + blocks, [](bool b) { return b; }) ? 1.0f : 0.0f;
}

}  // namespace

void sum_squares(const void* x, DType dtype, int64_t n, float* sumsq, float* nonfinite,
                 int num_threads) {
  switch (dtype) {
    case DType::kBFloat16:
      return sum_squares_typed<DType::kBFloat16>(x, n, sumsq, nonfinite, num_threads);
    case DType::kFloat16:
      return sum_squares_typed<DType::kFloat16>(x, n, sumsq, nonfinite, num_threads);
    default:
      return sum_squares_typed<DType::kFloat32>(x, n, sumsq, nonfinite, num_threads);
  }
}

}  // namespace zero_ext::cpu
