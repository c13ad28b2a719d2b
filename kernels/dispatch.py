"""The two element-wise steps of gradient reduction on the right kernel for the tensors' device: Triton
(``zero_ext.kernels``) on CUDA, the C++ SIMD kernels (``zero_ext.ops``) on CPU. The Triton launchers run under
the tensor's device guard (``_launch.device_guard``), so a caller on another current device is safe."""

from __future__ import annotations

import torch

from .. import ops


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
    else:
        acc.add_(src)
