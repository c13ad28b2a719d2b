// cpu::fused_adamw: every ISA path and thread count gives the scalar path's bits, with and without
// amsgrad and maximize; the scalar path matches the formula evaluated in double to a few ulps;
// unaligned pointers and n = 0 work.
#include <algorithm>
#include <cmath>

#include "cpu/float_convert.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

struct Flags {
  bool amsgrad;
  bool maximize;
};

struct State {
  std::vector<float> master, exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::vector<uint16_t> out;
};

// amsgrad's max starts at |N(0, 2e-4)|, the size of v after the first step, so both operands of
// the max win somewhere.
std::vector<float> initial_max(int64_t n) {
  auto v = random_floats(n, 4, 2e-4f);
  for (float& x : v) x = std::fabs(x);
  return v;
}

State run(Isa isa, int threads, int64_t n, DType grad_dtype, DType out_dtype, bool with_out,
          const std::vector<float>& grad32, int offset, double beta1, int steps, Flags flags) {
  force_isa(isa);
  State s;
  s.master = random_floats(n + offset, 1);
  s.exp_avg.assign(n + offset, 0.0f);
  s.exp_avg_sq.assign(n + offset, 0.0f);
  s.max_exp_avg_sq = initial_max(n + offset);
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
    const auto c = adamw_coefficients(1e-3, beta1, 0.999, 1e-8, 0.1, step, 0.5, flags.maximize);
    fused_adamw(s.master.data() + offset, grad, grad_dtype, s.exp_avg.data() + offset,
                s.exp_avg_sq.data() + offset,
                flags.amsgrad ? s.max_exp_avg_sq.data() + offset : nullptr,
                with_out ? s.out.data() + offset : nullptr, out_dtype, n, c, threads);
  }
  force_isa(Isa::kAuto);
  return s;
}

bool same(const State& a, const State& b) {
  const size_t n = a.master.size();
  return same_bits(a.master.data(), b.master.data(), n * 4) &&
         same_bits(a.exp_avg.data(), b.exp_avg.data(), n * 4) &&
         same_bits(a.exp_avg_sq.data(), b.exp_avg_sq.data(), n * 4) &&
         same_bits(a.max_exp_avg_sq.data(), b.max_exp_avg_sq.data(), n * 4) &&
         same_bits(a.out.data(), b.out.data(), n * 2);
}

// One step in double from the same inputs: the fp32 kernel must agree to a few ulps of lr. With
// amsgrad the denominator uses max(initial max, v) and the stored max is exactly that max of the
// fp32 values; without it max_exp_avg_sq is not written.
void check_against_double(int64_t n, Flags flags) {
  const auto grad = random_floats(n, 2);
  State s =
      run(Isa::kScalar, 1, n, DType::kFloat32, DType::kBFloat16, false, grad, 0, 0.9, 1, flags);
  const auto p0 = random_floats(n, 1);
  const auto max0 = initial_max(n);
  double worst = 0;
  int64_t max_wins = 0, max_wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = (flags.maximize ? -0.5 : 0.5) * grad[i];
    const double m = 0.1 * g, v = 0.001 * g * g;
    const double v_hat = flags.amsgrad ? std::max<double>(max0[i], v) : v;
    const double p = p0[i] * (1 - 1e-4) - (1e-3 / 0.1) * m / (std::sqrt(v_hat / 0.001) + 1e-8);
    worst = std::fmax(worst, std::fabs(p - s.master[i]) / (std::fabs(p) + 1e-3));
    const float want_max = flags.amsgrad ? std::max(max0[i], s.exp_avg_sq[i]) : max0[i];
    max_wrong += s.max_exp_avg_sq[i] != want_max;
    max_wins += max0[i] > s.exp_avg_sq[i];
  }
  CHECK(worst < 1e-6, "relative error vs double %g (amsgrad=%d maximize=%d)", worst, flags.amsgrad,
        flags.maximize);
  CHECK(max_wrong == 0, "%lld max_exp_avg_sq elements wrong (amsgrad=%d)",
        static_cast<long long>(max_wrong), flags.amsgrad);
  CHECK(max_wins > n / 10 && max_wins < n - n / 10, "the max branch is exercised (%lld of %lld)",
        static_cast<long long>(max_wins), static_cast<long long>(n));
}

// torch.maximum propagates NaN from either side; every path must, and keep the same bits.
void check_nan_propagation() {
  const int64_t n = 37;  // vector bodies and a scalar tail
  const auto grad = random_floats(n, 5);
  State ref;
  for (Isa isa : supported_isas()) {
    force_isa(isa);
    State s;
    s.master = random_floats(n, 1);
    s.exp_avg.assign(n, 0.0f);
    s.exp_avg_sq.assign(n, 0.0f);
    s.max_exp_avg_sq.assign(n, 0.0f);
    s.out.assign(n, 0);
    for (int64_t i = 0; i < n; i += 3) s.max_exp_avg_sq[i] = NAN;  // NaN in the old max
    std::vector<float> g = grad;
    for (int64_t i = 1; i < n; i += 5) g[i] = NAN;  // NaN in v
    const auto c = adamw_coefficients(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, false);
    fused_adamw(s.master.data(), g.data(), DType::kFloat32, s.exp_avg.data(), s.exp_avg_sq.data(),
                s.max_exp_avg_sq.data(), nullptr, DType::kBFloat16, n, c, 1);
    for (int64_t i = 0; i < n; ++i) {
      const bool nan_in = i % 3 == 0 || i % 5 == 1;
      CHECK(std::isnan(s.max_exp_avg_sq[i]) == nan_in && std::isnan(s.master[i]) == nan_in,
            "NaN propagation at %lld isa=%s", static_cast<long long>(i), isa_name(isa));
    }
    if (isa == Isa::kScalar) ref = s;
    CHECK(same(s, ref), "NaN case isa=%s differs from scalar", isa_name(isa));
  }
  force_isa(Isa::kAuto);
}

}  // namespace

int main() {
  const int64_t sizes[] = {0, 1, 7, 97, 1025, (int64_t{1} << 18) + 3};
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const Flags all_flags[] = {{false, false}, {true, false}, {false, true}, {true, true}};
  for (int64_t n : sizes) {
    const auto grad = random_floats(n + 1, 3);
    for (DType g : grads) {
      for (int out = 0; out < 3; ++out) {
        const DType out_dtype = out == 2 ? DType::kFloat16 : DType::kBFloat16;
        for (double beta1 : {0.9, 0.2}) {  // both branches of torch's lerp
          for (int offset : {0, 1}) {      // offset 1: no pointer is vector-aligned
            for (Flags f : all_flags) {
              // maximize lives in the coefficients, not in the SIMD code: at the largest size
              // (most of the run time) plain and amsgrad+maximize cover every code path.
              if (n > (1 << 16) && f.amsgrad != f.maximize) continue;
              const State ref =
                  run(Isa::kScalar, 1, n, g, out_dtype, out > 0, grad, offset, beta1, 3, f);
              for (Isa isa : supported_isas()) {
                for (int threads : {1, 2}) {
                  const State s =
                      run(isa, threads, n, g, out_dtype, out > 0, grad, offset, beta1, 3, f);
                  CHECK(same(s, ref),
                        "n=%lld grad=%d out=%d beta1=%g offset=%d amsgrad=%d maximize=%d isa=%s "
                        "threads=%d",
                        static_cast<long long>(n), int(g), out, beta1, offset, f.amsgrad,
                        f.maximize, isa_name(isa), threads);
                }
              }
              if (out > 0) {
                for (int64_t i = 0; i < n; ++i) {
                  const float p = ref.master[offset + i];
                  const uint16_t want = out == 1 ? float_to_bf16(p) : float_to_fp16(p);
                  if (ref.out[offset + i] != want) {
                    CHECK(false, "param_out[%lld] is not master rounded",
                          static_cast<long long>(i));
                    break;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  for (Flags f : all_flags) check_against_double(4099, f);
  check_nan_propagation();
  return zero_ext::cpu::test::finish("test_fused_adamw");
}
