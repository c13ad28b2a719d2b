// The op schemas and the Python module init. Backends: cpu_ops.cpp (CPU) and cuda_ops.cpp (CUDA,
// only in CUDA builds, which setup.py marks by defining ZERO_EXT_WITH_CUDA). Python fake impls live
// in zero_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "../cpu/kernels.h"

namespace zero_ext {
namespace {

// Test/benchmark hook: force the CPU SIMD path ("scalar", "avx2", "avx512", "auto"); "" queries.
// Returns the path now in use.
std::string cpu_isa(const std::string& isa) {
  using cpu::Isa;
  if (!isa.empty()) {
    Isa want;
    if (isa == "auto") {
      want = Isa::kAuto;
    } else if (isa == "scalar") {
      want = Isa::kScalar;
    } else if (isa == "avx2") {
      want = Isa::kAvx2;
    } else if (isa == "avx512") {
      want = Isa::kAvx512;
    } else {
      TORCH_CHECK(false,
                  "zero_ext._cpu_isa: `isa` must be one of auto, scalar, avx2, avx512, got '", isa,
                  "'");
    }
    cpu::force_isa(want);
  }
  return cpu::isa_name(cpu::active_isa());
}

// Whether this build has the CUDA kernels (setup.py builds them when torch has CUDA and CUDA_HOME
// is set), so a CPU-only build on a GPU machine can say so instead of failing at the first CUDA
// call.
bool built_with_cuda() {
#ifdef ZERO_EXT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY(zero_ext, m) {
  m.def(
      "fused_adamw_(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, *, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, float step, "
      "float grad_scale=1.0, Tensor? lr_tensor=None, Tensor? beta1_tensor=None, "
      "Tensor? beta2_tensor=None, Tensor? eps_tensor=None, Tensor? weight_decay_tensor=None, "
      "Tensor? step_tensor=None, Tensor? grad_scale_tensor=None, Tensor(d!)? param_out=None, "
      "Tensor? found_inf=None, Tensor(e!)? max_exp_avg_sq=None, bool maximize=False, "
      "Tensor(f!)? remainder=None, int rounding_seed=0, int element_offset=0) -> ()");
  m.def("flatten_(Tensor(a!) flat, Tensor[] tensors, int[] offsets, float scale=1.0) -> ()");
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors, int[] offsets, float scale=1.0) -> ()");
  m.def("sum_squares(Tensor x) -> (Tensor sumsq, Tensor nonfinite)");
  m.def("_cpu_isa(str isa=\"\") -> str", &zero_ext::cpu_isa);
  m.def("_built_with_cuda() -> bool", &zero_ext::built_with_cuda);
}

// `import zero_ext.ops._C` needs a module init function; importing it runs the static registrations
// above and in the backend files. The module itself is empty (extension-cpp's pattern).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
