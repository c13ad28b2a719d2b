"""The two element-wise steps of gradient reduction on the right kernel for the tensors' device: Triton
(``zero_ext.kernels``) on CUDA, the C++ SIMD kernels (``zero_ext.ops``) on CPU. The Triton launchers run under
the tensor's device guard (``_launch.device_guard``), so a caller on another current device is safe.

Backward calls the many-tensor forms (:func:`flatten_into`, :func:`add_flattened`), once per bucket: a call per
gradient cost ~5 us of host time on CPU and a Python Triton launch on CUDA, per parameter
(bench/results/backward_hooks_cpu.md)."""

from __future__ import annotations

import torch

from .. import ops

CPU_BLOCK = 1 << 20  # elements per fp32 temporary of accumulate_into on CPU (4 MiB)
# Elements (1 MiB of fp32) of add_flattened's scratch: bounds the temporary whatever the bucket size, while a
# run of small gradients (the case it is for) costs 3 calls however many they are.
SCRATCH = 1 << 18


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


def add_flattened(flat: torch.Tensor, srcs: list[torch.Tensor], offsets: list[int]) -> None:
    """``flat[offsets[i] : offsets[i] + srcs[i].numel()] += srcs[i]`` in fp32 for every i (ranges disjoint), bit for
    bit :func:`accumulate_into` of each, in a few calls: the sources, in runs spanning at most ``SCRATCH`` elements
    of ``flat``, are flattened into an fp32 scratch filled with -0.0 (one ``ops.flatten_``, one CUDA launch), which
    is added to the run in one ``add_``. ``x + (-0.0)`` is ``x`` for every fp32 ``x`` (+0.0 included), so the gaps
    between the sources (padding, parameters without a gradient) keep their bits. A source larger than a run goes
    through :func:`accumulate_into` alone. ``srcs`` contiguous, any shapes; ``flat`` fp32, contiguous, 1-D."""
    order = sorted(range(len(srcs)), key=offsets.__getitem__)
    run: list[int] = []
    for i in order:
        n = srcs[i].numel()
        if n > SCRATCH:
            accumulate_into(flat[offsets[i] : offsets[i] + n], srcs[i])
            continue
        if run and offsets[i] + n - offsets[run[0]] > SCRATCH:
            _add_run(flat, srcs, offsets, run)
            run = []
        run.append(i)
    _add_run(flat, srcs, offsets, run)


def _add_run(flat: torch.Tensor, srcs: list[torch.Tensor], offsets: list[int], run: list[int]) -> None:
    if not run:
        return
    if len(run) == 1:
        i = run[0]
        accumulate_into(flat[offsets[i] : offsets[i] + srcs[i].numel()], srcs[i])
        return
    start = offsets[run[0]]
    end = max(offsets[i] + srcs[i].numel() for i in run)
    scratch = torch.full((end - start,), -0.0, dtype=torch.float32, device=flat.device)
    ops.flatten_(scratch, [srcs[i] for i in run], [offsets[i] - start for i in run], 1.0)
    flat[start:end].add_(scratch)


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
        # elements keep the temporaries small enough for the allocator to reuse; the sums are the same (the cast is
        # exact). Each block is cast into one fp32 scratch per call rather than by add_ itself: the per-block
        # temporaries left 12-20 MiB in glibc's heap (one 64M-element bf16 gradient,
        # tests/engine/test_fragment_memory.py's nvme case), the scratch 4 MiB.
        scratch = torch.empty(min(CPU_BLOCK, src.numel()), dtype=torch.float32)
        for start in range(0, src.numel(), CPU_BLOCK):
            block = src[start : start + CPU_BLOCK]
            cast = scratch[: block.numel()]
            cast.copy_(block)
            acc[start : start + block.numel()].add_(cast)
