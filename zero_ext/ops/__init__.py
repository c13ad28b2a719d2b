"""Functional kernels: thin documented wrappers over ``torch.ops.zero_ext.*``, with the fake (meta) impls that
torch.compile / FakeTensor trace them with.

Every op works on CPU (SIMD + OpenMP) and, in a CUDA build, on CUDA tensors. Scalars may be Python numbers or
one-element tensors; a tensor on the device is read by the kernel itself (no host sync). The fakes check what the
C++ bindings check about shapes, dtypes and devices (``torch._check``), so a traced call fails where an eager
one would, and a call with one tensor on the ``meta`` device fails instead of silently doing nothing.

AdamW's scalars (:func:`split_scalar`, :func:`check_hyperparameters`, below): the "Python number or one-element
tensor" split, checked where they are set (the update rule, :mod:`zero_ext.update.adamw`, resolves them once per
``step()`` into the kernel's arguments).

Values inside tensors are checked wherever reading them costs no device synchronisation: CPU tensors always, CUDA
tensors at construction only (``read_device_values=True``). Inside ``step()`` a CUDA tensor's value is trusted.
"""

from __future__ import annotations

import math
import os
from numbers import Real
from typing import Any, Optional, Sequence, Union

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.zero_ext.*)

__all__ = ["fused_adamw_", "flatten_", "unflatten_", "sum_squares", "cpu_isa", "built_with_cuda"]

Scalar = Union[float, int, torch.Tensor]


def split_scalar(op: str, name: str, value: Scalar) -> tuple[float, Optional[torch.Tensor]]:
    """``(float(value), None)`` for a Python number, ``(0.0, tensor)`` for a tensor (whose shape, dtype and device
    the op's binding checks)."""
    if isinstance(value, torch.Tensor):
        return 0.0, value
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{op}: `{name}` must be a Python number or a tensor, got {type(value).__name__}")
    return float(value), None


def _readable(value: Scalar, read_device_values: bool) -> Optional[float]:
    """The value of a scalar when reading it costs no (unwanted) device synchronisation, else None."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.device.type == "cpu" or (read_device_values and value.device.type != "meta"):
        return float(value.detach().reshape(()).item())
    return None


def _check(where: str, name: str, value: Any, ok, expected: str, device, read_device_values: bool) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: `{name}` must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")  # fmt: skip
        if not value.is_floating_point():
            raise ValueError(f"{where}: `{name}` tensor must have a floating dtype, got {value.dtype}")
        if device is not None and value.device not in (torch.device("cpu"), device):
            raise ValueError(f"{where}: `{name}` tensor must be on the CPU or on {device}, got {value.device}")
    elif isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{where}: `{name}` must be {expected}, got {value!r}")
    v = _readable(value, read_device_values)
    if v is not None and not ok(v):  # written so that NaN fails
        raise ValueError(f"{where}: `{name}` must be {expected}, got {v!r}")


def check_hyperparameters(
    where: str, lr, betas, eps, weight_decay, *, device: Optional[torch.device] = None, read_device_values=True
) -> None:
    """Raise ``ValueError`` naming ``where`` and the hyperparameter unless every one is valid: lr, eps and
    weight_decay finite and >= 0, 0 <= beta < 1; each a number or a one-element floating tensor."""
    finite_nonneg = lambda v: math.isfinite(v) and v >= 0  # noqa: E731
    _check(where, "lr", lr, finite_nonneg, "a finite number >= 0", device, read_device_values)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: `betas` must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _check(where, f"betas[{i}]", b, lambda v: 0.0 <= v < 1.0, "in [0, 1)", device, read_device_values)
    _check(where, "eps", eps, finite_nonneg, "a finite number >= 0", device, read_device_values)
    _check(where, "weight_decay", weight_decay, finite_nonneg, "a finite number >= 0", device, read_device_values)


_ADAMW_SCALARS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "grad_scale")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MOMENTS = (torch.float32, torch.bfloat16)


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
    max_exp_avg_sq: Optional[torch.Tensor] = None,
    maximize: bool = False,
    remainder: Optional[torch.Tensor] = None,
    rounding_seed: int = 0,
    element_offset: int = 0,
) -> None:
    """One fused AdamW update of a contiguous shard, in place.

    ``master`` is fp32, ``exp_avg`` and ``exp_avg_sq`` are fp32 or bf16 (one dtype), all updated in place;
    ``grad`` is fp32, bf16 or fp16 and is multiplied by ``grad_scale`` first. ``step`` is the step count including
    this update (>= 1). ``param_out`` (bf16/fp16, same numel) receives the new master rounded to nearest even. A
    nonzero ``found_inf`` makes the call a no-op (no byte of any tensor changes). The math and its order are those
    of ``torch.optim.AdamW``, computed in fp32, including its ``amsgrad`` and ``maximize``: ``max_exp_avg_sq``
    (the moments' dtype, same numel) makes the step amsgrad (it is updated to ``maximum(max_exp_avg_sq,
    exp_avg_sq)``, NaN-propagating, and divides instead of ``exp_avg_sq``); ``maximize=True`` negates the gradient.

    bf16 moments (``moment_dtype=torch.bfloat16``): each loads exactly to fp32, the update is the fp32 one, and
    the new moments are stored with stochastic rounding (csrc/stochastic_rounding.h): element ``i`` of the
    call takes the random bits of the hash of (``rounding_seed``, ``step``, ``element_offset + i``), exp_avg the low
    16, exp_avg_sq and max_exp_avg_sq the high 16. ``element_offset`` (>= 0) is the canonical index of the call's
    first element, so an element rounds the same way however the state is sharded. Both are ignored for fp32
    moments.

    ``remainder`` (int16, same numel; ``param_remainders=True``): the fp32 master is kept as ``master``, then the
    bf16 parameter itself, plus this 16-bit remainder and a tie bit kept in the sign bit of ``exp_avg_sq``'s
    storage (``zero_ext.update.master_split``: param = the master rounded to nearest even, master bits = (param bits <<
    16) + remainder + (tie << 16)); read and written back split the same way. The update is bitwise the fp32
    master's and the parameter bitwise its ``param_out``; ``param_out`` must be None. Serialisers read
    ``exp_avg_sq`` through ``master_split.without_tie``.

    Scalars given as numbers or CPU tensors (read on the host, no device sync) are validated: lr, eps and
    weight_decay finite and >= 0, betas in [0, 1), step finite and >= 1, grad_scale finite. Scalars given as
    tensors on master's CUDA device are read by the kernel and not validated (that would synchronise with the
    host): the caller vouches for them, as the engine does. ``found_inf``'s value is never validated: any
    nonzero value, NaN included, skips the update.
    No two of ``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``param_out`` and ``remainder``
    may share a byte. Every check runs before anything is written.
    """
    values = (lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    floats, tensors = zip(*(split_scalar("zero_ext.fused_adamw_", n, v) for n, v in zip(_ADAMW_SCALARS, values)))
    torch.ops.zero_ext.fused_adamw_(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        **dict(zip(_ADAMW_SCALARS, floats)),
        **{f"{n}_tensor": t for n, t in zip(_ADAMW_SCALARS, tensors)},
        param_out=param_out,
        found_inf=found_inf,
        max_exp_avg_sq=max_exp_avg_sq,
        maximize=bool(maximize),
        remainder=remainder,
        rounding_seed=int(rounding_seed),
        element_offset=int(element_offset),
    )


def flatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """``flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i] * scale`` for every i, cast to
    ``flat.dtype`` (round to nearest even). One kernel launch on CUDA however many tensors.

    The destination ranges in ``flat`` may not share a byte with each other or with any of ``tensors``
    (which may overlap each other, and ``flat`` outside the destinations)."""
    torch.ops.zero_ext.flatten_(flat, list(tensors), [int(o) for o in offsets], float(scale))


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0) -> None:
    """``tensors[i][...] = flat[offsets[i] : offsets[i] + tensors[i].numel()] * scale`` for every i, cast to
    each tensor's dtype (round to nearest even). The inverse of :func:`flatten_`.

    The source ranges may overlap; the outputs may not share a byte with each other or with ``flat``."""
    torch.ops.zero_ext.unflatten_(flat, list(tensors), [int(o) for o in offsets], float(scale))


def sum_squares(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(x**2), nonfinite)`` as fp32 0-d tensors on ``x``'s device: the sum accumulated in fp32
    (deterministically), ``nonfinite`` 1.0 if any element of ``x`` is inf or nan, else 0.0."""
    return torch.ops.zero_ext.sum_squares(x)


def cpu_isa(isa: str = "") -> str:
    """Query (``""``) or force (``"scalar"``, ``"avx2"``, ``"avx512"``, ``"auto"``) the CPU kernels' SIMD
    path; returns the path in use. A path this CPU lacks falls back to the best one it has."""
    return torch.ops.zero_ext._cpu_isa(isa)


# ZERO_EXT_CPU_ISA=scalar|avx2|avx512 forces the path in every process that imports zero_ext (spawned ranks
# included), as ATEN_CPU_CAPABILITY does for torch's kernels: one machine runs the suite as another CPU would.
if os.environ.get("ZERO_EXT_CPU_ISA"):
    cpu_isa(os.environ["ZERO_EXT_CPU_ISA"])


def built_with_cuda() -> bool:
    """Whether this build of zero_ext has the CUDA kernels (setup.py builds them when torch has CUDA and
    ``CUDA_HOME`` is set, unless ``ZERO_EXT_FORCE_CPU=1``). Without them the ops reject CUDA tensors."""
    return torch.ops.zero_ext._built_with_cuda()


# ------------------------------------------------------------------------------------------ fakes
# A call whose tensors are all on one real device reaches its C++ kernel; one with a tensor on `meta` (or all
# fake, as under torch.compile) reaches these, so each check here names the offending argument and the one it
# is compared with: a mixed call fails as clearly as an eager one would.
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_dense(op: str, name: str, t: torch.Tensor, like_name: str, like: torch.Tensor, dtypes) -> None:
    torch._check(t.dtype in dtypes, lambda: f"zero_ext.{op}: `{name}` must have a dtype in {dtypes}, got {t.dtype}")
    torch._check(
        t.device == like.device,
        lambda: f"zero_ext.{op}: `{name}` is on {t.device} but `{like_name}` is on {like.device}",
    )
    torch._check(t.is_contiguous(), lambda: f"zero_ext.{op}: `{name}` must be contiguous")


def _check_scalar_tensor(name: str, t: Optional[torch.Tensor], master: torch.Tensor) -> None:
    if t is None:
        return
    torch._check(t.numel() == 1, lambda: f"zero_ext.fused_adamw_: `{name}` must have one element, got {t.shape}")
    torch._check(
        t.dtype.is_floating_point or t.dtype in _INTEGERS,
        lambda: f"zero_ext.fused_adamw_: `{name}` must be a floating or integer tensor, got {t.dtype}",
    )
    where = "the CPU" if master.device.type == "cpu" else f"the CPU or on {master.device}"
    torch._check(
        t.device == master.device or t.device.type == "cpu",
        lambda: f"zero_ext.fused_adamw_: `{name}` must be on {where} (like `master`), got {t.device}",
    )


@torch.library.register_fake("zero_ext::fused_adamw_")
def _fused_adamw_fake(master, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
    remainder = kwargs.get("remainder")
    _check_dense("fused_adamw_", "master", master, "master", master,
                 (torch.bfloat16,) if remainder is not None else (torch.float32,))  # fmt: skip
    if remainder is not None:
        _check_dense("fused_adamw_", "remainder", remainder, "master", master, (torch.int16,))
        torch._check(
            remainder.numel() == master.numel(), lambda: "zero_ext.fused_adamw_: `remainder` numel != master's"
        )
        torch._check(
            kwargs.get("param_out") is None, lambda: "zero_ext.fused_adamw_: `param_out` must be None with `remainder`"
        )
    _check_dense("fused_adamw_", "grad", grad, "master", master, _FLOATS)
    torch._check(grad.numel() == master.numel(), lambda: "zero_ext.fused_adamw_: `grad` numel != master's")
    _check_dense("fused_adamw_", "exp_avg", exp_avg, "master", master, _MOMENTS)
    torch._check(exp_avg.numel() == master.numel(), lambda: "zero_ext.fused_adamw_: `exp_avg` numel != master's")
    moments = (("exp_avg_sq", exp_avg_sq), ("max_exp_avg_sq", kwargs.get("max_exp_avg_sq")))
    for name, t in moments:
        if t is not None:
            _check_dense("fused_adamw_", name, t, "master", master, (exp_avg.dtype,))
            torch._check(t.numel() == master.numel(), lambda: f"zero_ext.fused_adamw_: `{name}` numel != master's")
    param_out = kwargs.get("param_out")
    if param_out is not None:
        _check_dense("fused_adamw_", "param_out", param_out, "master", master, (torch.bfloat16, torch.float16))
        torch._check(
            param_out.numel() == master.numel(), lambda: "zero_ext.fused_adamw_: `param_out` numel != master's"
        )
    element_offset = kwargs.get("element_offset", 0)
    torch._check(
        element_offset >= 0, lambda: f"zero_ext.fused_adamw_: `element_offset` must be >= 0, got {element_offset}"
    )
    _check_scalar_tensor("found_inf", kwargs.get("found_inf"), master)
    for name in _ADAMW_SCALARS:
        _check_scalar_tensor(name, kwargs.get(f"{name}_tensor"), master)


def _flatten_fake_checks(op: str, flat, tensors, offsets) -> None:
    _check_dense(op, "flat", flat, "flat", flat, _FLOATS)
    torch._check(len(offsets) == len(tensors), lambda: f"zero_ext.{op}: `offsets` and `tensors` differ in length")
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        _check_dense(op, f"tensors[{i}]", t, "flat", flat, _FLOATS)
        torch._check(
            0 <= off and off + t.numel() <= flat.numel(), lambda: f"zero_ext.{op}: `tensors[{i}]` does not fit in flat"
        )


@torch.library.register_fake("zero_ext::flatten_")
def _flatten_fake(flat, tensors, offsets, scale=1.0) -> None:
    _flatten_fake_checks("flatten_", flat, tensors, offsets)


@torch.library.register_fake("zero_ext::unflatten_")
def _unflatten_fake(flat, tensors, offsets, scale=1.0) -> None:
    _flatten_fake_checks("unflatten_", flat, tensors, offsets)


@torch.library.register_fake("zero_ext::sum_squares")
def _sum_squares_fake(x):
    _check_dense("sum_squares", "x", x, "x", x, _FLOATS)
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)
