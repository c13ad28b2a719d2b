"""Where a rank's optimizer state lives: one buffer per kind of the flat group's update rule, and the grad shard.

:class:`DeviceState` keeps them in memory on the parameters' device (the default); ``zero_ext.placement.offload`` has the
host-memory and disk placements. Nobody else indexes these buffers: the reducer asks where a bucket's reduced
gradient goes (:meth:`grad_target`, then :meth:`landed`), the step asks for update *units* in turn
(:meth:`units`: a bucket here, a chunk of a disk-backed shard there) and reports each one done
(:meth:`unit_done`), so a placement can move state in before an update and out after it, overlapping the next one.
Serialisers read and write through :meth:`read` / :meth:`write` by shard range.

Kinds: those of the rule (:mod:`.update_rule`; the fp32 ``master`` first, absent in memory for fp32 params kept
with their parameters: its views then come from the param buffer) and ``grad`` (the reduced gradient shard).
``master_copy`` says whether this placement stores a master apart from the parameters. With the rule's
``param_remainders`` it does not: the master is the parameters' rank slices (the master rounded to nearest even)
joined with the ``remainder`` kind and a tie bit kept in the sign bit of the rule's ``tie_kind`` (exp_avg_sq, never
negative otherwise; :mod:`.master_split`). Serialisers never see that bit: :meth:`read` of ``master`` joins the
three, :meth:`read` of the tie kind clears the bit, :meth:`write` of ``master`` sets it and :meth:`write` of the tie
kind keeps it; so serialisers see an fp32 master and plain moments either way. :meth:`stored` reads a kind's bits
as kept (the tie bit included).

A kind may be stored below fp32 (``moment_dtype=torch.bfloat16``: the moments): :meth:`read` widens it to fp32
(exact) and :meth:`write` rounds fp32 values to it (``copy_``: round to nearest even), so serialisers see fp32
moments whatever is stored. With ``moment_dtype=torch.int8`` a moment is int8 codes plus a kind of fp32 scales
stored one item per 64-element block (``StateKind.block``; every view and range of it is in block coordinates:
:func:`items_of`): :meth:`read` dequantizes, :meth:`write` requantizes the whole blocks the range touches with their
new absmax (the elements outside it, padding in practice, keep their values up to that).
"""

from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import torch

from ..layout import Bucket, Layout, Range
from ..update import blockwise_int8, master_split
from ..update.rule import MASTER, REMAINDER, UpdateRule


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


def widened(values: torch.Tensor) -> torch.Tensor:
    """A kind's values as serialisers see them: fp32 (a bf16 moment widened, exactly; fp32 as is, not copied)."""
    return values.float() if values.dtype == torch.bfloat16 else values


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

    def __init__(self, layout: Layout, params, device: torch.device, rule: UpdateRule):
        n = layout.shard_numel
        self.layout, self.params, self.rule = layout, params, rule
        self.update_device = torch.device(device)  # where the update runs and the step's scalars live
        # fp32 parameters are their own master here; with remainders the parameters are the master's high half
        self.master_copy = not rule.master_is_param and not rule.param_remainders
        # One buffer per kind of the rule (the state starts at zero; the master is set from the parameters below).
        self.buffers = {
            k.name: torch.zeros(k.items(n), dtype=k.dtype, device=device)
            for k in rule.kinds
            if k.name != MASTER or self.master_copy
        }
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
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
        return bucket.shard_range.of(self.grad), True

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

    # ---------------------------------------------------------------- param_remainders: the master in three parts
    def _remainder(self) -> torch.Tensor:
        return self.buffers[REMAINDER]

    def _ties(self, shard_range: Range) -> torch.Tensor:
        """The masters' tie bits over ``shard_range`` (bool, on the state's device)."""
        return master_split.tie_of(self.stored(self.rule.tie_kind, shard_range))

    def _set_ties(self, shard_range: Range, tie: Optional[torch.Tensor]) -> None:
        """The tie kind's sign bits over ``shard_range`` := ``tie`` (None: cleared); its values are kept."""
        kind = self.rule.tie_kind
        old = self.stored(kind, shard_range)
        new = master_split.without_tie(old) if tie is None else master_split.with_tie(old, tie.to(old.device))
        self._store(kind, shard_range, new)

    def _clear_ties(self) -> None:
        for bucket in self.layout.buckets:  # bucket by bucket: the temporaries stay bounded
            self._set_ties(bucket.shard_range, None)

    def _read_joined_master(self, shard_range: Range) -> torch.Tensor:
        remainder = shard_range.of(self._remainder())
        with torch._C.DisableTorchFunctionSubclass():  # stage 3's shard is a ShardedParameter's storage
            params = torch.cat([v.to(remainder.device) for _, v in self._param_runs(shard_range)])
        return master_split.join(params, remainder, self._ties(shard_range).to(remainder.device))

    def _write_split_master(self, shard_range: Range, values: torch.Tensor) -> None:
        remainder = shard_range.of(self._remainder())
        param, low, tie = master_split.split(values.detach().to(remainder.device, torch.float32))
        remainder.copy_(low)
        self._set_ties(shard_range, tie)
        with torch._C.DisableTorchFunctionSubclass():
            for part, view in self._param_runs(shard_range):
                view.copy_(part.shifted(-shard_range.start).of(param))

    # ---------------------------------------------------------------- the bits as kept
    def stored(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` exactly as kept (one of the rule's ``kind_names``; with ``param_remainders``
        the tie kind carries the tie bits; a kind stored per block: the scales of the blocks the range touches), in
        its stored dtype: a view where the range is one run of memory, else a copy. The serialisers' :meth:`read`
        converts from it; tests compare it to see that no byte changed."""
        runs = self._views(kind, shard_range)
        return runs[0][1] if len(runs) == 1 else torch.cat([v for _, v in runs])

    def _store(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """Overwrite ``shard_range`` of ``kind`` with ``values`` (cast to the stored dtype), bits as they are."""
        start = items_of(kind, shard_range, self.rule.blocks).start
        for part, view in self._views(kind, shard_range):
            view.copy_(part.shifted(-start).of(values))

    # ---------------------------------------------------------------- int8 moments: codes and block scales
    def _read_dequantized(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of the int8 moment ``kind``, dequantized (fp32; the tie bit ignored)."""
        scale_kind, qmap = self.rule.quantized[kind]
        wide = shard_range.whole_blocks(self.rule.block)  # a shard is whole blocks
        codes, scales = self.stored(kind, wide), self.stored(scale_kind, wide)
        values = blockwise_int8.dequantize(codes, scales, self.rule.block, qmap.to(codes.device))
        return shard_range.shifted(-wide.start).of(values)

    def _write_quantized(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """``shard_range`` of the int8 moment ``kind`` := ``values``: the blocks it touches are requantized with
        their new absmax (elements outside the range, padding in practice, keep their values up to that); the tie
        bits are kept."""
        scale_kind, qmap = self.rule.quantized[kind]
        wide = shard_range.whole_blocks(self.rule.block)
        full = self._read_dequantized(kind, wide).clone()
        shard_range.shifted(-wide.start).of(full).copy_(values.detach().reshape(-1))
        codes, scales = blockwise_int8.quantize(full, self.rule.block, qmap.to(full.device))
        if kind == self.rule.tie_kind:
            codes = master_split.with_tie(codes, master_split.tie_of(self.stored(kind, wide)).to(codes.device))
        self._store(kind, wide, codes)
        self._store(scale_kind, wide, scales)

    # ---------------------------------------------------------------- serialisers
    def read(self, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` (fp32, on the state's device): a view where the range is one run of fp32
        memory, else a copy (a bf16 kind widened). Do not modify it: :meth:`write` changes the state."""
        if kind == MASTER and self.rule.param_remainders:
            return self._read_joined_master(shard_range)
        if kind in self.rule.quantized:
            return self._read_dequantized(kind, shard_range)
        if kind == self.rule.tie_kind:  # param_remainders: the tie bits cleared
            return widened(master_split.without_tie(self.stored(kind, shard_range)))
        return widened(self.stored(kind, shard_range))

    def host_view(self, kind: str, shard_range: Range) -> Optional[torch.Tensor]:
        """A writable view of ``shard_range`` of ``kind`` when it is one run of fp32 host memory (a loader can
        read straight into it), else None."""
        if (kind == MASTER and self.rule.param_remainders) or kind == self.rule.tie_kind or kind in self.rule.quantized:
            return None  # converted by write
        runs = self._views(kind, shard_range)
        if len(runs) == 1 and runs[0][1].device.type == "cpu" and runs[0][1].dtype == torch.float32:
            return runs[0][1]
        return None

    def write(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """Overwrite ``shard_range`` of ``kind`` with ``values`` (any device; cast to the kind's dtype, rounding to
        nearest even)."""
        if kind == MASTER and self.rule.param_remainders:
            return self._write_split_master(shard_range, values)
        if kind in self.rule.quantized:
            return self._write_quantized(kind, shard_range, values)
        if kind == self.rule.tie_kind:  # param_remainders: the tie bits kept
            old = self.stored(kind, shard_range)
            values = master_split.with_tie(values.detach().to(old.device, old.dtype), master_split.tie_of(old))
        self._store(kind, shard_range, values)

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
