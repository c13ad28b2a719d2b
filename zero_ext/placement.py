"""Where a rank's optimizer state lives: one buffer per kind of the flat group's update rule, and the grad shard.

:class:`DeviceState` keeps them in memory on the parameters' device (the default); ``zero_ext.offload`` has the
host-memory and disk placements. Nobody else indexes these buffers: the reducer asks where a bucket's reduced
gradient goes (:meth:`grad_target`, then :meth:`landed`), the step asks for update *units* in turn
(:meth:`units`: a bucket here, a chunk of a disk-backed shard there) and reports each one done
(:meth:`unit_done`), so a placement can move state in before an update and out after it, overlapping the next one.
Serialisers read and write through :meth:`read` / :meth:`write` by shard range.

Kinds: those of the rule (:mod:`.update_rule`; the fp32 ``master`` first, absent in memory for fp32 params kept
with their parameters: its views then come from the param buffer) and ``grad`` (the reduced gradient shard).
``master_copy`` says whether this placement stores a master apart from the parameters. With the rule's
``param_remainders`` it does not: the master is the parameters' rank slices joined with the ``remainder`` kind
(:mod:`.master_split`); :meth:`read` and :meth:`write` of ``master`` convert, so serialisers see an fp32 master
either way.

A kind may be stored below fp32 (``moment_dtype=torch.bfloat16``: the moments): :meth:`read` widens it to fp32
(exact) and :meth:`write` rounds fp32 values to it (``copy_``: round to nearest even), so serialisers see fp32
moments whatever is stored.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

import torch

from . import master_split
from .layout import Bucket, Layout, Range
from .update_rule import MASTER, REMAINDER, UpdateRule


class BucketState(NamedTuple):
    """A run of a rank's optimizer state, as the update rule takes it."""

    state: dict[str, torch.Tensor]  # every kind of the rule (the master included), viewed over the run
    grad: torch.Tensor
    param_out: Optional[torch.Tensor]  # the low-precision param slice to write (param_remainders: read too)

    @property
    def master(self) -> torch.Tensor:
        return self.state[MASTER]

    def run(self, r: Range) -> "BucketState":
        """Elements ``r`` (in this run's coordinates) of every view."""
        out = None if self.param_out is None else r.of(self.param_out)
        return BucketState({k: r.of(v) for k, v in self.state.items()}, r.of(self.grad), out)


def widened(values: torch.Tensor) -> torch.Tensor:
    """A kind's values as serialisers see them: fp32 (a bf16 moment widened, exactly; fp32 as is, not copied)."""
    return values.float() if values.dtype == torch.bfloat16 else values


def views_of(buffers: dict[str, torch.Tensor], r: Range) -> dict[str, torch.Tensor]:
    return {kind: r.of(t) for kind, t in buffers.items()}


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

    def __init__(self, layout: Layout, params, device: torch.device, rule: UpdateRule):
        n = layout.shard_numel
        self.layout, self.params, self.rule = layout, params, rule
        self.update_device = torch.device(device)  # where the update runs and the step's scalars live
        # fp32 parameters are their own master here; with remainders the parameters are the master's high half
        self.master_copy = not rule.master_is_param and not rule.param_remainders
        # One buffer per kind of the rule (the state starts at zero; the master is set from the parameters below).
        self.buffers = {
            k.name: torch.zeros(n, dtype=k.dtype, device=device)
            for k in rule.kinds
            if k.name != MASTER or self.master_copy
        }
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
        self.reset_master()

    def reset_master(self) -> None:
        """The fp32 master := the (already adopted or initialised) parameters' values."""
        if self.rule.param_remainders:
            self._remainder().zero_()
        elif self.master_copy:
            for bucket in self.layout.buckets:
                bucket.shard_range.of(self.buffers[MASTER]).copy_(self.params.rank_slice(bucket))

    # ---------------------------------------------------------------- gradients
    def grad_target(self, bucket: Bucket) -> tuple[torch.Tensor, bool]:
        """Where ``bucket``'s reduce-scatter writes, on the params' device, and whether that is the grad shard
        itself (else :meth:`landed` moves it there)."""
        return bucket.shard_range.of(self.grad), True

    def landed(self, bucket: Bucket, target: torch.Tensor, pending, accumulate: bool) -> None:
        """The reduce-scatter into ``target`` was launched (``pending``): move the mean to the grad shard."""

    def finish_landing(self) -> None:
        """Every launched reduction is in the grad shard (after the reducer waited for its collectives)."""

    # ---------------------------------------------------------------- the update
    def bucket_state(self, bucket: Bucket) -> BucketState:
        r = bucket.shard_range
        views = views_of(self.buffers, r)
        if self.master_copy or self.rule.param_remainders:  # None: stage 3 casting the master keeps no shard
            param_out = self.params.rank_slice(bucket)
        else:
            views[MASTER], param_out = self.params.rank_slice(bucket), None
        return BucketState(views, r.of(self.grad), param_out)

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
            return [(shard_range, shard_range.of(self._buffer(kind)))]
        return self._param_runs(shard_range)

    def _param_runs(self, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        """The parameters' rank slices over ``shard_range``: one run per bucket the range crosses."""
        runs = []
        for bucket in self.layout.buckets:
            part = bucket.shard_range.intersect(shard_range)
            if part.numel:
                local = part.shifted(-bucket.shard_offset)
                runs.append((part, local.of(self.params.rank_slice(bucket))))
        return runs

    # ---------------------------------------------------------------- param_remainders: the master in two halves
    def _remainder(self) -> torch.Tensor:
        return self.buffers[REMAINDER]

    def _read_joined_master(self, shard_range: Range) -> torch.Tensor:
        remainder = shard_range.of(self._remainder())
        with torch._C.DisableTorchFunctionSubclass():  # stage 3's shard is a ShardedParameter's storage
            params = torch.cat([v.to(remainder.device) for _, v in self._param_runs(shard_range)])
        return master_split.join(params, remainder)

    def _write_split_master(self, shard_range: Range, values: torch.Tensor) -> None:
        remainder = shard_range.of(self._remainder())
        param, low = master_split.split(values.detach().to(remainder.device, torch.float32))
        remainder.copy_(low)
        with torch._C.DisableTorchFunctionSubclass():
            for part, view in self._param_runs(shard_range):
                view.copy_(part.shifted(-shard_range.start).of(param))

    def read(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` (fp32, on the state's device): a view where the range is one run of fp32
        memory, else a copy (a bf16 kind widened). Do not modify it: :meth:`write` changes the state."""
        if kind == MASTER and self.rule.param_remainders:
            return self._read_joined_master(shard_range)
        runs = self._views(kind, shard_range)
        return widened(runs[0][1] if len(runs) == 1 else torch.cat([v for _, v in runs]))

    def host_view(self, kind: str, shard_range: Range) -> Optional[torch.Tensor]:
        """A writable view of ``shard_range`` of ``kind`` when it is one run of fp32 host memory (a loader can
        read straight into it), else None."""
        if kind == MASTER and self.rule.param_remainders:
            return None
        runs = self._views(kind, shard_range)
        if len(runs) == 1 and runs[0][1].device.type == "cpu" and runs[0][1].dtype == torch.float32:
            return runs[0][1]
        return None

    def write(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """Overwrite ``shard_range`` of ``kind`` with ``values`` (any device; cast to the kind's dtype, rounding to
        nearest even)."""
        if kind == MASTER and self.rule.param_remainders:
            return self._write_split_master(shard_range, values)
        for part, view in self._views(kind, shard_range):
            view.copy_(part.shifted(-shard_range.start).of(values))

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
