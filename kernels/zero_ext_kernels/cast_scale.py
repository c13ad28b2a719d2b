"""``cast_scale``: ``out = round_to_nearest_even((x.float() * scale), out.dtype)``, one Triton kernel.

The engine uses it to write each low-precision gradient, pre-scaled by 1/world, into its slot of an
fp32 (or bf16) reduce-scatter staging bucket: ``out`` may be a view at any offset into a flat buffer.
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
from .rounding import round_fp32_rne, to_fp32

_OP = "zero_ext.kernels.cast_scale"


@triton.jit
def _cast_scale_kernel(x_ptr, out_ptr, scale, scale_ptr, n, SCALE_FROM_PTR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCALE_FROM_PTR:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        # tl.cast, not .to: under the interpreter a Python float arrives untyped (and would be typed fp64
        # if subnormal or nan); the launcher already rounded it to an fp32 value, so this is exact.
        s = tl.cast(scale, tl.float32)
    x = to_fp32(tl.load(x_ptr + offs, mask=mask))
    tl.store(out_ptr + offs, round_fp32_rne(x * s, out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, out: torch.Tensor, scale: float, scale_tensor: Optional[torch.Tensor]) -> None:
    n = x.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    from_ptr = scale_tensor is not None
    with device_guard(out):
        torch.library.wrap_triton(_cast_scale_kernel)[grid](
            x, out, scale, scale_tensor if from_ptr else x, n, SCALE_FROM_PTR=from_ptr, BLOCK=BLOCK, num_warps=NUM_WARPS
        )


def _cast_scale_into_fake(x, out, scale, scale_tensor) -> None:
    check_fake_same(_OP, "out", out, "x", x)
    check_fake_scale(_OP, scale_tensor, "x", x)


def _cast_scale_fake(x, scale, scale_tensor, out_dtype):
    check_fake_scale(_OP, scale_tensor, "x", x)
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


# torch.ops.zero_ext.* ops so torch.compile'd code can call the kernel (see register_op for how); the
# checks live in the public `cast_scale` below, which is what callers should use.
@register_op("zero_ext::cast_scale_into", mutates_args={"out"}, fake=_cast_scale_into_fake)
def _cast_scale_into_op(x: torch.Tensor, out: torch.Tensor, scale: float, scale_tensor: Optional[torch.Tensor]) -> None:
    _launch(x, out, scale, scale_tensor)


@register_op("zero_ext::cast_scale", mutates_args=(), fake=_cast_scale_fake)
def _cast_scale_op(
    x: torch.Tensor, scale: float, scale_tensor: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, out, scale, scale_tensor)
    return out


def cast_scale(
    x: torch.Tensor,
    scale: Scalar = 1.0,
    *,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(x.float() * scale)`` rounded to nearest even into ``out_dtype`` or into ``out``; returns the result.

    Bit for bit ``(x.float() * scale).to(dtype)`` with ``scale`` taken as an fp32 value (NaNs stay NaN).

    Args:
        x: bf16, fp16 or fp32, contiguous, any shape (treated as flat).
        scale: a Python number (rounded to fp32) or a one-element fp32 tensor on ``x``'s device, read by
            the kernel (no host sync).
        out_dtype: bf16, fp16 or fp32 for a new tensor shaped like ``x``; defaults to ``out.dtype`` when
            ``out`` is given, else to ``x.dtype``.
        out: a contiguous tensor with ``x.numel()`` elements on ``x``'s device, e.g. a view into a flat
            buffer; it may be ``x`` itself (in-place scale, same dtype) but must not otherwise overlap ``x``.

    Invalid arguments raise ``TypeError``/``ValueError`` naming the argument before anything is written.
    """
    check_flat(_OP, "x", x, FLOAT_DTYPES)
    value, scale_tensor = split_scale(_OP, scale, x.device)
    if out is None:
        dtype = x.dtype if out_dtype is None else out_dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{_OP}: `out_dtype` must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
        return torch.ops.zero_ext.cast_scale(x, value, scale_tensor, dtype)
    check_flat(_OP, "out", out, FLOAT_DTYPES)
    if out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"{_OP}: `out_dtype` ({out_dtype}) disagrees with `out.dtype` ({out.dtype})")
    check_same(_OP, "out", out, "x", x)
    check_no_partial_overlap(_OP, "out", out, "x", x)
    torch.ops.zero_ext.cast_scale_into(x, out, value, scale_tensor)
    return out
