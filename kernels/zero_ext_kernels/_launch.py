"""Launch constants, argument checks and op registration shared by the Triton op launchers (no kernels)."""

from __future__ import annotations

import contextlib
import math
import os
import struct
from typing import Callable, Iterable, Optional, Union

import torch

from ..ops import Scalar, split_scalar

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The interpreter pays a fixed Python cost per program, so it wants few, large blocks; compiled
# kernels want many small ones (16 fp32 elements per thread at 8 warps). GPU values are the usual
# choice for an elementwise memory-bound kernel, not yet measured on this project.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK = 1 << 16 if INTERPRETED else 4096
NUM_WARPS = 8


def to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as torch rounds a Python scalar multiplying an fp32 tensor)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # rounds past the largest finite fp32
        return math.copysign(math.inf, value)


def split_scale(op: str, scale: Scalar, device: torch.device) -> tuple[float, Optional[torch.Tensor]]:
    """``(fp32 value, None)`` for a Python number, ``(1.0, tensor)`` for a one-element fp32 tensor on ``device``
    (read by the kernel). The number-or-tensor split is ``zero_ext.ops.split_scalar``'s, as for the C++
    ops; the fp32 rounding and the tensor checks are the Triton kernels' own."""
    value, tensor = split_scalar(op, "scale", scale)
    if tensor is None:
        return to_fp32(value), None
    if tensor.numel() != 1:
        raise ValueError(f"{op}: `scale` tensor must have exactly one element, got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.float32:
        raise TypeError(f"{op}: `scale` tensor must be float32, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{op}: `scale` tensor must be on {device} (read in the kernel), got {tensor.device}")
    return 1.0, tensor


def device_guard(t: torch.Tensor):
    """The context every launch runs in: ``t``'s CUDA device made current, so the kernel runs on ``t``'s device
    and on that device's current stream, whatever device the calling thread has current (stage 1's last buckets
    launch from autograd's end-of-backward callback on the user's thread). A no-op for CPU tensors and while
    torch.compile traces (Inductor places the kernel itself)."""
    if t.device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def check_flat(op: str, name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: `{name}` must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return t


def check_same(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{op}: `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")
    if t.numel() != ref.numel():
        raise ValueError(f"{op}: `{name}` has {t.numel()} elements but `{ref_name}` has {ref.numel()}")


def check_no_partial_overlap(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Allow ``t`` to be exactly ``ref`` (same address and dtype: each element is read, then written, by
    the same program); reject any other overlap, where one program could read what another wrote."""
    if t.numel() == 0 or ref.numel() == 0 or torch.compiler.is_compiling():
        return  # (tracing sees fake tensors, whose addresses mean nothing; eager calls are checked)
    if t.untyped_storage().data_ptr() != ref.untyped_storage().data_ptr():
        return
    t0, r0 = t.data_ptr(), ref.data_ptr()
    t1, r1 = t0 + t.numel() * t.element_size(), r0 + ref.numel() * ref.element_size()
    if t0 < r1 and r0 < t1 and not (t0 == r0 and t.dtype == ref.dtype):
        raise ValueError(
            f"{op}: `{name}` overlaps `{ref_name}` in memory; only the identical tensor (same address and "
            f"dtype, an in-place update) is allowed"
        )


def check_fake_same(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """check_same for the fake impls (torch._check, so it works on fake and meta tensors alike): a call with one
    tensor on ``meta`` reaches the fake, which must fail it as the eager launcher would instead of doing nothing."""
    torch._check(t.device == ref.device, lambda: f"{op}: `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")
    torch._check(
        t.numel() == ref.numel(), lambda: f"{op}: `{name}` has {t.numel()} elements but `{ref_name}` has {ref.numel()}"
    )


def check_fake_scale(op: str, scale_tensor: Optional[torch.Tensor], ref_name: str, ref: torch.Tensor) -> None:
    if scale_tensor is not None:
        torch._check(
            scale_tensor.device == ref.device,
            lambda: f"{op}: `scale_tensor` is on {scale_tensor.device} but `{ref_name}` is on {ref.device}",
        )


def register_op(name: str, mutates_args: Union[str, Iterable[str]], fake: Callable) -> Callable:
    """Decorator registering ``fn`` as the ``torch.ops`` op ``name`` with the fake impl ``fake``.

    Compiled Triton: ``torch.library.triton_op``, so torch.compile sees the kernel (via ``wrap_triton``)
    and Inductor can schedule it. Under ``TRITON_INTERPRET=1``, ``wrap_triton`` hands back the bare
    interpreted kernel, which torch.compile cannot trace (it would run the interpreter on fake tensors),
    so the op is an opaque ``torch.library.custom_op`` instead: compiled graphs call it with real tensors.
    """

    def decorate(fn: Callable) -> Callable:
        register = torch.library.custom_op if INTERPRETED else torch.library.triton_op
        op = register(name, mutates_args=mutates_args)(fn)
        op.register_fake(fake)
        return op

    return decorate
