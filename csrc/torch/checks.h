// Argument validation shared by the CPU and CUDA bindings. Every check runs before any tensor is
// written, so a rejected call leaves all state untouched. Messages name the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../dtype.h"

namespace zero_ext {

// at::ScalarType -> DType for fp32/bf16/fp16; anything else is a TORCH_CHECK error naming `arg`.
DType to_kernel_dtype(const at::Tensor& t, const char* op, const char* arg);

// The bytes [begin, end) an argument occupies, with its name as messages print it ("`master`").
struct ByteRange {
  std::string name;
  uintptr_t begin = 0;
  uintptr_t end = 0;
};

// The bytes of a contiguous tensor's elements [first, first + numel); empty when numel is 0.
ByteRange byte_range(const at::Tensor& t, int64_t first, int64_t numel, std::string name);
inline ByteRange byte_range(const at::Tensor& t, std::string name) {
  return byte_range(t, 0, t.numel(), std::move(name));
}

// No range the op writes may share a byte with any other range, written or read; ranges it only
// reads may overlap each other; empty ranges overlap nothing. A kernel that reads what another
// thread already wrote, or writes one place twice, gives order-dependent results. The error names
// both arguments (in the order they are given: writes first).
void check_no_overlap(const char* op, const std::vector<ByteRange>& writes,
                      const std::vector<ByteRange>& reads);

// Shapes, dtypes, devices, contiguity and numel of fused_adamw_'s tensors and found_inf's shape,
// and that no two of master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, remainder share
// a byte. With remainder (int16), master is the bf16 parameter and param_out must be absent. The
// moments (exp_avg, exp_avg_sq, max_exp_avg_sq) share one dtype, float32 or bfloat16;
// element_offset is >= 0. The scalars are checked by resolve_adamw_scalars (scalars.h).
void check_fused_adamw_args(const at::Tensor& master, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const std::optional<at::Tensor>& max_exp_avg_sq,
                            const std::optional<at::Tensor>& param_out,
                            const std::optional<at::Tensor>& found_inf,
                            const std::optional<at::Tensor>& remainder, int64_t element_offset);

// flatten_/unflatten_: flat is a contiguous fp32/bf16/fp16 buffer; tensors contiguous, same device,
// fp32/bf16/fp16; offsets.size() == tensors.size(); every range inside flat. Memory: flatten_'s
// destination ranges in flat must not overlap each other or any of `tensors`; unflatten_'s outputs
// must not overlap each other or flat. Returns the slice records (host memory).
std::vector<TensorSlice> check_flatten_args(const at::Tensor& flat, at::TensorList tensors,
                                            at::IntArrayRef offsets, const char* op,
                                            bool tensors_are_outputs);

}  // namespace zero_ext
