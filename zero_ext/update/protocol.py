"""What the engine asks of an update rule: :class:`UpdateRule`, a protocol, and :class:`ElementwiseRule`, a base
that answers every question but the rule's own with the plain answer.

A rule says what state a flat group keeps, as :class:`StateKind` s (a placement allocates one buffer per kind;
state dicts, checkpoint sections, consolidation, the memory ledger and the offload files are named and sized from
them), which param-group hyperparameters it reads (:meth:`UpdateRule.check_group`, :meth:`UpdateRule.scalars`), how
it updates a contiguous run of a rank's shard (:meth:`UpdateRule.apply`) and what *unit* it needs: ``"elements"``
(any run of a flat shard: an elementwise rule such as AdamW or SGD) or ``"parameters"`` (whole parameters on one
rank: Muon's orthogonalisation). A rule of whole parameters (:class:`WholeParameterRule`) gets an owner layout
(:mod:`zero_ext.owner_layout`: every parameter whole in one rank's shard) and is handed one parameter at a time,
shaped, through :meth:`WholeParameterRule.apply_parameter`, with ``cost`` telling the layout what to balance.

The members past ``apply`` describe how a kind is *encoded* (an int16 remainder standing for the master, int8 codes
with block scales, a tie bit in a sign bit); a rule that stores every kind as it is (``StateKind.dtype``, one item
per element; bf16 kinds are widened and rounded by the placements) keeps :class:`ElementwiseRule`'s defaults.

Rules are found by name in :mod:`.registry`.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal, Mapping, Optional, Protocol, runtime_checkable

import torch

from ..layout import PARAM_ALIGN

MASTER = "master"  # the fp32 master copy of the parameters, the one kind every rule saves
ELEMENTS = "elements"  # a rule's unit: any contiguous run of a flat shard
PARAMETERS = "parameters"  # a rule's unit: whole parameters, each on one owner rank
Unit = Literal["elements", "parameters"]


@dataclass(frozen=True)
class StateKind:
    """One kind of per-element state: its name (state dicts, checkpoint sections, files and the memory ledger
    use it as is) and its dtype."""

    name: str
    dtype: torch.dtype = torch.float32
    block: int = 1  # shard elements per stored item: 1, or an int8 moment's block (one scale per block)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def items(self, numel: int) -> int:
        """Items stored for ``numel`` shard elements (a shard is a whole number of blocks)."""
        return -(-numel // self.block)

    def nbytes(self, numel: int) -> int:
        return self.items(numel) * self.itemsize


@runtime_checkable
class UpdateRule(Protocol):
    """The interface the engine codes against (:class:`ElementwiseRule` implements all but the rule's own part)."""

    name: str  # its registry name (:mod:`.registry`), recorded per param group in checkpoints
    unit: Unit  # "elements" or "parameters" (see the module docstring)
    param_dtype: torch.dtype  # the flat group's parameter dtype
    kinds: tuple[StateKind, ...]  # what a placement stores, the master (or what stands for it) first
    saved_kinds: tuple[StateKind, ...]  # what state dicts, checkpoints and consolidation hold: fp32 master first
    blocks: Mapping[str, int]  # the kinds stored one item per block of elements, with their block
    block: int  # every run the step hands to apply is widened to whole blocks of this many elements
    param_align: int  # every parameter starts at a multiple of this many elements of its flat buffer
    # encodings (ElementwiseRule: none)
    param_remainders: bool  # the master is the bf16 parameter + the int16 kind "remainder" + a tie bit
    tie_kind: Optional[str]  # the kind whose sign bit keeps that tie bit
    quantized: Mapping[str, tuple[str, torch.Tensor]]  # int8 kind -> (its block scales' kind, its code map)

    @property
    def master_is_param(self) -> bool:
        """The parameters' values are the master (fp32 parameters): a state dict holds no separate master."""

    @property
    def kind_names(self) -> tuple[str, ...]: ...

    @property
    def saved_kind_names(self) -> tuple[str, ...]: ...

    @property
    def moment_names(self) -> tuple[str, ...]:
        """Every saved kind but the master: a torch.optim state dict's per-parameter entries (besides ``step``)."""

    def state_dict_names(self) -> tuple[str, ...]: ...

    def bytes_per_element(self, master_copy: bool = True) -> Fraction: ...

    def describe(self) -> str:
        """What every rank must agree on (part of the layout fingerprint)."""

    def check_group(self, where: str, group: Mapping[str, Any], device: Optional[torch.device] = None,
                    read_device_values: bool = True) -> None:  # fmt: skip
        """Raise ``ValueError`` naming ``where`` unless the param group's hyperparameters are valid for this rule."""

    def scalars(self, group: Mapping[str, Any]) -> Any:
        """The param group's scalars as :meth:`apply` takes them (read at every step)."""

    def apply(self, state: Mapping[str, torch.Tensor], grad: torch.Tensor, param_out: Optional[torch.Tensor],
              scalars: Any, step, grad_scale, found_inf: Optional[torch.Tensor],
              element_offset: int = 0) -> None:  # fmt: skip
        """One update of a contiguous run, in place: ``state`` maps each kind to its view of the run (``master``:
        fp32, also where the parameters are the master); ``grad`` the mean gradient (fp32), to be multiplied by
        ``grad_scale`` (a number or device scalar: the clip coefficient); ``param_out`` (or None) receives the new
        master in the parameters' dtype, rounded to nearest even; ``step`` the run's step count after this step
        (a device scalar); a nonzero ``found_inf`` (a device scalar, or None) makes the call change nothing;
        ``element_offset`` the canonical index of the run's first element (for rounding that must not depend on
        the layout)."""


class ElementwiseRule(abc.ABC):
    """A rule over any run of a flat shard whose kinds are stored as they are: subclasses set ``name`` and
    ``kinds`` (the master first) and write :meth:`check_group`, :meth:`scalars` and :meth:`apply`."""

    name: str
    unit: Unit = ELEMENTS
    kinds: tuple[StateKind, ...]
    block = 1
    param_align = PARAM_ALIGN
    param_remainders = False
    counts_steps = True  # a torch state dict of it holds a per-parameter "step" (AdamW's bias correction does)
    tie_kind: Optional[str] = None
    quantized: Mapping[str, tuple[str, torch.Tensor]] = {}

    def __init__(self, param_dtype: torch.dtype):
        self.param_dtype = param_dtype

    @cached_property
    def saved_kinds(self) -> tuple[StateKind, ...]:
        """The kinds as state dicts and checkpoints hold them: fp32, one per element (placements convert)."""
        return tuple(StateKind(k.name) for k in self.kinds if k.block == 1)

    @cached_property
    def blocks(self) -> Mapping[str, int]:
        return {k.name: k.block for k in self.kinds if k.block > 1}

    @property
    def kind_names(self) -> tuple[str, ...]:
        """The kinds a placement stores."""
        return tuple(k.name for k in self.kinds)

    @property
    def saved_kind_names(self) -> tuple[str, ...]:
        """The kinds checkpoints and consolidation hold: the fp32 master first, then the rest."""
        return tuple(k.name for k in self.saved_kinds)

    @property
    def moment_names(self) -> tuple[str, ...]:
        """Every kind but the master: what a torch.optim state dict holds per parameter (besides ``step``)."""
        return tuple(k.name for k in self.saved_kinds if k.name != MASTER)

    @property
    def master_is_param(self) -> bool:
        """The parameters' values are the master (fp32 parameters): a state dict holds no separate master."""
        return self.param_dtype == torch.float32

    def state_dict_names(self) -> tuple[str, ...]:
        """The kinds a local state dict holds per parameter: the moments, and the master unless it is the param."""
        return self.moment_names if self.master_is_param else (*self.moment_names, MASTER)

    def bytes_per_element(self, master_copy: bool = True) -> Fraction:
        """Bytes of state per element of a rank's shard (a kind stored per block adds its itemsize / block);
        without ``master_copy`` the master is the parameter."""
        return sum((Fraction(k.itemsize, k.block) for k in self.kinds if master_copy or k.name != MASTER), Fraction(0))

    def describe(self) -> str:
        """What every rank must agree on (part of the layout fingerprint)."""
        return f"{self.name}({', '.join(f'{k.name}:{k.dtype}/{k.block}' for k in self.kinds)})"

    @abc.abstractmethod
    def check_group(self, where: str, group: Mapping[str, Any], device: Optional[torch.device] = None,
                    read_device_values: bool = True) -> None: ...  # fmt: skip

    @abc.abstractmethod
    def scalars(self, group: Mapping[str, Any]) -> Any: ...

    @abc.abstractmethod
    def apply(self, state: Mapping[str, torch.Tensor], grad: torch.Tensor, param_out: Optional[torch.Tensor],
              scalars: Any, step, grad_scale, found_inf: Optional[torch.Tensor],
              element_offset: int = 0) -> None: ...  # fmt: skip


class WholeParameterRule(ElementwiseRule):
    """A rule that updates whole parameters (``unit = "parameters"``): subclasses write :meth:`apply_parameter`
    (each kind's view, the gradient and ``param_out`` come shaped as the parameter) and may weigh parameters by
    :meth:`cost` (the owner layout balances it across ranks). ``apply`` is not used."""

    unit: Unit = PARAMETERS

    def cost(self, shape: tuple[int, ...]) -> int:
        """What updating a parameter of ``shape`` costs, in any unit (the owners balance the sum): its size."""
        return max(1, math.prod(int(d) for d in shape))

    def check_shape(self, where: str, name: str, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` naming ``where`` and ``name`` unless this rule can update a parameter of ``shape``."""

    def apply(self, state, grad, param_out, scalars, step, grad_scale, found_inf, element_offset=0) -> None:
        raise TypeError(f"{type(self).__name__} updates whole parameters: the engine calls apply_parameter")

    @abc.abstractmethod
    def apply_parameter(self, state: Mapping[str, torch.Tensor], grad: torch.Tensor, param_out: Optional[torch.Tensor],
                        scalars: Any, step, grad_scale, found_inf: Optional[torch.Tensor],
                        element_offset: int = 0) -> None:  # fmt: skip
        """One update of one whole parameter, in place: as :meth:`UpdateRule.apply`, every view shaped as the
        parameter (``state`` each kind's, ``grad`` the mean gradient, ``param_out`` the parameter's low-precision
        copy or None); ``element_offset`` the canonical index of its first element."""


__all__ = [
    "MASTER", "ELEMENTS", "PARAMETERS", "Unit", "StateKind", "UpdateRule", "ElementwiseRule", "WholeParameterRule",
]  # fmt: skip
