#include "checks.h"

#include <algorithm>
#include <utility>

#include "scalars.h"

namespace zero_ext {
namespace {

void check_state_tensor(const at::Tensor& t, const at::Tensor& master, const char* arg) {
  TORCH_CHECK(t.device() == master.device(), "zero_ext.fused_adamw_: `", arg,
              "` must be on the same device as `master` (", master.device(), "), got ", t.device());
  TORCH_CHECK(t.numel() == master.numel(), "zero_ext.fused_adamw_: `", arg,
              "` must have the same number of elements as `master` (", master.numel(), "), got ",
              t.numel());
  TORCH_CHECK(t.is_contiguous(), "zero_ext.fused_adamw_: `", arg, "` must be contiguous");
  TORCH_CHECK(t.layout() == at::kStrided, "zero_ext.fused_adamw_: `", arg,
              "` must be a dense (strided) tensor, got layout ", t.layout());
}

}  // namespace

DType to_kernel_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "zero_ext.", op, ": `", arg,
                  "` must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

ByteRange byte_range(const at::Tensor& t, int64_t first, int64_t numel, std::string name) {
  ByteRange r{std::move(name)};
  if (numel > 0) {
    const auto size = static_cast<uintptr_t>(t.element_size());
    r.begin =
        reinterpret_cast<uintptr_t>(t.const_data_ptr()) + static_cast<uintptr_t>(first) * size;
    r.end = r.begin + static_cast<uintptr_t>(numel) * size;
  }
  return r;
}

void check_no_overlap(const char* op, const std::vector<ByteRange>& writes,
                      const std::vector<ByteRange>& reads) {
  struct Entry {
    const ByteRange* range;
    size_t order;  // position in writes, then reads: messages name the pair in this order
    bool written;
  };
  std::vector<Entry> entries;
  entries.reserve(writes.size() + reads.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    if (writes[i].begin < writes[i].end) entries.push_back({&writes[i], i, true});
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    if (reads[i].begin < reads[i].end) entries.push_back({&reads[i], writes.size() + i, false});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.range->begin != b.range->begin ? a.range->begin < b.range->begin : a.order < b.order;
  });
  // Sweep by start address: a range overlaps an earlier one iff the earlier one ends past its
  // start, so the earlier range that ends last (of all, or of the written ones) is the witness.
  const Entry* ends_last = nullptr;
  const Entry* written_ends_last = nullptr;
  for (const Entry& e : entries) {
    const Entry* other = e.written ? ends_last : written_ends_last;
    if (other != nullptr && other->range->end > e.range->begin) {
      const Entry& first = other->order < e.order ? *other : e;
      const Entry& second = other->order < e.order ? e : *other;
      TORCH_CHECK(false, "zero_ext.", op, ": ", first.range->name, " and ", second.range->name,
                  " overlap in memory; memory the op writes must not be shared with any other "
                  "argument");
    }
    if (ends_last == nullptr || e.range->end > ends_last->range->end) ends_last = &e;
    if (e.written &&
        (written_ends_last == nullptr || e.range->end > written_ends_last->range->end)) {
      written_ends_last = &e;
    }
  }
}

void check_fused_adamw_args(const at::Tensor& master, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const std::optional<at::Tensor>& max_exp_avg_sq,
                            const std::optional<at::Tensor>& param_out,
                            const std::optional<at::Tensor>& found_inf,
                            const std::optional<at::Tensor>& remainder, int64_t element_offset) {
  if (remainder.has_value()) {
    TORCH_CHECK(master.scalar_type() == at::kBFloat16,
                "zero_ext.fused_adamw_: with `remainder`, `master` must be the bfloat16 parameter "
                "(the master's high half), got ",
                master.scalar_type());
    TORCH_CHECK(remainder->scalar_type() == at::kShort,
                "zero_ext.fused_adamw_: `remainder` must be int16, got ", remainder->scalar_type());
    TORCH_CHECK(!param_out.has_value(),
                "zero_ext.fused_adamw_: `param_out` must be None with `remainder` (`master` is the "
                "parameter)");
  } else {
    TORCH_CHECK(master.scalar_type() == at::kFloat,
                "zero_ext.fused_adamw_: `master` must be float32, got ", master.scalar_type());
  }
  TORCH_CHECK(master.is_contiguous() && master.layout() == at::kStrided,
              "zero_ext.fused_adamw_: `master` must be a contiguous dense tensor");
  // One moment dtype per call: the kernels are instantiated per (moment dtype), not per moment.
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat || exp_avg.scalar_type() == at::kBFloat16,
              "zero_ext.fused_adamw_: `exp_avg` must be float32 or bfloat16, got ",
              exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == exp_avg.scalar_type(),
              "zero_ext.fused_adamw_: `exp_avg_sq` must have `exp_avg`'s dtype (",
              exp_avg.scalar_type(), "; the moments share one dtype, float32 or bfloat16), got ",
              exp_avg_sq.scalar_type());
  TORCH_CHECK(element_offset >= 0, "zero_ext.fused_adamw_: `element_offset` must be >= 0, got ",
              element_offset);
  to_kernel_dtype(grad, "fused_adamw_", "grad");
  check_state_tensor(grad, master, "grad");
  check_state_tensor(exp_avg, master, "exp_avg");
  check_state_tensor(exp_avg_sq, master, "exp_avg_sq");
  if (max_exp_avg_sq.has_value()) {
    TORCH_CHECK(max_exp_avg_sq->scalar_type() == exp_avg.scalar_type(),
                "zero_ext.fused_adamw_: `max_exp_avg_sq` (amsgrad) must have `exp_avg`'s dtype (",
                exp_avg.scalar_type(), "; the moments share one dtype), got ",
                max_exp_avg_sq->scalar_type());
    check_state_tensor(*max_exp_avg_sq, master, "max_exp_avg_sq");
  }
  if (remainder.has_value()) check_state_tensor(*remainder, master, "remainder");
  if (param_out.has_value()) {
    TORCH_CHECK(param_out->scalar_type() == at::kBFloat16 || param_out->scalar_type() == at::kHalf,
                "zero_ext.fused_adamw_: `param_out` must be bfloat16 or float16, got ",
                param_out->scalar_type());
    check_state_tensor(*param_out, master, "param_out");
  }
  if (found_inf.has_value()) check_scalar_tensor(*found_inf, master.device(), "found_inf");
  // Elementwise, yet no sharing is allowed: a partial overlap makes one element's write another's
  // read, and even an identical grad and master would be read after the write on some paths.
  std::vector<ByteRange> writes{byte_range(master, "`master`"), byte_range(exp_avg, "`exp_avg`"),
                                byte_range(exp_avg_sq, "`exp_avg_sq`")};
  if (max_exp_avg_sq.has_value()) {
    writes.push_back(byte_range(*max_exp_avg_sq, "`max_exp_avg_sq`"));
  }
  if (param_out.has_value()) writes.push_back(byte_range(*param_out, "`param_out`"));
  if (remainder.has_value()) writes.push_back(byte_range(*remainder, "`remainder`"));
  check_no_overlap("fused_adamw_", writes, {byte_range(grad, "`grad`")});
}

std::vector<TensorSlice> check_flatten_args(const at::Tensor& flat, at::TensorList tensors,
                                            at::IntArrayRef offsets, const char* op,
                                            bool tensors_are_outputs) {
  to_kernel_dtype(flat, op, "flat");
  TORCH_CHECK(flat.is_contiguous() && flat.layout() == at::kStrided, "zero_ext.", op,
              ": `flat` must be a contiguous dense tensor");
  TORCH_CHECK(offsets.size() == tensors.size(), "zero_ext.", op, ": `offsets` has ", offsets.size(),
              " entries but `tensors` has ", tensors.size());
  std::vector<TensorSlice> slices;
  slices.reserve(tensors.size());
  std::vector<ByteRange> writes;  // what the op writes: flat's destination ranges, or the tensors
  std::vector<ByteRange> reads;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string arg = "tensors[" + std::to_string(i) + "]";
    DType dt = to_kernel_dtype(t, op, arg.c_str());
    TORCH_CHECK(t.device() == flat.device(), "zero_ext.", op, ": `", arg, "` is on ", t.device(),
                " but `flat` is on ", flat.device());
    TORCH_CHECK(t.is_contiguous() && t.layout() == at::kStrided, "zero_ext.", op, ": `", arg,
                "` must be a contiguous dense tensor");
    const int64_t off = offsets[i];
    TORCH_CHECK(off >= 0 && off + t.numel() <= flat.numel(), "zero_ext.", op, ": `", arg, "` (",
                t.numel(), " elements at offset ", off, ") does not fit in `flat` (", flat.numel(),
                " elements)");
    if (tensors_are_outputs) {
      writes.push_back(byte_range(t, "`" + arg + "`"));
    } else {
      reads.push_back(byte_range(t, "`" + arg + "`"));
      writes.push_back(byte_range(flat, off, t.numel(), "`flat` (the range of `" + arg + "`)"));
    }
    slices.push_back(TensorSlice{t.numel() > 0 ? t.data_ptr() : nullptr, t.numel(), off, dt, 0});
  }
  if (tensors_are_outputs) reads.push_back(byte_range(flat, "`flat`"));
  check_no_overlap(op, writes, reads);
  return slices;
}

}  // namespace zero_ext
