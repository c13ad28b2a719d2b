// Argument validation of zero_ext::fused_adamw_int8_ (int8 block-quantized moments), shared by the
// CPU and CUDA bindings. Every check runs before any tensor is written.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace zero_ext {

// Largest block the kernels take (csrc/cpu/fused_adamw_int8.h kInt8MaxBlock).
constexpr int64_t kInt8OpMaxBlock = 4096;

// master fp32 (bf16 with remainder), contiguous; grad fp32/bf16/fp16; codes int8 and remainder
// int16 with master's numel; scales fp32 with ceil(numel / block) entries; block a multiple of 16
// in [16, 4096]; param_out bf16/fp16 (None with remainder); amsgrad's max_exp_avg_sq_codes (int8,
// numel) and max_exp_avg_sq_scales (fp32, blocks) both or neither; one device; no two share a byte.
void check_fused_adamw_int8_args(const at::Tensor& master, const at::Tensor& grad,
                                 const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_scales,
                                 const at::Tensor& exp_avg_sq_codes,
                                 const at::Tensor& exp_avg_sq_scales, int64_t block,
                                 const std::optional<at::Tensor>& param_out,
                                 const std::optional<at::Tensor>& found_inf,
                                 const std::optional<at::Tensor>& remainder,
                                 const std::optional<at::Tensor>& max_exp_avg_sq_codes,
                                 const std::optional<at::Tensor>& max_exp_avg_sq_scales);

}  // namespace zero_ext
