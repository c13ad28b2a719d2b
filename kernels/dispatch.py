"""The two element-wise steps of gradient reduction on the right kernel for the tensors' device: Triton
(``zero_ext.kernels``) on CUDA, the C++ SIMD kernels (``zero_ext.ops``) on CPU. The Triton launchers run under
the tensor's device guard (``_launch.device_guard``), so a caller on another current device is safe.

Backward calls the many-tensor forms (:func:`flatten_into`, :func:`accumulate_all`), once per bucket: a call per
gradient cost ~5 us of host time on CPU and a Python Triton launch on CUDA, per parameter
(bench/results/backward_hooks_cpu.md)."""

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


def flatten_into(flat: torch.Tensor, grads: list[torch.Tensor], offsets: list[int], scale: float) -> None:
    """``flat[offsets[i] : offsets[i] + grads[i].numel()] = grads[i] * scale`` rounded to ``flat.dtype`` (nearest
    even) for every i: bit for bit :func:`cast_scale_into` of each, in one C++ call (one kernel launch on CUDA:
    csrc/cuda/flatten.cu). ``grads`` contiguous, any shapes."""
    if grads:
        ops.flatten_(flat, grads, offsets, scale)


def accumulate_all(accs: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """:func:`accumulate_into` for every pair (shapes equal), bit for bit, from one C++ call: torch's
    ``_foreach_add_``, whose per-tensor loop (the sources' dtype differs from fp32, so its multi-tensor kernel does
    not apply) costs no Python per tensor. On CPU a low-precision source larger than ``CPU_BLOCK`` elements still
    goes through :func:`accumulate_into`'s blocks (see there)."""
    if not accs:
        return
    if not accs[0].is_cuda:
        big = [i for i, s in enumerate(srcs) if s.numel() > CPU_BLOCK and s.dtype != accs[i].dtype]
        if big:
            for i in big:
                accumulate_into(accs[i], srcs[i])
            skip = set(big)
            accs = [a for i, a in enumerate(accs) if i not in skip]
            srcs = [s for i, s in enumerate(srcs) if i not in skip]
    torch._foreach_add_(accs, srcs)


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
