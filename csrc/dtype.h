// Element types the torch-free kernels understand. The torch binding layer maps at::ScalarType onto
// these, so nothing under csrc/cpu or csrc/cuda includes torch.
#pragma once
#include <cstdint>

namespace zero_ext {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline int64_t element_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// One tensor's place in a flat buffer, for the multi-tensor flatten/unflatten kernels.
struct TensorSlice {
  void* data;      // first element of the (contiguous) tensor
  int64_t numel;   // elements in the tensor
  int64_t offset;  // element offset of the tensor inside the flat buffer
  DType dtype;     // element type of the tensor (the flat buffer has its own)
  int32_t pad_;    // keeps sizeof == 32 on every compiler, host and device alike
};

}  // namespace zero_ext
