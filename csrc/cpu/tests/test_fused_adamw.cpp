// cpu::fused_adamw: every ISA path and thread count gives the scalar path's bits; the scalar path
// matches the formula evaluated in double to a few ulps; unaligned pointers and n = 0 work.
#include <cmath>

#include "cpu/float_convert.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

struct State {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<uint16_t> out;
};

State run(Isa isa, int threads, int64_t n, DType grad_dtype, DType out_dtype, bool with_out,
          const std::vector<float>& grad32, int offset, double beta1, int steps) {
  force_isa(isa);
  State s;
  s.master = random_floats(n + offset, 1);
  s.exp_avg.assign(n + offset, 0.0f);
  s.exp_avg_sq.assign(n + offset, 0.0f);
  s.out.assign(n + offset, 0);
  std::vector<uint16_t> grad16(n + offset);
  for (int64_t i = 0; i < n + offset; ++i) {
    grad16[i] =
        grad_dtype == DType::kBFloat16 ? float_to_bf16(grad32[i]) : float_to_fp16(grad32[i]);
  }
  const void* grad = grad_dtype == DType::kFloat32
                         ? static_cast<const void*>(grad32.data() + offset)
                         : static_cast<const void*>(grad16.data() + offset);
  for (int step = 1; step <= steps; ++step) {
    const auto c = adamw_coefficients(1e-3, beta1, 0.999, 1e-8, 0.1, step, 0.5);
    fused_adamw(s.master.data() + offset, grad, grad_dtype, s.exp_avg.data() + offset,
                s.exp_avg_sq.data() + offset, with_out ? s.out.data() + offset : nullptr, out_dtype,
                n, c, threads);
  }
  force_isa(Isa::kAuto);
  return s;
}

bool same(const State& a, const State& b) {
  const size_t n = a.master.size();
  return same_bits(a.master.data(), b.master.data(), n * 4) &&
         same_bits(a.exp_avg.data(), b.exp_avg.data(), n * 4) &&
         same_bits(a.exp_avg_sq.data(), b.exp_avg_sq.data(), n * 4) &&
         same_bits(a.out.data(), b.out.data(), n * 2);
}

// One step in double from the same inputs: the fp32 kernel must agree to a few ulps of lr.
void check_against_double(int64_t n) {
  const auto grad = random_floats(n, 2);
  State s = run(Isa::kScalar, 1, n, DType::kFloat32, DType::kBFloat16, false, grad, 0, 0.9, 1);
  const auto p0 = random_floats(n, 1);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = 0.5 * grad[i];
    const double m = 0.1 * g, v = 0.001 * g * g;
    const double p = p0[i] * (1 - 1e-4) - (1e-3 / 0.1) * m / (std::sqrt(v / 0.001) + 1e-8);
    worst = std::fmax(worst, std::fabs(p - s.master[i]) / (std::fabs(p) + 1e-3));
  }
  CHECK(worst < 1e-6, "relative error vs double %g", worst);
}

}  // namespace

int main() {
  const int64_t sizes[] = {0, 1, 7, 97, 1025, (int64_t{1} << 18) + 3};
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int64_t n : sizes) {
    const auto grad = random_floats(n + 1, 3);
    for (DType g : grads) {
      for (int out = 0; out < 3; ++out) {
        const DType out_dtype = out == 2 ? DType::kFloat16 : DType::kBFloat16;
        for (double beta1 : {0.9, 0.2}) {  // both branches of torch's lerp
          for (int offset : {0, 1}) {      // offset 1: no pointer is vector-aligned
            const State ref =
                run(Isa::kScalar, 1, n, g, out_dtype, out > 0, grad, offset, beta1, 3);
            for (Isa isa : supported_isas()) {
              for (int threads : {1, 2}) {
                const State s = run(isa, threads, n, g, out_dtype, out > 0, grad, offset, beta1, 3);
                CHECK(same(s, ref), "n=%lld grad=%d out=%d beta1=%g offset=%d isa=%s threads=%d",
                      static_cast<long long>(n), int(g), out, beta1, offset, isa_name(isa),
                      threads);
              }
            }
            if (out > 0) {
              for (int64_t i = 0; i < n; ++i) {
                const float p = ref.master[offset + i];
                const uint16_t want = out == 1 ? float_to_bf16(p) : float_to_fp16(p);
                if (ref.out[offset + i] != want) {
                  CHECK(false, "param_out[%lld] is not master rounded", static_cast<long long>(i));
                  break;
                }
              }
            }
          }
        }
      }
    }
  }
  check_against_double(4099);
  return zero_ext::cpu::test::finish("test_fused_adamw");
}
