// Torch-free CUDA launcher of the int8 fused AdamW step (csrc/fused_adamw_int8_math.h). Never run:
// written without a GPU and compile-checked only.
#pragma once
#include <cuda_runtime_api.h>

#include "../fused_adamw_int8_math.h"
#include "kernels.h"

namespace zero_ext::cuda {

// Dequantize, update (adamw_update), block absmax, encode, write the new scales: for 64-element
// blocks one half-warp per quantization block in registers, for other sizes one thread block per
// quantization block (fused_adamw_int8.cu). found_inf is read by
// the kernel (nonzero: no byte written). b.block a multiple of 16 in [16, 4096]. amsgrad when
// b.max_exp_avg_sq_codes is set (then b.max_exp_avg_sq_scales too).
cudaError_t launch_fused_adamw_int8(const Int8AdamWBuffers& b, const AdamWArgs& args,
                                    cudaStream_t stream);

// The step's quantizer alone (the minifloat codes, as the kernel above runs them), for the
// exhaustive check in csrc/cuda/tests/test_launchers.cpp: codes[i] = the code of x[i] * reciprocal
// (exp_avg's map, or exp_avg_sq's), and out[i] = map[codes[i]] * scale.
cudaError_t launch_int8_encode(const float* x, float reciprocal, bool exp_avg_sq, uint8_t* codes,
                               int64_t n, cudaStream_t stream);
cudaError_t launch_int8_decode(const uint8_t* codes, float scale, bool exp_avg_sq, float* out,
                               int64_t n, cudaStream_t stream);

}  // namespace zero_ext::cuda
