"""AdamW, the update rule registered as ``"adamw"``: what optimizer state its flat groups keep and how one step
changes it.

Everything else in the engine is generic over the rule (:class:`.protocol.UpdateRule`). Placements (device, host,
disk) allocate one buffer per :class:`StateKind` of :attr:`UpdateRule.kinds`; the state dict, checkpoint sections,
consolidation, the memory ledger and the offload files are named and sized from the same kinds; the step calls
:meth:`UpdateRule.apply` on views of them. A new rule, or a new kind stored as it is (its dtype, one item per
element), is a change in the rule alone (a subclass of :class:`.protocol.ElementwiseRule`, registered in
:mod:`.registry`). A new *encoding* of a kind (the remainder that stands for the master, 8-bit moments with block
scales) is a change here, in the kernel that applies it and in the placements that convert it on read and write
(placement/device.py; placement/disk.py keeps what is not one item per element out of its files), which know the
encodings by the rule's members ``param_remainders``, ``tie_kind``, ``quantized`` and ``blocks``.
:func:`zero_ext.memory.estimate` is AdamW's formula by contract (ZeRO's mixed-precision Adam) and builds this rule.

:class:`AdamW` is ``torch.optim.AdamW``'s update, bitwise, with its ``amsgrad`` (a fourth kind, ``max_exp_avg_sq``)
and ``maximize``. Its kinds are fp32 and live beside the fp32 master; the "master" is the first kind.

With ``param_remainders`` (bf16 parameters only) the master is not stored as fp32: the kind ``remainder`` (int16)
replaces it, and the master is the bf16 parameter (rounded to nearest even) joined with it and a tie bit kept in
the sign bit of ``exp_avg_sq`` (:attr:`AdamW.tie_kind`; :mod:`.master_split`; the kernel reads and writes all
three). :attr:`AdamW.kinds` are what a placement stores; :attr:`AdamW.saved_kinds` what state dicts,
checkpoints and consolidation hold (the fp32 master first, whatever is stored), so a state saved with either
setting loads into the other: the placements convert on read and write.

``moment_dtype=torch.bfloat16`` stores the moment kinds (exp_avg, exp_avg_sq, max_exp_avg_sq) in bf16, 2 bytes each
instead of 4: the kernel loads them exactly to fp32, updates them with the same fp32 arithmetic and stores them with
stochastic rounding, its random bits a hash of (:attr:`AdamW.rounding_seed`, the step, the element's *canonical*
index: ``element_offset`` of :meth:`AdamW.apply`, :meth:`.layout.Layout.canonical_start`), so an element rounds the
same way at every world size, stage and bucket size. :attr:`AdamW.saved_kinds` stay fp32: bf16 -> fp32 is exact on
save, fp32 -> bf16 rounds to nearest even on load (deterministic), so either setting loads into the other.

``moment_dtype=torch.int8`` stores each moment as int8 codes (kind ``exp_avg`` etc., one per element) and fp32 block
scales (kind ``exp_avg_scale`` etc., :attr:`StateKind.block` = 64: one item per 64 elements): the maps of
:mod:`.blockwise_int8`, the fused kernel of :mod:`.ops_int8`. A flat group with int8 moments places every parameter
at a multiple of 64 elements (:attr:`AdamW.param_align`, ``layout.Layout(param_align=)``), so a block is 64 elements
of one parameter (its last block padded with zeros) in every layout: the quantization, like bf16's rounding, is the
same at every world size, stage, bucket size and offload. The step widens every run to whole blocks
(``step.Stepper._update``: the elements added are padding). :attr:`AdamW.saved_kinds` stay fp32: placements
dequantize on read and requantize the blocks a write touches. amsgrad's ``max_exp_avg_sq`` is int8 too; the tie
bit of ``param_remainders`` is bit 7 of exp_avg_sq's codes (its map has 128 values).

Two questions about the master have two names on purpose. :attr:`UpdateRule.master_is_param`: the parameters' own
values are the master (fp32 parameters), so a state dict holds no separate copy and the model's state dict carries
it. A placement's ``master_copy``: that placement stores a separate fp32 master buffer (bf16/fp16 parameters
everywhere; fp32 ones too when the state is offloaded, because the parameters stay on the device).
"""

from __future__ import annotations

import zlib
from fractions import Fraction
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

from .. import ops
from ..layout import PARAM_ALIGN
from ..ops import Scalar, check_hyperparameters
from ..ops import int8 as ops_int8
from . import blockwise_int8
from .protocol import MASTER, ElementwiseRule, StateKind, UpdateRule
from .registry import RuleOptions, all_kind_names, register, rule_for_group, rule_for_saved_group

REMAINDER = "remainder"  # param_remainders: the master's low 16 bits, stored instead of the fp32 master
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # what ZeroAdamW(moment_dtype=...) accepts
SCALE = "_scale"  # int8 moments: the suffix of a moment's per-block scales kind ("exp_avg" -> "exp_avg_scale")


class AdamWScalars(NamedTuple):
    """One param group's scalars as the kernel takes them (numbers or tensors)."""

    lr: Scalar
    beta1: Scalar
    beta2: Scalar
    eps: Scalar
    weight_decay: Scalar
    maximize: bool


# torch.optim.AdamW's keywords that pick an implementation, not a result: accepted (so that
# `ZeroAdamW(**adamw_kwargs)` works) and kept in every param group as torch keeps them; the update is always one
# fused kernel. `differentiable=True` would promise gradients through the step, which a fused in-place kernel over
# sharded state cannot give: refused.
IMPLEMENTATION_KEYWORDS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}


def check_flag(where: str, name: str, value: Any, allow_none: bool = False) -> None:
    if isinstance(value, bool) or (allow_none and value is None):
        return
    expected = "True, False or None" if allow_none else "True or False"
    raise ValueError(f"{where}: `{name}` must be {expected}, got {value!r}")


def check_implementation_keywords(where: str, group: Mapping[str, Any]) -> None:
    for name, default in IMPLEMENTATION_KEYWORDS.items():
        check_flag(where, name, group.get(name, default), allow_none=default is None)
    if group.get("differentiable", False):
        raise ValueError(
            f"{where}: `differentiable` must be False: the step is one fused in-place kernel over sharded state, not "
            "an autograd graph (use torch.optim.AdamW for a differentiable optimizer step)"
        )


def check_decoupled_weight_decay(where: str, group: Mapping[str, Any]) -> None:
    """torch.optim.AdamW's groups say ``decoupled_weight_decay=True`` (torch.optim.Adam's may say False: L2 decay added
    to the gradient, a different update). This rule is AdamW's: False is refused, not silently decoupled."""
    value = group.get("decoupled_weight_decay", True)
    check_flag(where, "decoupled_weight_decay", value)
    if not value:
        raise ValueError(
            f"{where}: `decoupled_weight_decay` must be True: ZeroAdamW is AdamW (decay applied to the weights, "
            "p *= 1 - lr * weight_decay); Adam's coupled L2 decay (decoupled_weight_decay=False) is not implemented. "
            "Use weight_decay=0 and add the L2 term to the loss for Adam's semantics"
        )


class AdamW(ElementwiseRule):
    """``torch.optim.AdamW``'s update on a flat group's shard (see the module docstring).

    ``amsgrad`` is structural (it adds a kind): fixed when the optimizer is built, per param group.
    ``maximize`` is a scalar of the step, read from the param group at every step, as torch reads it.
    """

    name = "adamw"

    def __init__(self, param_dtype: torch.dtype, amsgrad: bool = False, param_remainders: bool = False,
                 moment_dtype: torch.dtype = torch.float32, group_index: int = 0):  # fmt: skip
        super().__init__(param_dtype)
        self.amsgrad = bool(amsgrad)
        self.param_remainders = bool(param_remainders)
        check_moment_dtype("zero_ext.ZeroAdamW", moment_dtype)
        self.moment_dtype = moment_dtype
        # The stochastic rounding's seed: a fixed function of the flat group's identity (its param group and dtype),
        # never of the world size, stage or rank, so that every setting rounds every element alike.
        self.rounding_seed = zlib.crc32(f"{group_index}/{param_dtype}".encode())
        if self.param_remainders and param_dtype != torch.bfloat16:
            raise ValueError(
                f"`param_remainders=True` keeps the fp32 master as the bfloat16 parameter plus a 16-bit remainder: "
                f"it needs bfloat16 parameters, got {param_dtype}"
            )
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        self.saved_kinds: tuple[StateKind, ...] = (StateKind(MASTER), *(StateKind(m) for m in names))
        stored = StateKind(REMAINDER, torch.int16) if self.param_remainders else StateKind(MASTER)
        self.kinds: tuple[StateKind, ...] = (stored, *(StateKind(m, moment_dtype) for m in names))
        # int8 moments: each moment's codes (one int8 per element) and its per-block fp32 scales, a kind of its own
        # (one item per BLOCK elements); a block is 64 consecutive elements of a parameter, the same in every layout
        # (param_align below), so the quantization, like bf16's rounding, is the same at every world size and stage.
        self.block = blockwise_int8.BLOCK if moment_dtype is torch.int8 else 1
        self.quantized: dict[str, tuple[str, torch.Tensor]] = {}  # moment -> (its scales kind, its map)
        if self.block > 1:
            for m in names:
                qmap = blockwise_int8.EXP_AVG_MAP if m == "exp_avg" else blockwise_int8.EXP_AVG_SQ_MAP
                self.quantized[m] = (m + SCALE, qmap)
            self.kinds += tuple(StateKind(m + SCALE, torch.float32, self.block) for m in names)
        # The kinds stored one item per block of elements (int8 moments' scales), with their block: every view of a
        # unit of the step looks them up (placement.items_of), so they are listed once here.
        self.blocks: dict[str, int] = {k.name: k.block for k in self.kinds if k.block > 1}
        # Every parameter starts at a multiple of this many elements of its flat buffer (layout.Layout): a block of
        # int8 moments never holds elements of two parameters.
        self.param_align = max(PARAM_ALIGN, self.block)
        # param_remainders: the kind whose sign bit keeps the master's tie bit (exp_avg_sq is >= +0 or NaN, so the
        # bit is free; the kernel reads |v| and writes it back). Placements hide it from serialisers.
        self.tie_kind: Optional[str] = "exp_avg_sq" if self.param_remainders else None

    # ---------------------------------------------------------------- what it keeps (the rest: ElementwiseRule)
    def describe(self) -> str:
        """What every rank must agree on (part of the layout fingerprint)."""
        return (
            f"{self.name}(amsgrad={self.amsgrad}, param_remainders={self.param_remainders}, "
            f"moment_dtype={self.moment_dtype}, rounding_seed={self.rounding_seed})"
        )

    @property
    def rounds_moments(self) -> bool:
        """The moments are stored in bf16 (stochastic rounding: the kernel needs the element offset)."""
        return self.moment_dtype is torch.bfloat16

    # ---------------------------------------------------------------- its scalars
    def check_group(self, where: str, group: Mapping[str, Any], device: Optional[torch.device] = None,
                    read_device_values: bool = True) -> None:  # fmt: skip
        """Raise ``ValueError`` naming ``where`` unless the param group's hyperparameters are valid for this rule."""
        check_hyperparameters(where, group["lr"], group["betas"], group["eps"], group["weight_decay"],
                              device=device, read_device_values=read_device_values)  # fmt: skip
        check_flag(where, "maximize", group.get("maximize", False))
        amsgrad = group.get("amsgrad", False)
        check_flag(where, "amsgrad", amsgrad)
        if amsgrad != self.amsgrad:
            raise ValueError(
                f"{where}: `amsgrad` is {amsgrad} but the optimizer was built with amsgrad={self.amsgrad} for this "
                "group; it decides which state is kept (max_exp_avg_sq), so it is fixed at construction: build a new "
                "optimizer to change it"
            )
        check_implementation_keywords(where, group)
        check_decoupled_weight_decay(where, group)

    def scalars(self, group: Mapping[str, Any]) -> AdamWScalars:
        beta1, beta2 = group["betas"]
        return AdamWScalars(
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group.get("maximize", False)
        )

    # ---------------------------------------------------------------- the update
    def apply(self, state: Mapping[str, torch.Tensor], grad: torch.Tensor, param_out: Optional[torch.Tensor],
              s: AdamWScalars, step, grad_scale, found_inf: Optional[torch.Tensor],
              element_offset: int = 0) -> None:  # fmt: skip
        """One fused update of a contiguous run: ``state`` maps each kind to its view of the run. With
        ``param_remainders`` ``param_out`` is the bf16 parameter, the master's high half, read and written.
        ``element_offset``: the canonical index of the run's first element (bf16 moments' rounding; ignored
        otherwise)."""
        if self.param_remainders:
            master, param_out, remainder = param_out, None, state[REMAINDER]
        else:
            master, remainder = state[MASTER], None
        if self.block > 1:  # int8 moments: the run is whole blocks (step.py widens it), the scales its blocks'
            amsgrad = {"max_exp_avg_sq_codes": state["max_exp_avg_sq"],
                       "max_exp_avg_sq_scales": state["max_exp_avg_sq" + SCALE]} if self.amsgrad else {}  # fmt: skip
            ops_int8.fused_adamw_int8_(
                master, grad, state["exp_avg"], state["exp_avg" + SCALE], state["exp_avg_sq"],
                state["exp_avg_sq" + SCALE], lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps,
                weight_decay=s.weight_decay, step=step, grad_scale=grad_scale, block=self.block, param_out=param_out,
                found_inf=found_inf, maximize=bool(s.maximize), remainder=remainder, **amsgrad,
            )  # fmt: skip
            return
        ops.fused_adamw_(
            master, grad, state["exp_avg"], state["exp_avg_sq"],
            lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps, weight_decay=s.weight_decay, step=step,
            grad_scale=grad_scale, param_out=param_out, found_inf=found_inf,
            max_exp_avg_sq=state.get("max_exp_avg_sq"), maximize=bool(s.maximize), remainder=remainder,
            **self._rounding(element_offset),
        )  # fmt: skip

    def _rounding(self, element_offset: int) -> dict[str, int]:
        """The kernel's stochastic-rounding arguments, given only where the moments are rounded (an fp32 rule calls
        the kernel exactly as before they existed)."""
        if not self.rounds_moments:
            return {}
        return {"rounding_seed": self.rounding_seed, "element_offset": int(element_offset)}


def check_moment_dtype(where: str, moment_dtype: Any) -> None:
    """A ValueError naming ``moment_dtype`` unless it is one this version stores."""
    if any(moment_dtype is d for d in MOMENT_DTYPES):
        return
    raise ValueError(
        f"{where}: `moment_dtype` must be torch.float32, torch.bfloat16 or torch.int8, got {moment_dtype!r}"
    )


def _adamw(param_dtype: torch.dtype, group: Mapping[str, Any], options: RuleOptions) -> AdamW:
    """The registry's factory of "adamw": ``amsgrad`` from the param group (or a checkpoint's hyperparameters:
    older ones have none, plain AdamW), the precision options from the optimizer."""
    return AdamW(param_dtype, amsgrad=bool(group.get("amsgrad", False)), param_remainders=options.param_remainders,
                 moment_dtype=options.moment_dtype, group_index=options.group_index)  # fmt: skip


register("adamw", _adamw, saved_kinds=(MASTER, "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def default_bytes_per_element(param_remainders: bool = False, moment_dtype: torch.dtype = torch.float32) -> Fraction:
    """Mixed-precision AdamW's state per parameter: fp32 master + two fp32 moments (ZeRO's K = 12); with
    ``param_remainders`` an int16 remainder instead of the master (K = 10); with bf16 moments 4 bytes less, with int8
    ones 5.875 less (a byte and 4/64 of a scale each)."""
    return AdamW(torch.bfloat16, param_remainders=param_remainders, moment_dtype=moment_dtype).bytes_per_element()


__all__: Sequence[str] = [
    "MASTER", "REMAINDER", "StateKind", "AdamWScalars", "AdamW", "UpdateRule", "rule_for_group", "rule_for_saved_group",
    "all_kind_names", "default_bytes_per_element", "IMPLEMENTATION_KEYWORDS", "MOMENT_DTYPES", "check_moment_dtype",
    "SCALE",
]  # fmt: skip
