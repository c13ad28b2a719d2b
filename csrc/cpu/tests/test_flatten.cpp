// cpu::flatten: mixed-dtype round trips with scale against the scalar conversions, exact bit copies
// when nothing changes, and the same result for 1 and 2 threads (split across tensors).
#include "cpu/float_convert.h"
#include "test_util.h"

using namespace zero_ext;
using namespace zero_ext::cpu;
using namespace zero_ext::cpu::test;

namespace {

uint16_t round_to(DType d, float x) {
  return d == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
}

struct Tensor {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : f16.data(); }
  float at(int64_t i) const {
    return dtype == DType::kFloat32 ? f32[i] : load_as_float(f16.data(), dtype, i);
  }
};

Tensor make(DType dtype, int64_t n, uint32_t seed) {
  Tensor t{dtype, {}, {}};
  auto v = random_floats(n, seed);
  if (dtype == DType::kFloat32) t.f32 = v;
  for (float x : v)
    if (dtype != DType::kFloat32) t.f16.push_back(round_to(dtype, x));
  return t;
}

void round_trip(DType flat_dtype, float scale, int threads) {
  const int64_t sizes[] = {0, 1, 7, 97, 1025, 70001, 3};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  std::vector<Tensor> tensors;
  std::vector<TensorSlice> slices;
  int64_t offset = 5;  // a gap before, and between, the tensors
  for (int k = 0; k < 7; ++k) {
    tensors.push_back(make(dtypes[k % 3], sizes[k], 10 + k));
  }
  for (auto& t : tensors) {
    const int64_t n = t.dtype == DType::kFloat32 ? t.f32.size() : t.f16.size();
    slices.push_back(TensorSlice{t.data(), n, offset, t.dtype, 0});
    offset += n + 3;
  }
  std::vector<uint8_t> flat(offset * element_size(flat_dtype), 0xAB);
  flatten(flat.data(), flat_dtype, slices.data(), slices.size(), scale, true, threads);
  for (size_t k = 0; k < tensors.size(); ++k) {
    for (int64_t i = 0; i < slices[k].numel; ++i) {
      const float want = tensors[k].at(i) * scale;
      const int64_t j = slices[k].offset + i;
      const bool ok =
          flat_dtype == DType::kFloat32
              ? float_bits(reinterpret_cast<float*>(flat.data())[j]) == float_bits(want)
              : reinterpret_cast<uint16_t*>(flat.data())[j] == round_to(flat_dtype, want);
      if (!ok) {
        CHECK(false, "flatten flat=%d tensor %zu element %lld", int(flat_dtype), k, (long long)i);
        break;
      }
    }
  }
  CHECK(flat[0] == 0xAB && flat[flat.size() - 1] == 0xAB, "bytes outside the slices were written");
  // Back out: each tensor receives flat * scale rounded to its own dtype.
  std::vector<Tensor> outs = tensors;
  for (size_t k = 0; k < outs.size(); ++k) slices[k].data = outs[k].data();
  flatten(flat.data(), flat_dtype, slices.data(), slices.size(), scale, false, threads);
  for (size_t k = 0; k < outs.size(); ++k) {
    for (int64_t i = 0; i < slices[k].numel; ++i) {
      const float want = load_as_float(flat.data(), flat_dtype, slices[k].offset + i) * scale;
      const bool ok = outs[k].dtype == DType::kFloat32
                          ? float_bits(outs[k].f32[i]) == float_bits(want)
                          : outs[k].f16[i] == round_to(outs[k].dtype, want);
      if (!ok) {
        CHECK(false, "unflatten flat=%d tensor %zu element %lld", int(flat_dtype), k, (long long)i);
        break;
      }
    }
  }
}

}  // namespace

int main() {
  for (DType flat : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (float scale : {1.0f, 0.25f, 3.0f}) {
      for (int threads : {1, 2}) round_trip(flat, scale, threads);
    }
  }
  // scale 1 between equal dtypes copies bits, NaN payloads included.
  std::vector<uint32_t> src(100000, 0x7FA00001u), dst(100001, 0);
  TensorSlice s{src.data(), 100000, 1, DType::kFloat32, 0};
  flatten(dst.data(), DType::kFloat32, &s, 1, 1.0f, true, 2);
  CHECK(same_bits(dst.data() + 1, src.data(), src.size() * 4) && dst[0] == 0, "exact copy");
  flatten(dst.data(), DType::kFloat32, nullptr, 0, 1.0f, true, 2);  // no tensors: nothing to do
  return zero_ext::cpu::test::finish("test_flatten");
}
