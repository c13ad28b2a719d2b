"""``accumulate_``: fp32 ``acc += x.float() * scale`` in place, one Triton kernel.

Stage 2 adds each reduce-scattered bucket shard into the rank's fp32 gradient shard with it.

Rounding: the product is rounded to fp32 before the add, so the result is bit for bit torch's
``acc.add_(x.float() * scale)``. (Not ``acc.add_(x, alpha=scale)``: torch's CPU kernel fuses that into
an FMA.) Compiled Triton contracts ``a * b + c`` into an FMA by default; the launch passes
``enable_fp_fusion=False`` to keep the two roundings. Under torch.compile, Inductor recompiles the kernel
with its own options and drops that flag (it is not a kernel argument), so there the result may be the
single-rounding ``fma(x, scale, acc)`` instead: within 1/2 ulp of the exact sum either way.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import (
    BLOCK,
    FLOAT_DTYPES,
    NUM_WARPS,
    Scalar,
    check_fake_same,
    check_fake_scale,
    check_flat,
    check_no_partial_overlap,
    check_same,
    device_guard,
    register_op,
    split_scale,
)
from .rounding import to_fp32

_OP = "zero_ext.kernels.accumulate_"


@triton.jit
def _accumulate_kernel(acc_ptr, x_ptr, scale, scale_ptr, n, SCALE_FROM_PTR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCALE_FROM_PTR:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = tl.cast(scale, tl.float32)  # exact: the launcher passes an fp32 value (see cast_scale.py)
    x = to_fp32(tl.load(x_ptr + offs, mask=mask))
    acc = tl.load(acc_ptr + offs, mask=mask)
    tl.store(acc_ptr + offs, acc + x * s, mask=mask)


def _accumulate_fake(acc, x, scale, scale_tensor) -> None:
    check_fake_same(_OP, "x", x, "acc", acc)
    check_fake_scale(_OP, scale_tensor, "acc", acc)


@register_op("zero_ext::accumulate_", mutates_args={"acc"}, fake=_accumulate_fake)
def _accumulate_op(acc: torch.Tensor, x: torch.Tensor, scale: float, scale_tensor: Optional[torch.Tensor]) -> None:
    n = acc.numel()
    if n == 0:
        return
    from_ptr = scale_tensor is not None
    kernel = torch.library.wrap_triton(_accumulate_kernel)
    launch = kernel[(triton.cdiv(n, BLOCK),)]
    args = (acc, x, scale, scale_tensor if from_ptr else x, n)
    with device_guard(acc):
        if isinstance(kernel, triton.runtime.JITFunction):  # a real launch (not traced, not interpreted)
            launch(*args, SCALE_FROM_PTR=from_ptr, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
        else:  # traced for torch.compile (the flag is no kernel argument there) or interpreted (no FMA)
            launch(*args, SCALE_FROM_PTR=from_ptr, BLOCK=BLOCK, num_warps=NUM_WARPS)


def accumulate_(acc: torch.Tensor, x: torch.Tensor, scale: Scalar = 1.0) -> torch.Tensor:
    """``acc += x.float() * scale`` in fp32, in place; returns ``acc``.

    Bit for bit ``acc.add_(x.float() * scale)`` with ``scale`` taken as an fp32 value (see module doc).

    Args:
        acc: fp32, contiguous.
        x: bf16, fp16 or fp32, contiguous, same numel and device as ``acc`` (shapes may differ: both are
            treated as flat); may be ``acc`` itself, but must not otherwise overlap it.
        scale: a Python number (rounded to fp32) or a one-element fp32 tensor on the device (no host sync).

    Invalid arguments raise ``TypeError``/``ValueError`` naming the argument before anything is written.
    """
    check_flat(_OP, "acc", acc, (torch.float32,))
    check_flat(_OP, "x", x, FLOAT_DTYPES)
    check_same(_OP, "x", x, "acc", acc)
    check_no_partial_overlap(_OP, "x", x, "acc", acc)
    value, scale_tensor = split_scale(_OP, scale, acc.device)
    torch.ops.zero_ext.accumulate_(acc, x, value, scale_tensor)
    return acc
