#include "int8_checks.h"

#include <string>
#include <vector>

#include "checks.h"
#include "scalars.h"

namespace zero_ext {
namespace {

constexpr const char* kOp = "zero_ext.fused_adamw_int8_";

void check_tensor(const at::Tensor& t, const at::Tensor& master, const char* arg, int64_t numel,
                  at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": `", arg, "` must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == master.device(), kOp, ": `", arg,
              "` must be on the same device as `master` (", master.device(), "), got ", t.device());
  TORCH_CHECK(t.numel() == numel, kOp, ": `", arg, "` must have ", numel, " elements, got ",
              t.numel());
  TORCH_CHECK(t.is_contiguous() && t.layout() == at::kStrided, kOp, ": `", arg,
              "` must be a contiguous dense tensor");
}

}  // namespace

void check_fused_adamw_int8_args(const at::Tensor& master, const at::Tensor& grad,
                                 const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_scales,
                                 const at::Tensor& exp_avg_sq_codes,
                                 const at::Tensor& exp_avg_sq_scales, int64_t block,
                                 const std::optional<at::Tensor>& param_out,
                                 const std::optional<at::Tensor>& found_inf,
                                 const std::optional<at::Tensor>& remainder,
                                 const std::optional<at::Tensor>& max_exp_avg_sq_codes,
                                 const std::optional<at::Tensor>& max_exp_avg_sq_scales) {
  TORCH_CHECK(block >= 16 && block <= kInt8OpMaxBlock && block % 16 == 0, kOp,
              ": `block` must be a multiple of 16 in [16, ", kInt8OpMaxBlock, "], got ", block);
  const int64_t n = master.numel();
  const int64_t blocks = (n + block - 1) / block;
  if (remainder.has_value()) {
    TORCH_CHECK(master.scalar_type() == at::kBFloat16, kOp,
                ": with `remainder`, `master` must be the bfloat16 parameter (the master's high "
                "half), got ",
                master.scalar_type());
    TORCH_CHECK(!param_out.has_value(), kOp,
                ": `param_out` must be None with `remainder` (`master` is the parameter)");
    check_tensor(*remainder, master, "remainder", n, at::kShort);
  } else {
    TORCH_CHECK(master.scalar_type() == at::kFloat, kOp, ": `master` must be float32, got ",
                master.scalar_type());
  }
  TORCH_CHECK(master.is_contiguous() && master.layout() == at::kStrided, kOp,
              ": `master` must be a contiguous dense tensor");
  to_kernel_dtype(grad, "fused_adamw_int8_", "grad");
  check_tensor(grad, master, "grad", n, grad.scalar_type());
  check_tensor(exp_avg_codes, master, "exp_avg_codes", n, at::kChar);
  check_tensor(exp_avg_sq_codes, master, "exp_avg_sq_codes", n, at::kChar);
  check_tensor(exp_avg_scales, master, "exp_avg_scales", blocks, at::kFloat);
  check_tensor(exp_avg_sq_scales, master, "exp_avg_sq_scales", blocks, at::kFloat);
  if (param_out.has_value()) {
    TORCH_CHECK(param_out->scalar_type() == at::kBFloat16 || param_out->scalar_type() == at::kHalf,
                kOp, ": `param_out` must be bfloat16 or float16, got ", param_out->scalar_type());
    check_tensor(*param_out, master, "param_out", n, param_out->scalar_type());
  }
  TORCH_CHECK(max_exp_avg_sq_codes.has_value() == max_exp_avg_sq_scales.has_value(), kOp,
              ": `max_exp_avg_sq_codes` and `max_exp_avg_sq_scales` must be given together "
              "(amsgrad) or both be None, got only `",
              max_exp_avg_sq_codes.has_value() ? "max_exp_avg_sq_codes" : "max_exp_avg_sq_scales",
              "`");
  if (max_exp_avg_sq_codes.has_value()) {
    check_tensor(*max_exp_avg_sq_codes, master, "max_exp_avg_sq_codes", n, at::kChar);
    check_tensor(*max_exp_avg_sq_scales, master, "max_exp_avg_sq_scales", blocks, at::kFloat);
  }
  if (found_inf.has_value()) check_scalar_tensor(*found_inf, master.device(), "found_inf");
  std::vector<ByteRange> writes{byte_range(master, "`master`"),
                                byte_range(exp_avg_codes, "`exp_avg_codes`"),
                                byte_range(exp_avg_scales, "`exp_avg_scales`"),
                                byte_range(exp_avg_sq_codes, "`exp_avg_sq_codes`"),
                                byte_range(exp_avg_sq_scales, "`exp_avg_sq_scales`")};
  if (param_out.has_value()) writes.push_back(byte_range(*param_out, "`param_out`"));
  if (remainder.has_value()) writes.push_back(byte_range(*remainder, "`remainder`"));
  if (max_exp_avg_sq_codes.has_value()) {
    writes.push_back(byte_range(*max_exp_avg_sq_codes, "`max_exp_avg_sq_codes`"));
    writes.push_back(byte_range(*max_exp_avg_sq_scales, "`max_exp_avg_sq_scales`"));
  }
  check_no_overlap("fused_adamw_int8_", writes, {byte_range(grad, "`grad`")});
}

}  // namespace zero_ext
