// The per-ISA bodies of cpu::fused_adamw (kernels.h). Each processes [begin, end) of one thread's
// chunk and returns the index where it stopped; the caller finishes the rest with the scalar path,
// so the SIMD files need no tail code of their own.
#pragma once
#include <cstdint>

#include "../adamw_math.h"
#include "../dtype.h"
#include "kernels.h"

namespace zero_ext::cpu {

// Arguments of one fused_adamw call (kernels.h AdamWTensors), plus how to store param_out.
struct AdamWBuffers : AdamWTensors {
  // Write param_out with non-temporal stores where aligned (a call too big for the caches).
  bool stream_out = false;
};

int64_t fused_adamw_scalar(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c);
int64_t fused_adamw_avx2(const AdamWBuffers& b, int64_t begin, int64_t end,
                         const AdamWCoefficients& c);
int64_t fused_adamw_avx512(const AdamWBuffers& b, int64_t begin, int64_t end,
                           const AdamWCoefficients& c);

}  // namespace zero_ext::cpu
