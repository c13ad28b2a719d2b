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

``moment_dtype=torch.bfloat16`` stores the momentum buffer in bf16 (2 bytes per element instead of 4): read widened
to fp32, updated in fp32 as above, stored with stochastic rounding whose 16 random bits hash (the group's seed, the
step, the element's canonical index), as AdamW's bf16 moments do, so every stage, world size, bucket size and
offload rounds an element alike (those runs stay bitwise equal to each other; not to torch's fp32 momentum).
"""

from __future__ import annotations

import math
import zlib
from numbers import Real
from typing import Any, Mapping, NamedTuple, Optional

import torch

from ..owner_layout import newton_schulz_cost
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


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (murmur3's finaliser) on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def round_stochastic_(out: torch.Tensor, x: torch.Tensor, seed: int, step: torch.Tensor, first: int) -> None:
    """``out`` (bf16) := ``x`` (fp32, same shape) rounded stochastically: the dropped 16 bits are compared with random
    bits that hash (``seed``, ``step``: a scalar tensor, element ``first + i``'s index), so the result depends on the
    element, not on where it is stored. Plain torch ops on ``x``'s device, no host sync. Non-finite values keep their
    class (inf stays inf, NaN stays NaN)."""
    index = torch.arange(first, first + x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    key = _mix((index & 0xFFFFFFFF) ^ _mix((index >> 32) + (seed & 0xFFFFFFFF)))
    noise = _mix(key ^ (step.to(torch.int64) * 0x9E3779B1 & 0xFFFFFFFF)) & 0xFFFF
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    magnitude = bits & 0x7FFFFFFF
    finite = magnitude < 0x7F800000
    rounded = torch.where(finite, (magnitude + noise) >> 16, (magnitude >> 16) | (magnitude > 0x7F800000) * 0x40)
    half = (((bits >> 16) & 0x8000) | rounded).to(torch.int32).to(torch.int16)
    out.copy_(half.view(torch.bfloat16))


class Muon(WholeParameterRule):
    name = "muon"
    counts_steps = False  # torch.optim.Muon keeps only momentum_buffer per parameter

    def __init__(self, param_dtype: torch.dtype, moment_dtype: torch.dtype = torch.float32, group_index: int = 0):
        super().__init__(param_dtype)
        self.moment_dtype = moment_dtype
        self.kinds = (StateKind(MASTER), StateKind(MOMENTUM, moment_dtype))
        self.rounding_seed = zlib.crc32(f"muon/{group_index}/{param_dtype}".encode())

    def describe(self) -> str:
        return f"{super().describe()}(rounding_seed={self.rounding_seed})"

    def cost(self, shape) -> int:
        """Newton-Schulz's multiply-adds per iteration, about rows x cols x min(rows, cols) (what owners balance)."""
        return newton_schulz_cost(shape)

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
        master, stored = state[MASTER], state[MOMENTUM]
        buf = stored if stored.dtype == torch.float32 else stored.float()
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
        if stored.dtype == torch.float32:
            buf.copy_(new_buf)
        else:
            round_stochastic_(stored, new_buf, self.rounding_seed, step, element_offset)
        master.copy_(new_master)
        if param_out is not None:
            param_out.copy_(master)  # round to nearest even


def _muon(param_dtype: torch.dtype, group: Mapping[str, Any], options: RuleOptions) -> Muon:
    """The registry's factory of "muon": an fp32 master and an fp32 or bf16 momentum buffer. The optimizer-wide
    encodings that are AdamW's alone apply to the AdamW groups and leave a Muon group as it is: ``param_remainders``
    (the Muon group keeps its fp32 master) and int8 moments (its momentum stays fp32: one buffer per matrix, not
    AdamW's two, and Newton-Schulz amplifies a block-quantized momentum's error)."""
    momentum = options.moment_dtype if options.moment_dtype == torch.bfloat16 else torch.float32
    return Muon(param_dtype, momentum, options.group_index)


register("muon", _muon, saved_kinds=(MASTER, MOMENTUM))

__all__ = ["Muon", "MuonScalars", "newton_schulz", "adjusted_lr", "MOMENTUM", "NS_COEFFICIENTS", "ADJUST_LR_FNS"]
