"""The one owner of a rank's sharded state: :class:`ShardedState`, made of :class:`FlatGroup` s.

``ShardedState`` is the seam every other part of zero_ext reads (``state_dict``, ``checkpoint``, ``memory``, the
tests): the flat groups with their parameters' global indices, names, param group and update rule, the step and
skip counters (device scalars), the stage and the communicator. ``ZeroAdamW.sharded_state`` returns it. It is built
whole (:mod:`zero_ext.construction.state_builder`) and only ever grows, in place, by the flat groups ``add_param_group``
builds (:meth:`ShardedState.add_groups`); nothing else is assigned to it from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..comm import Communicator
from ..comm.mesh import Mesh
from ..layout import Bucket, Layout, OwnedPiece
from ..placement.device import DeviceState
from ..update.protocol import UpdateRule
from ..update.registry import DEFAULT_RULE, rule_for_group
from .params import FullParams, ParamEdits
from .step_counts import StepCounts


class FlatGroup:
    """One (param group, dtype) of trainable parameters (``params``): their layout, where they live
    (``flat_params``, per stage), the update rule that says what state they keep (``rule``) and where that state
    lives (``state``, per placement). ``grad_buffer_dtype``: stage 1's persistent flat gradient buffer, else None."""

    def __init__(
        self,
        index: int,
        group_index: int,
        params: Sequence[torch.nn.Parameter],
        param_indices: Sequence[int],
        names: Sequence[str],
        layout: Layout,
        rank: int,
        params_cls=FullParams,
        device: Optional[torch.device] = None,
        placement=None,
        rule: Optional[UpdateRule] = None,
        grad_buffer_dtype: Optional[torch.dtype] = None,
    ):
        self.index = index  # position among the flat groups
        self.group_index = group_index  # the param group (optimizer.param_groups[group_index])
        self.params = list(params)
        self.param_indices = list(param_indices)  # each parameter's index across all param groups (torch.optim's)
        self.names = list(names)
        self.layout = layout
        self.rank = rank
        self.dtype = self.params[0].dtype
        self.device = device or self.params[0].device  # (params built on meta live on `device`)
        self.flat_params = params_cls(layout, rank, self.dtype, self.device)
        self.flat_params.adopt(self.params)
        self.rule = rule if rule is not None else rule_for_group(self.dtype, {})
        # where the optimizer state lives: in memory on the device (default), or offload's host memory or files
        make = placement or (lambda layout, params, device, rule, index: DeviceState(layout, params, device, rule))
        self.state = make(layout, self.flat_params, self.device, self.rule, index)
        self.grad_buffer: Optional[torch.Tensor] = None  # stage 1's persistent flat gradient buffer
        if grad_buffer_dtype is not None:
            self.grad_buffer = torch.zeros(layout.numel, dtype=grad_buffer_dtype, device=self.device)
        self.pieces_by_bucket: dict[int, list[OwnedPiece]] = {b.index: [] for b in layout.buckets}
        for piece in self.owned_pieces():
            self.pieces_by_bucket[piece.bucket].append(piece)

    def owned_pieces(self) -> tuple[OwnedPiece, ...]:
        return self.layout.owned_pieces(self.rank)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor of this group in memory, by kind (a kind of several tensors, such as offload's
        landing ring, as ``kind.0``, ``kind.1``, ...)."""
        out = dict(self.flat_params.tensors())
        for kind, t in self.state.tensors().items():
            if isinstance(t, torch.Tensor):
                out[kind] = t
            else:
                out.update({f"{kind}.{i}": x for i, x in enumerate(t)})
        if self.grad_buffer is not None:
            out["grads"] = self.grad_buffer
        return out


@dataclass(frozen=True)
class PieceRef:
    """An owned piece with the facts a serializer needs about its parameter."""

    group: FlatGroup
    piece: OwnedPiece
    param_index: int  # global index (across all param groups)
    name: str


class ShardedState:
    """Everything one rank holds of the sharded model state, and the facts needed to read it."""

    def __init__(
        self,
        mesh: Mesh,
        stage: int,
        bucket_size: int,
        groups: Sequence[FlatGroup],
        names: dict[int, str],
        device: torch.device,
        *,
        model=None,
        frozen: Sequence[tuple[str, torch.nn.Parameter]] = (),
        default_rule: str = DEFAULT_RULE,
        update_device: Optional[torch.device] = None,
        tracks_param_edits: bool,
        optimizer_name: str = "zero_ext.ZeroAdamW",
    ):
        self.mesh = mesh  # the layout's communicator; for HSDP also its shard and replicate groups (comm/mesh.py)
        self.comm: Communicator = mesh.comm  # every collective of the layout goes through it
        self.world_size, self.rank = self.comm.world_size, self.comm.rank  # (the layout's: fixed for the state's life)
        self.stage = stage
        self.bucket_size = bucket_size
        self.groups = list(groups)
        self.names = dict(names)  # global index -> name, for every parameter of the optimizer (frozen ones too)
        self.device = device
        self.default_rule = default_rule  # the update rule of a param group that names none (registry.RULE_KEY)
        self.optimizer_name = optimizer_name  # how messages raised outside the optimizer's own calls name it
        # Where the update runs and the step's scalars live (offload: the CPU): the placement's, given by the builder
        # from the configuration, so that a state built without a flat group has the one its added groups will need.
        if update_device is None:
            update_device = self.groups[0].state.update_device if self.groups else device
        self.update_device = torch.device(update_device)
        # Steps that updated something (skipped steps excluded) and steps skipped for a non-finite gradient, and
        # every parameter's own step count: device scalars, so that step() never has to read them on the host.
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.update_device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=self.update_device)
        self.step_counts = StepCounts([gidx for _, gidx, _ in self.members()], self.update_device)
        self.model = model  # the model's names and state outside the optimizer (model_state.ModelState), with module=
        # Parameters given to the optimizer with requires_grad=False: left alone, and not sharded (step() refuses
        # to go on if one becomes trainable: it would never be updated).
        self.frozen: list[tuple[str, torch.nn.Parameter]] = list(frozen)
        # In-place changes to full parameters, which the master must follow (params.py, ParamEdits): where the stage
        # keeps the parameters full on every rank (its ``tracks_param_edits``, which the builder passes).
        self.param_edits = ParamEdits(self.groups) if tracks_param_edits else None

    def add_groups(self, added: Sequence[FlatGroup], names: dict[int, str]) -> None:
        """The flat groups ``added`` after these (``ZeroAdamW.add_param_group``; ``names``: their parameters'), in
        place: the same object, flat groups, model, frozen parameters and counters. Every parameter keeps its step
        count; the added ones start at 0 (torch's state for a parameter that never stepped), and their in-place edits
        are followed from now on."""
        self.groups += added
        self.names.update(names)
        self.step_counts.extend([gidx for g in added for gidx in g.param_indices])
        if self.param_edits is not None:
            self.param_edits.extend(added)

    def buckets(self) -> Iterator[tuple[FlatGroup, Bucket]]:
        """Every (group, bucket), groups in order, buckets in layout order."""
        for group in self.groups:
            for bucket in group.layout.buckets:
                yield group, bucket

    def launch_order(self) -> list[tuple[FlatGroup, Bucket]]:
        """Every (group, bucket) in the order their buckets are expected to complete in backward: a bucket is
        complete when its earliest-registered parameter's gradient arrives (backward runs the model in reverse), so
        the bucket whose earliest parameter was registered last comes first (registered in the model, with
        ``module=``; else in the order given to the optimizer). Every rank launches collectives in this one order, so
        they always pair up. A bucket launched too early in this order holds back every reduction after it (each
        keeping its staging entry) until it completes: keyed by its latest parameter instead, the one bucket of a
        no-decay group (every layer's norms and biases) launched first and completed last, which held every
        reduction to the end of backward and grew the staging pool to one entry per bucket. (The model's order also
        places a group added later, ``add_param_group``: typically early layers, unfrozen, whose gradients arrive
        last; by their indices, the largest, their buckets would launch first.)"""
        registered = {id(t): i for i, t in enumerate(self.model.tensor_of.values())} if self.model is not None else {}

        def position(g: FlatGroup, i: int) -> int:
            return registered.get(id(g.params[i]), g.param_indices[i])

        keyed = [(min(position(g, i) for i in b.slots), g, b) for g, b in self.buckets()]
        keyed.sort(key=lambda k: -k[0])
        return [(g, b) for _, g, b in keyed]

    def pieces(self) -> Iterator[PieceRef]:
        """Every parameter run this rank owns, group by group, in shard order."""
        for group in self.groups:
            for piece in group.owned_pieces():
                gidx = group.param_indices[piece.index]
                yield PieceRef(group, piece, gidx, self.names[gidx])

    def members(self) -> Iterator[tuple[FlatGroup, int, torch.nn.Parameter]]:
        """Every trainable parameter: (its group, its global index, the parameter)."""
        for group in self.groups:
            for gidx, p in zip(group.param_indices, group.params):
                yield group, gidx, p
