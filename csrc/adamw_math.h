// The one AdamW formula shared by the CPU and CUDA kernels.
//
// Operation order follows torch.optim.AdamW (single-tensor path) so fp32 results agree with torch
// to about one ulp:
//   p  *= 1 - lr*wd                       (decoupled weight decay)
//   m   = lerp(m, g, 1 - beta1)
//   v   = beta2*v + (1 - beta2)*g*g
//   p  -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
// torch computes the per-step coefficients (1 - lr*wd, lr/bc1, sqrt(bc2)) in double precision on
// the host and rounds them to float once; adamw_coefficients() does the same.
#pragma once
#include <cmath>

#if defined(__CUDACC__)
#define ZERO_EXT_HD __host__ __device__ __forceinline__
#else
#define ZERO_EXT_HD inline
#endif

namespace zero_ext {

struct AdamWCoefficients {
  float decay;            // 1 - lr*weight_decay
  float lerp_weight;      // 1 - beta1
  float beta2;            // beta2
  float one_minus_beta2;  // 1 - beta2
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;              // eps
  float grad_scale;       // multiplies the gradient before anything else
};

ZERO_EXT_HD AdamWCoefficients adamw_coefficients(double lr, double beta1, double beta2, double eps,
                                                 double weight_decay, double step,
                                                 double grad_scale) {
  AdamWCoefficients c;
  const double bc1 = 1.0 - pow(beta1, step);
  const double bc2 = 1.0 - pow(beta2, step);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.bc2_sqrt = static_cast<float>(sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// torch.lerp's formula: exact at both ends, and the same branch torch takes on CPU and CUDA.
ZERO_EXT_HD float lerp(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? start + weight * (end - start)
                              : end - (end - start) * (1.0f - weight);
}

// One element's update; `g` is the gradient already converted to fp32 (not yet scaled).
ZERO_EXT_HD void adamw_update(float& p, float g, float& m, float& v, const AdamWCoefficients& c) {
  g = g * c.grad_scale;
  p = p * c.decay;
  m = lerp(m, g, c.lerp_weight);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * (m / denom);
}

}  // namespace zero_ext
