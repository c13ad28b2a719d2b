"""The two element-wise steps of gradient reduction on the right kernel for the tensors' device: Triton
(``zero_ext.kernels``) on CUDA, the C++ SIMD kernels (``zero_ext.ops``) on CPU. The Triton launchers run under
the tensor's device guard (``_launch.device_guard``), so a caller on another current device is safe."""

from __future__ import annotations

import torch

from .. import ops

CPU_BLOCK = 1 << 20  # elements per fp32 temporary of accumulate_into on CPU (4 MiB)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def cast_scale_into(out: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``out[:] = src * scale`` rounded to ``out.dtype`` (nearest even); ``out`` is a contiguous 1-D view."""
    src = _flat(src)
    if out.is_cuda:
        from .cast_scale import cast_scale

        cast_scale(src, scale, out=out)
    else:
        ops.flatten_(out, [src], [0], scale)


def accumulate_into(acc: torch.Tensor, src: torch.Tensor) -> None:
    """fp32 ``acc += src`` for a bf16/fp16/fp32 ``src`` of the same size (any shape); ``acc`` is contiguous 1-D."""
    src = _flat(src)
    if acc.is_cuda:
        from .accumulate import accumulate_

        accumulate_(acc, src, 1.0)
    elif src.dtype == acc.dtype:
        acc.add_(src)
    else:
        # On CPU, torch casts a bf16 operand of an fp32 add to a full fp32 temporary first: 64 MB for one 16M-param
        # gradient, allocated and unmapped again every time, whose page faults cost ~0.5 s of a 128M-param
        # iteration (bench_offload.py's in-memory contender ran slower than offload="cpu"). Blocks of CPU_BLOCK
        # elements keep the temporaries small enough for the allocator to reuse; the sums are the same.
        for start in range(0, src.numel(), CPU_BLOCK):
            acc[start : start + CPU_BLOCK].add_(src[start : start + CPU_BLOCK])
