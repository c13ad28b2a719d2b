"""AdamW's scalars: the "Python number or one-element tensor" split, checked where they are set (the update rule,
:mod:`zero_ext.update.adamw`, resolves them once per ``step()`` into the kernel's arguments).

Values inside tensors are checked wherever reading them costs no device synchronisation: CPU tensors always, CUDA
tensors at construction only (``read_device_values=True``). Inside ``step()`` a CUDA tensor's value is trusted.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Optional, Union

import torch

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
