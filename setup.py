"""Builds zero_ext.ops._C: CUDAExtension when torch has CUDA and CUDA_HOME is set, else CPU-only CppExtension.

Options (environment): ZERO_EXT_FORCE_CPU=1 builds the CPU-only extension even with CUDA available;
TORCH_CUDA_ARCH_LIST is respected and defaults to "8.0;9.0" only when unset; MAX_JOBS caps parallel
compile jobs (default: by free memory, about 2 GiB per nvcc job).
"""

import glob
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_memory_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0


def _want_cuda(torch_utils):
    if os.environ.get("ZERO_EXT_FORCE_CPU", "0") == "1":
        return False
    import torch

    return torch.version.cuda is not None and torch_utils.CUDA_HOME is not None


def _extensions():
    from torch.utils import cpp_extension

    use_cuda = _want_cuda(cpp_extension)
    rel = lambda pattern: sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))  # noqa: E731
    sources = rel("csrc/cpu/*.cpp") + [
        p for p in rel("csrc/torch/*.cpp") if not os.path.basename(p).startswith("cuda_")
    ]
    # No -std: torch's BuildExtension adds the standard its own headers need (C++17 up to torch 2.9, C++20 from
    # 2.10) unless one is given, and an older pinned standard breaks the build against a newer torch.
    cxx = ["-O3", "-fopenmp", "-fno-math-errno"]
    define_macros = []
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources += rel("csrc/torch/cuda_*.cpp") + rel("csrc/cuda/*.cu")
        # Read by csrc/torch/registration.cpp: torch.ops.zero_ext._built_with_cuda() (zero_ext.ops.built_with_cuda).
        define_macros.append(("ZERO_EXT_WITH_CUDA", "1"))
        ext = cpp_extension.CUDAExtension(
            "zero_ext.ops._C",
            sources,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "zero_ext.ops._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    if "MAX_JOBS" not in os.environ:
        os.environ["MAX_JOBS"] = str(max(1, min(os.cpu_count() or 1, int(_free_memory_gib() // 2))))
    return [ext], cpp_extension.BuildExtension.with_options(use_ninja=True)


ext_modules, build_ext = _extensions()
BENCH_REQUIRES = ["matplotlib>=3.7", "tqdm>=4.60"]
HF_REQUIRES = ["transformers>=5.0", "accelerate>=1.1"]
LIGHTNING_REQUIRES = ["lightning>=2.4"]  # zero_ext.integrations.lightning (ZeroStrategy)
ACCELERATE_REQUIRES = ["accelerate>=1.1"]  # zero_ext.integrations.accelerate (ZeroAccelerator)

setup(
    name="zero_ext",
    version="0.1.0",
    description="ZeRO stage 1/2/3 sharded AdamW for PyTorch: fused kernels, flat buffers, overlapped comms",
    python_requires=">=3.10",
    # Every subpackage of zero_ext (checkpoint, comm, integrations, kernels, ...): a wheel must hold them all. The
    # Triton kernels live at the top of the repository, in kernels/zero_ext_kernels/; zero_ext/kernels is a relative
    # link to that folder, which find_packages follows, so the plain rule below installs them as zero_ext.kernels
    # and a checkout imports them from its own tree. kernels/ itself holds no __init__.py: a regular package named
    # `kernels` at the root of a checkout would be imported, from there, in place of the Hugging Face hub's
    # `kernels`, which transformers looks for (tests/package/test_packaging.py).
    packages=find_packages(include=["zero_ext", "zero_ext.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=["torch>=2.4", "numpy>=1.24", "safetensors>=0.4"],
    # bench: the benchmarks' plots and progress bar (tqdm). hf: zero_ext.integrations.transformers (ZeroTrainer;
    # transformers 5.x, whose Trainer needs accelerate; neither pulls another torch). dev includes both: `make test`
    # installs .[dev], tests/tooling/test_bench_smoke.py runs the benchmarks and
    # tests/integrations/test_integration_transformers.py the Trainer (about 20 s of installing and 20 s of tests).
    # expecttest: torch.testing._internal.common_optimizers (torch's own optimizer test inputs, which
    # tests/torch_compat/test_torch_optim_db.py runs ZeroAdamW through) imports it.
    extras_require={
        "dev": [
            "pytest>=7",
            "pytest-xdist>=3.2",  # `make test` runs the suite on two workers (--dist worksteal: 3.2+)
            "hypothesis>=6",
            "triton>=3.0",
            "ruff>=0.5",
            "clang-format>=18",
            "import-linter>=2.16",
            "expecttest>=0.2",
            "coverage>=7.10",  # `make coverage`: .coveragerc's patch = subprocess, _exit (spawned ranks measured)
        ]
        + BENCH_REQUIRES
        + HF_REQUIRES
        + LIGHTNING_REQUIRES,
        "bench": BENCH_REQUIRES,
        "hf": HF_REQUIRES,
        "lightning": LIGHTNING_REQUIRES,
        "accelerate": ACCELERATE_REQUIRES,
    },
)
