"""Functional kernels: thin documented wrappers over ``torch.ops.zero_ext.*`` with their fake impls.

Every op works on CPU (SIMD + OpenMP) and, in a CUDA build, on CUDA tensors. Scalars may be Python
numbers or one-element tensors; a tensor on the device is read by the kernel itself (no host sync).
"""

from __future__ import annotations

from numbers import Real
from typing import Optional, Sequence, Union

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.zero_ext.*)

Scalar = Union[float, int, torch.Tensor]

__all__ = ["fused_adamw_", "flatten_", "unflatten_", "sum_squares", "cpu_isa"]


def _split_scalar(name: str, value: Scalar) -> tuple[float, Optional[torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return 0.0, value
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"zero_ext.fused_adamw_: `{name}` must be a Python number or a tensor, got {type(value).__name__}"
        )
    return float(value), None


def fused_adamw_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    step: Scalar,
    grad_scale: Scalar = 1.0,
    param_out: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One fused AdamW update of a contiguous shard, in place.

    ``master``, ``exp_avg`` and ``exp_avg_sq`` are fp32 and updated in place; ``grad`` is fp32, bf16
    or fp16 and is multiplied by ``grad_scale`` first. ``step`` is the step count including this
    update (>= 1). ``param_out`` (bf16/fp16, same numel) receives the new master rounded to nearest
    even. A nonzero ``found_inf`` makes the call a no-op. The math and its order are those of
    ``torch.optim.AdamW``, computed in fp32.
    """
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "grad_scale")
    values = (lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    floats, tensors = zip(*(_split_scalar(n, v) for n, v in zip(names, values)))
    torch.ops.zero_ext.fused_adamw_(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        **dict(zip(names, floats)),
        **{f"{n}_tensor": t for n, t in zip(names, tensors)},
        param_out=param_out,
        found_inf=found_inf,
    )


def flatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """``flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i] * scale`` for every i, cast to
    ``flat.dtype`` (round to nearest even). One kernel launch on CUDA however many tensors."""
    torch.ops.zero_ext.flatten_(flat, list(tensors), [int(o) for o in offsets], float(scale))


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """``tensors[i][...] = flat[offsets[i] : offsets[i] + tensors[i].numel()] * scale`` for every i, cast to
    each tensor's dtype (round to nearest even). The inverse of :func:`flatten_`."""
    torch.ops.zero_ext.unflatten_(flat, list(tensors), [int(o) for o in offsets], float(scale))


def sum_squares(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(x**2), nonfinite)`` as fp32 0-d tensors on ``x``'s device: the sum accumulated in fp32
    (deterministically), ``nonfinite`` 1.0 if any element of ``x`` is inf or nan, else 0.0."""
    return torch.ops.zero_ext.sum_squares(x)


def cpu_isa(isa: str = "") -> str:
    """Query (``""``) or force (``"scalar"``, ``"avx2"``, ``"avx512"``, ``"auto"``) the CPU kernels' SIMD
    path; returns the path in use. A path this CPU lacks falls back to the best one it has."""
    return torch.ops.zero_ext._cpu_isa(isa)


# Fake (meta) impls so torch.compile / FakeTensor can trace code that calls the ops.
@torch.library.register_fake("zero_ext::fused_adamw_")
def _fused_adamw_fake(master, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
    return None


@torch.library.register_fake("zero_ext::flatten_")
def _flatten_fake(flat, tensors, offsets, scale=1.0) -> None:
    return None


@torch.library.register_fake("zero_ext::unflatten_")
def _unflatten_fake(flat, tensors, offsets, scale=1.0) -> None:
    return None


@torch.library.register_fake("zero_ext::sum_squares")
def _sum_squares_fake(x):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)
