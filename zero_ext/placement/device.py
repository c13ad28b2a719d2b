"""Where a rank's optimizer state lives: one buffer per kind of the flat group's update rule, and the grad shard.

:class:`DeviceState` keeps them in memory on the parameters' device (the default); ``zero_ext.placement.offload`` has the
host-memory and disk placements. Nobody else indexes these buffers: the reducer asks where a bucket's reduced
gradient goes (:meth:`grad_target`, then :meth:`landed`), the step asks for update *units* in turn
(:meth:`units`: a bucket here, a chunk of a disk-backed shard there) and reports each one done
(:meth:`unit_done`), so a placement can move state in before an update and out after it, overlapping the next one.
Serialisers read and write through :meth:`read` / :meth:`write` by shard range.

Kinds: those of the rule (:mod:`zero_ext.update.adamw`; the fp32 ``master`` first, absent in memory for fp32 params
kept with their parameters: its views then come from the param buffer) and ``grad`` (the reduced gradient shard).
``master_copy`` says whether this placement stores a master apart from the parameters (not with ``param_remainders``:
the master is then the parameters' rank slices joined with the ``remainder`` kind and a tie bit).

Where and how are separate: a placement keeps each kind's *bits* (:meth:`DeviceState.stored`,
:meth:`DeviceState.store`, :meth:`DeviceState.param_runs`: the :class:`.codecs.Store` protocol), and its
:attr:`DeviceState.codec` (:class:`.codecs.StateCodec`, made from the rule) turns them into the fp32 values
serialisers read and write: bf16 moments widened and rounded, int8 moments dequantized and requantized per block, the
master joined from the parameter, the remainder and the tie bit. Host memory and disk (:mod:`.host`, :mod:`.disk`)
change where the bits are; the codec is the same.
"""

from __future__ import annotations

import functools
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import torch

from ..layout import Bucket, Layout, Range
from ..update.adamw import MASTER, REMAINDER, UpdateRule
from .codecs import StateCodec, widened


class BucketState(NamedTuple):
    """A run of a rank's optimizer state, as the update rule takes it."""

    state: dict[str, torch.Tensor]  # every kind of the rule (the master included), viewed over the run
    grad: torch.Tensor
    param_out: Optional[torch.Tensor]  # the low-precision param slice to write (param_remainders: read too)
    blocks: Mapping[str, int] = {}  # the kinds stored one item per block (int8 scales; rule.blocks): never written

    @property
    def master(self) -> torch.Tensor:
        return self.state[MASTER]

    def run(self, r: Range) -> "BucketState":
        """Elements ``r`` (in this run's coordinates; whole blocks where the rule has blocked kinds) of every
        view."""
        out = None if self.param_out is None else r.of(self.param_out)
        return BucketState(views_of(self.state, r, self.blocks), r.of(self.grad), out, self.blocks)


def items_of(kind: str, r: Range, blocks: Mapping[str, int]) -> Range:
    """Shard elements ``r`` in ``kind``'s item coordinates: the blocks they touch for a kind stored one item per
    block (``blocks``: the rule's), else ``r``."""
    block = blocks.get(kind, 1)
    return r if block == 1 else r.blocks(block)


def views_of(buffers: Mapping[str, torch.Tensor], r: Range, blocks: Mapping[str, int]) -> dict[str, torch.Tensor]:
    return {kind: items_of(kind, r, blocks).of(t) for kind, t in buffers.items()}


class Unit(NamedTuple):
    """One update of the step: ``rows`` (in ``bucket``'s shard coordinates) of ``bucket``, with ``views`` of
    exactly those elements; ``last`` when the bucket is complete after it (its parameters can be gathered)."""

    bucket: Bucket
    rows: Range
    views: BucketState
    last: bool


class DeviceState:
    """Optimizer state in memory on the params' device."""

    resident = True  # the reducer may add gradients straight into `grad`; the master is on the params' device
    adds_in_place = True  # on one process the gradients may be added straight into `grad` (grads.ShardGrads)
    location = "device"

    @classmethod
    def update_device_on(cls, device) -> torch.device:
        """Where the update runs and the step's scalars live, for parameters on ``device``: asked of the class too,
        before any flat group exists (a state built without one takes it from the configuration)."""
        return torch.device(device)

    @classmethod
    def adds_in_place_on(cls, device, world_size: int) -> bool:
        """Whether one process's gradients may be added straight into ``grad`` (``grads.ShardGrads``)."""
        return True

    @functools.cached_property
    def codec(self) -> StateCodec:
        """How the kinds are encoded (the rule's fp32 / bf16 / int8 kinds, the master's remainder and tie bit)."""
        return StateCodec(self.rule)

    def __init__(self, layout: Layout, params, device: torch.device, rule: UpdateRule):
        n = layout.shard_numel
        self.layout, self.params, self.rule = layout, params, rule
        self.update_device = self.update_device_on(device)
        # fp32 parameters are their own master here; with remainders the parameters are the master's high half
        self.master_copy = not rule.master_is_param and not rule.param_remainders
        # One buffer per kind of the rule (the state starts at zero; the master is set from the parameters below).
        self.buffers = {
            k.name: torch.zeros(k.items(n), dtype=k.dtype, device=device)
            for k in rule.kinds
            if k.name != MASTER or self.master_copy
        }
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
        # Each bucket's slice of the grad shard, made once (the shard is never replaced; parking resizes its storage,
        # which the views follow): a launch asks for its target without computing the range again
        self._grad_targets: dict[int, torch.Tensor] = {}
        self.reset_master()

    def reset_master(self) -> None:
        """The fp32 master := the (already adopted or initialised) parameters' values."""
        if self.rule.param_remainders:  # master = the parameters exactly: remainder 0, no tie
            self._remainder().zero_()
            self._clear_ties()
        elif self.master_copy:
            for bucket in self.layout.buckets:
                bucket.shard_range.of(self.buffers[MASTER]).copy_(self.params.rank_slice(bucket))

    # ---------------------------------------------------------------- gradients
    def grad_target(self, bucket: Bucket) -> tuple[torch.Tensor, bool]:
        """Where ``bucket``'s reduce-scatter writes, on the params' device, and whether that is the grad shard
        itself (else :meth:`landed` moves it there)."""
        target = self._grad_targets.get(bucket.index)
        if target is None:
            target = self._grad_targets[bucket.index] = bucket.shard_range.of(self.grad)
        return target, True

    def landed(self, bucket: Bucket, target: torch.Tensor, pending, accumulate: bool) -> None:
        """The reduce-scatter into ``target`` was launched (``pending``): move the mean to the grad shard."""

    def finish_landing(self) -> None:
        """Every launched reduction is in the grad shard (after the reducer waited for its collectives)."""

    # ---------------------------------------------------------------- the update
    def bucket_state(self, bucket: Bucket) -> BucketState:
        r = bucket.shard_range
        views = views_of(self.buffers, r, self.rule.blocks)
        if self.master_copy or self.rule.param_remainders:  # None: stage 3 casting the master keeps no shard
            param_out = self.params.rank_slice(bucket)
        else:
            views[MASTER], param_out = self.params.rank_slice(bucket), None
        return BucketState(views, r.of(self.grad), param_out, self.rule.blocks)

    def units(self, buckets: Sequence[Bucket]) -> Iterator[Unit]:
        """The step's updates in order: here one per bucket, on the buffers themselves."""
        for bucket in buckets:
            yield Unit(bucket, Range(0, bucket.shard_numel), self.bucket_state(bucket), True)

    def unit_done(self, unit: Unit, updated: Sequence[Range]) -> None:
        """The update of ``unit`` is queued (``updated``: the runs the kernel wrote, in the unit's coordinates;
        empty when nothing in it updates): its results may be moved where they belong."""

    def step_done(self) -> None:
        """Every unit of the step was updated."""

    # ---------------------------------------------------------------- serialisers
    def _buffer(self, kind: str) -> torch.Tensor:
        return self.grad if kind == "grad" else self.buffers[kind]

    def _views(self, kind: str, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        """``shard_range`` of ``kind`` as (sub-range, tensor view) runs: one run for a shard buffer; for fp32
        params' master, one run per bucket slice of the param buffer the range crosses."""
        if kind != MASTER or self.master_copy:
            items = items_of(kind, shard_range, self.rule.blocks)
            return [(items, items.of(self._buffer(kind)))]
        return self.param_runs(shard_range)

    def param_runs(self, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        """The parameters' rank slices over ``shard_range``: one run per bucket the range crosses."""
        runs = []
        for bucket in self.layout.buckets:
            part = bucket.shard_range.intersect(shard_range)
            if part.numel:
                local = part.shifted(-bucket.shard_offset)
                runs.append((part, local.of(self.params.rank_slice(bucket))))
        return runs

    # ---------------------------------------------------------------- param_remainders: the master in three parts
    def _remainder(self) -> torch.Tensor:
        return self.buffers[REMAINDER]

    def _clear_ties(self) -> None:
        self.codec.clear_ties(self, self.layout.buckets)

    # ---------------------------------------------------------------- the bits as kept
    def stored(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` exactly as kept (one of the rule's ``kind_names``; with ``param_remainders``
        the tie kind carries the tie bits; a kind stored per block: the scales of the blocks the range touches), in
        its stored dtype: a view where the range is one run of memory, else a copy. The serialisers' :meth:`read`
        converts from it; tests compare it to see that no byte changed."""
        runs = self._views(kind, shard_range)
        return runs[0][1] if len(runs) == 1 else torch.cat([v for _, v in runs])

    def store(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """Overwrite ``shard_range`` of ``kind`` with ``values`` (cast to the stored dtype), bits as they are."""
        start = items_of(kind, shard_range, self.rule.blocks).start
        for part, view in self._views(kind, shard_range):
            view.copy_(part.shifted(-start).of(values))

    # ---------------------------------------------------------------- serialisers
    def read(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` (fp32, on the state's device): a view where the range is one run of fp32
        memory, else a copy (converted by the codec). Do not modify it: :meth:`write` changes the state."""
        return self.codec.read(self, kind, shard_range)

    def read_runs(self, kind: str, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        """:meth:`read`, cut where the memory is: ``(sub-range, fp32 values)`` runs covering ``shard_range`` in
        order, each a view where its kind is kept as fp32 memory (fp32 parameters' master: one run per bucket the
        range crosses), so a reader that takes pieces (DCP) copies nothing that :meth:`read` would join; one run of
        fresh values where the codec converts. Do not modify them."""
        if self.codec.converts(kind) or self.rule.blocks.get(kind, 1) != 1:
            return [(shard_range, self.read(kind, shard_range))]
        return [(part, widened(view)) for part, view in self._views(kind, shard_range)]

    def host_view(self, kind: str, shard_range: Range) -> Optional[torch.Tensor]:
        """A writable view of ``shard_range`` of ``kind`` when it is one run of fp32 host memory (a loader can
        read straight into it), else None."""
        if self.codec.converts(kind):
            return None  # converted by write
        runs = self._views(kind, shard_range)
        if len(runs) == 1 and runs[0][1].device.type == "cpu" and runs[0][1].dtype == torch.float32:
            return runs[0][1]
        return None

    def write(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """Overwrite ``shard_range`` of ``kind`` with ``values`` (any device; encoded by the codec: cast to the
        kind's dtype, rounding to nearest even)."""
        self.codec.write(self, kind, shard_range, values)

    # ---------------------------------------------------------------- the ledger
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this placement allocated in memory, by kind (the memory ledger's input)."""
        return {**self.buffers, "grad_shard": self.grad}

    def where(self) -> dict[str, str]:
        """Each kind's medium: "device" (the params' device), "host" (host memory) or "disk"."""
        return dict.fromkeys((*self.rule.kind_names, "grad_shard"), self.location)

    def disk_bytes(self) -> int:
        return 0

    def disk_bytes_by_kind(self) -> dict[str, int]:
        """Bytes of each kind's file (offload="nvme"; none here)."""
        return {}

    def close(self) -> None:
        """Release what outlives the process otherwise (files)."""
