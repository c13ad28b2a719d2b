"""What the build says about itself: the CUDA flag setup.py defines is the one the binary reports, and the
install requirements carry only what `import zero_ext` needs."""

import importlib.metadata
import re

import pytest
import torch

from zero_ext import ops

TENSOR_OPS = ("fused_adamw_", "fused_adamw_int8_", "flatten_", "unflatten_", "sum_squares")


def test_built_with_cuda_matches_the_registered_kernels():
    """setup.py defines ZERO_EXT_WITH_CUDA exactly when it compiles cuda_ops.cpp, which registers the CUDA
    kernels; registration.cpp reads the macro. Both must agree, whatever machine builds it."""
    cuda_kernels = [torch._C._dispatch_has_kernel_for_dispatch_key(f"zero_ext::{op}", "CUDA") for op in TENSOR_OPS]
    assert ops.built_with_cuda() is all(cuda_kernels)
    assert ops.built_with_cuda() is any(cuda_kernels)


@pytest.mark.cuda
def test_gpu_machine_has_the_cuda_build():
    assert ops.built_with_cuda(), "a CPU-only build of zero_ext on a GPU machine: rebuild with torch CUDA + CUDA_HOME"


def _requirements():
    try:
        return importlib.metadata.requires("zero_ext") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("zero_ext is not installed as a distribution (pip install -e .)")


def test_tqdm_is_a_bench_and_dev_extra_not_a_requirement():
    """Only the benchmarks (bench/) use tqdm. (Reads the installed metadata: reinstall after editing setup.py.)"""
    reqs = _requirements()
    name = lambda r: re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower()  # noqa: E731
    core = {name(r) for r in reqs if "extra ==" not in r}
    assert {"torch", "numpy", "safetensors"} <= core and "tqdm" not in core
    for extra in ("bench", "dev"):
        assert any(name(r) == "tqdm" and re.search(rf"extra == ['\"]{extra}['\"]", r) for r in reqs), extra
