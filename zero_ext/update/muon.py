"""Muon, as ``torch.optim.Muon`` computes it, as an update rule of whole parameters (registered as ``"muon"``).

Each 2-D parameter keeps an fp32 master and an fp32 ``momentum_buffer`` (torch's state name). One update, on the
parameter's owner rank (:mod:`zero_ext.owner_layout`), from the ranks' mean gradient ``g`` (times the clip
coefficient), in torch's operations and order, so that the bits are torch's:

    buf.lerp_(g, 1 - momentum)
    update = g.lerp(buf, momentum) if nesterov else buf
    update = newton_schulz(update)               # bf16, as torch
    master.mul_(1 - lr * weight_decay)
    master.add_(update, alpha=-adjusted_lr)       # adjusted_lr: torch's adjust_lr_fn of the shape

then the parameter is the master rounded to its dtype (nearest even). A step with a non-finite gradient anywhere
changes nothing (the engine's found_inf, as for AdamW).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Mapping, NamedTuple, Optional

import torch

from .protocol import MASTER, StateKind, WholeParameterRule
from .registry import RuleOptions, register

MOMENTUM = "momentum_buffer"
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)


class MuonScalars(NamedTuple):
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: Optional[str]


def newton_schulz(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """The orthogonalisation torch.optim.Muon applies (``_zeropower_via_newtonschulz``), in its operations and order:
    bf16, the wide side first, normalised by the Frobenius norm, ``steps`` quintic iterations."""
    a, b, c = coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape) -> float:
    """torch.optim.Muon's learning rate for a ``shape`` matrix: "original" (and None) sqrt(max(1, rows / cols)),
    "match_rms_adamw" 0.2 sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _number(where: str, key: str, value: Any, low: float = 0.0) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real) or not value >= low:
        raise ValueError(f"{where}: `{key}` must be a number >= {low:g}, got {value!r}")


class Muon(WholeParameterRule):
    name = "muon"
    counts_steps = False  # torch.optim.Muon keeps only momentum_buffer per parameter

    def __init__(self, param_dtype: torch.dtype):
        super().__init__(param_dtype)
        self.kinds = (StateKind(MASTER), StateKind(MOMENTUM))

    def cost(self, shape) -> int:
        """Newton-Schulz's multiply-adds per iteration, about rows x cols x min(rows, cols) (what owners balance)."""
        rows, cols = (int(d) for d in shape) if len(shape) == 2 else (max(1, math.prod(shape)), 1)
        return max(1, rows * cols * min(rows, cols))

    def check_shape(self, where: str, name: str, shape) -> None:
        if len(shape) != 2:
            raise ValueError(
                f"{where}: parameter {name!r} has shape {tuple(shape)}; Muon updates 2-D matrices only (as "
                "torch.optim.Muon). Put embeddings' biases, norms and other non-2-D parameters in a param group with "
                "'use_muon': False (updated by AdamW)"
            )

    def check_group(self, where: str, group: Mapping[str, Any], device: Optional[torch.device] = None,
                    read_device_values: bool = True) -> None:  # fmt: skip
        for key in ("lr", "weight_decay", "momentum"):
            _number(where, key, group.get(key))
        _number(where, "eps", group.get("eps"))
        if not isinstance(group.get("nesterov"), bool):
            raise ValueError(f"{where}: `nesterov` must be True or False, got {group.get('nesterov')!r}")
        steps = group.get("ns_steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"{where}: `ns_steps` must be an integer in [0, 100), got {steps!r}")
        coefficients = group.get("ns_coefficients")
        if (
            not isinstance(coefficients, (tuple, list))
            or len(coefficients) != 3
            or not all(isinstance(c, Real) and not isinstance(c, bool) for c in coefficients)
        ):
            raise ValueError(f"{where}: `ns_coefficients` must be three numbers (a, b, c), got {coefficients!r}")
        if group.get("adjust_lr_fn") not in ADJUST_LR_FNS:
            raise ValueError(
                f"{where}: `adjust_lr_fn` must be None, 'original' or 'match_rms_adamw', got "
                f"{group.get('adjust_lr_fn')!r}"
            )

    def scalars(self, group: Mapping[str, Any]) -> MuonScalars:
        def num(v):
            return v.item() if isinstance(v, torch.Tensor) else v

        return MuonScalars(
            num(group["lr"]), num(group["weight_decay"]), num(group["momentum"]), group["nesterov"],
            tuple(group["ns_coefficients"]), num(group["eps"]), group["ns_steps"], group["adjust_lr_fn"],
        )  # fmt: skip

    def apply_parameter(self, state, grad, param_out, s: MuonScalars, step, grad_scale, found_inf,
                        element_offset: int = 0) -> None:  # fmt: skip
        master, buf = state[MASTER], state[MOMENTUM]
        g = grad if isinstance(grad_scale, (int, float)) and grad_scale == 1 else torch.mul(grad, grad_scale)
        # On the host a skipped step never gets here (step.py); on a device, found_inf is read without a sync.
        guarded = found_inf is not None and found_inf.device.type != "cpu"
        new_buf = torch.lerp(buf, g, 1 - s.momentum)
        update = torch.lerp(g, new_buf, s.momentum) if s.nesterov else new_buf
        update = newton_schulz(update, s.ns_coefficients, s.ns_steps, s.eps)
        lr = adjusted_lr(s.lr, s.adjust_lr_fn, master.shape)
        new_master = torch.mul(master, 1 - s.lr * s.weight_decay)
        new_master = torch.add(new_master, update, alpha=-lr)
        if guarded:
            skip = found_inf > 0
            new_buf, new_master = torch.where(skip, buf, new_buf), torch.where(skip, master, new_master)
        buf.copy_(new_buf)
        master.copy_(new_master)
        if param_out is not None:
            param_out.copy_(master)  # round to nearest even


def _muon(param_dtype: torch.dtype, group: Mapping[str, Any], options: RuleOptions) -> Muon:
    """The registry's factory of "muon": an fp32 master and an fp32 momentum buffer."""
    if options.param_remainders:
        raise ValueError("the Muon rule keeps an fp32 master: `param_remainders=True` is for AdamW groups only")
    if options.moment_dtype is not torch.float32:
        raise ValueError(
            f"the Muon rule keeps an fp32 momentum buffer: `moment_dtype={options.moment_dtype}` is for AdamW groups"
        )
    return Muon(param_dtype)


register("muon", _muon, saved_kinds=(MASTER, MOMENTUM))

__all__ = ["Muon", "MuonScalars", "newton_schulz", "adjusted_lr", "MOMENTUM", "NS_COEFFICIENTS", "ADJUST_LR_FNS"]
