"""Gradient reduction: from autograd's gradients to this rank's fp32 grad shard, bucket by bucket, during
backward.

A post-accumulate-grad hook on every parameter tracks when each bucket has all its gradients; the bucket
is then reduce-scattered at once (overlapping the rest of backward). Buckets are launched in one fixed
global order on every rank (a bucket that completes early waits for its predecessors), so the collectives
of all ranks always pair up, whatever order gradients arrive in. At the end of each backward pass the
buckets still open (parameters that got no gradient: unused branches) are launched too, their missing
gradients counting as zero.

Stage 1 keeps a persistent flat grad buffer per group (``param.grad`` is a view into it, so autograd
accumulates in place; after ``zero_grad()`` it is None and the next gradient is copied into its slot, so
nothing rereads or clears the whole buffer); a bucket's slice is cast to ``reduce_dtype`` and pre-scaled by 1/world into a
staging buffer, reduce-scattered, and the result written into the grad shard. Inside ``no_sync()`` nothing
is reduced; the next synchronised backward (or ``step()``) reduces the accumulated sum.

Stage 2 keeps no full-size grad buffer: each gradient is cast + pre-scaled into its bucket's staging
buffer the moment autograd produces it, then freed (``param.grad = None``). The reduce-scatter output is
accumulated in fp32 into the grad shard, so several backward passes before ``step()`` accumulate. Stage 2
cannot skip communication inside ``no_sync()`` (there is no buffer to accumulate a full gradient in); it
reduces every backward pass, as DeepSpeed's ZeRO-2 does.

On gloo the communicator reduce-scatters with an all-to-all and sums the received slices itself (see
``comm.py``). With the default fp32 ``reduce_dtype`` the gradients then travel in their own dtype, unscaled
(stage 1 straight from the grad buffer, without a staging copy), and are summed in fp32 in rank order and
divided by N: the exact fp32 mean, at half the bytes for bf16/fp16 gradients.

With one rank there is nothing to reduce: no staging pool, no collective. Stage 1 casts its grad buffer into
the fp32 grad shard bucket by bucket; stage 2 adds each gradient into the grad shard as it arrives.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .buffers import Bucket, FlatGroup, Slot
from .comm import Communicator, Pending
from .device_ops import accumulate_into, cast_scale_into


@dataclass
class _BucketRef:
    group: FlatGroup
    bucket: Bucket
    order: int  # position in the global launch order


@dataclass
class _Staging:
    """One staging buffer of the pool: the reduce-scatter input and (when needed) its output."""

    input: Optional[torch.Tensor]  # None when stage 1 sends straight from its grad buffer
    output: Optional[torch.Tensor]
    scratch: Optional[torch.Tensor]  # the communicator's receive buffer (gloo), else None
    pending: Optional[Pending] = None  # the in-flight collective reading/writing this entry
    holder: Optional[int] = None  # order of the bucket filling it (stage 2), until launched


class GradReducer:
    # With one rank there is nothing to reduce: gradients go straight to the grad shard. Tests turn this off to
    # run the communicating path on one rank (on one GPU, the only way to exercise NCCL's side of it).
    direct_at_one_rank = True

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        global_indices: Sequence[Sequence[int]],
        param_names: dict[int, str],
        comm: Communicator,
        stage: int,
        reduce_dtype: torch.dtype,
        pool_size: int = 2,
    ):
        self.groups = list(groups)
        self._unreduced = False  # stage 1: grads accumulated (under no_sync()) and not reduced yet
        self.comm = comm
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        # What the reduce-scatter carries. NCCL sums inside the collective, so gradients are cast to
        # reduce_dtype and pre-scaled by 1/N first (a low-precision sum then cannot overflow). Where the
        # communicator sums the received slices itself (gloo: all-to-all + a local sum) and reduce_dtype is fp32,
        # a gradient travels in its own dtype, unscaled: bf16/fp16 -> fp32 is exact, so this loses nothing and
        # halves the bytes; the slices are summed in fp32 in rank order and divided by N once, which is the
        # reference's sum(grads) / N to the bit.
        self._local_sum = comm.reduce_scatter_by_all_to_all and reduce_dtype == torch.float32
        # Stage 1 on that path needs no staging copy at all: the all-to-all sends straight from the flat grad
        # buffer. The buffer must then stay untouched until the transfer is done, so every backward pass waits
        # for its reductions before it returns (as DDP's backward does); step() would wait for them anyway.
        self._send_from_grad_buffer = stage == 1 and self._local_sum
        self._divide_by = comm.world_size if self._local_sum else 1
        # One rank: nothing to communicate and nothing to stage. Stage 1 copies (casts) each bucket of its grad
        # buffer into the fp32 grad shard; stage 2 adds each gradient straight into its place in the grad shard.
        self._direct = comm.world_size == 1 and self.direct_at_one_rank
        self.prescale = 1.0 if self._local_sum else 1.0 / comm.world_size
        self._names = param_names
        # Launch order: the bucket whose parameters were registered last gets its gradients first.
        refs = []
        for g, indices in zip(self.groups, global_indices):
            for bucket in g.layout.buckets:
                refs.append((max(indices[i] for i in bucket.slots), g, bucket))
        refs.sort(key=lambda r: -r[0])
        self.refs = [_BucketRef(g, b, order) for order, (_, g, b) in enumerate(refs)]
        self._ref_of = {(id(r.group), r.bucket.index): r for r in self.refs}

        self.grad_buffers: list[Optional[torch.Tensor]] = []
        stale = [
            param_names[indices[i]]
            for g, indices in zip(self.groups, global_indices)
            for i, p in enumerate(g.params)
            if p.grad is not None
        ]
        for g in self.groups:
            if stage == 1:
                buf = torch.zeros(g.layout.numel, dtype=g.dtype, device=g.device)
                for slot, p in zip(g.layout.slots, g.params):
                    view = buf[slot.offset : slot.offset + slot.numel].view(p.shape)
                    if p.grad is not None:  # a gradient from before construction is kept (not yet reduced)
                        view.copy_(p.grad)
                        self._unreduced = True
                    p.grad = view
                self.grad_buffers.append(buf)
            else:
                self.grad_buffers.append(None)
                for p in g.params:
                    p.grad = None
        if stale and stage == 2:
            warnings.warn(
                f"zero_ext.ZeroAdamW: dropping the gradients of {len(stale)} parameters (e.g. {stale[0]!r}) computed "
                "before the optimizer existed: stage 2 reduces gradients while backward runs",
                stacklevel=3,
            )

        self._grad_buffer_of = {id(g): buf for g, buf in zip(self.groups, self.grad_buffers)}
        # Pool entries hold any bucket of any group: byte buffers, viewed in the bucket's wire dtype.
        self._input_bytes = 0
        if not self._send_from_grad_buffer:
            self._input_bytes = max((r.bucket.numel * self._wire_itemsize(r) for r in self.refs), default=0)
        self._scratch_bytes = max(
            (comm.scratch_numel(r.bucket.numel) * self._wire_itemsize(r) for r in self.refs), default=0
        )
        self._max_shard = max((r.bucket.shard_numel for r in self.refs), default=0)
        # A separate reduce-scatter output (one shard) is needed when the result cannot land in the grad shard
        # directly: stage 2 accumulates it, and a reduce_dtype other than fp32 is cast. On the local-sum path
        # stage 2 sums into its own staging input instead, viewed as fp32: the all-to-all has sent all of it
        # by then, and a bucket of >= 2-byte elements is at least as large as one fp32 shard of it.
        self._needs_output = (stage == 2 and not self._local_sum) or reduce_dtype != torch.float32
        self._device = self.groups[0].device if self.groups else torch.device("cpu")
        pool_size = 0 if self._direct else min(pool_size, len(self.refs))
        self.pool: list[_Staging] = [self._new_staging() for _ in range(pool_size)]
        self._inflight: list[_Staging] = []  # launched entries, oldest first

        self.stepped_since_zero_grad = False  # set by step(), cleared by zero_grad()
        self._warned_no_zero_grad = False
        # Per-round state (a round = one synchronised backward pass).
        self.sync_enabled = True
        self._round_open = False
        self._arrived = [0] * len(self.refs)
        self._staging_of: list[Optional[_Staging]] = [None] * len(self.refs)
        self._next = 0  # next bucket (in launch order) to launch this round

        for g, indices in zip(self.groups, global_indices):
            for slot, p in zip(g.layout.slots, g.params):
                p.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, g, slot.index, indices[slot.index])
                )

    # ---------------------------------------------------------------- staging pool
    def _wire_dtype(self, group: FlatGroup) -> torch.dtype:
        return group.dtype if self._local_sum else self.reduce_dtype

    def _wire_itemsize(self, ref: _BucketRef) -> int:
        return self._wire_dtype(ref.group).itemsize

    def _new_staging(self) -> _Staging:
        out = torch.empty(self._max_shard, dtype=self.reduce_dtype, device=self._device) if self._needs_output else None
        raw = dict(dtype=torch.uint8, device=self._device)
        scratch = torch.empty(self._scratch_bytes, **raw) if self._scratch_bytes else None
        staging = torch.zeros(self._input_bytes, **raw) if self._input_bytes else None
        return _Staging(staging, out, scratch)

    def _typed(self, buffer: Optional[torch.Tensor], ref: _BucketRef) -> Optional[torch.Tensor]:
        """A pool byte buffer as ``ref``'s bucket in its wire dtype."""
        if buffer is None:
            return None
        return buffer.view(self._wire_dtype(ref.group))[: ref.bucket.numel]

    def _acquire(self, holder: Optional[int]) -> _Staging:
        """A staging entry no unlaunched bucket holds: a free one, else the oldest in flight (waited for).
        When every entry is held by a bucket still filling (gradients arriving far out of layout order),
        the pool grows by one; it never shrinks, so this happens only in the first steps."""
        entry = next((e for e in self.pool if e.holder is None and e.pending is None), None)
        if entry is None and self._inflight:
            entry = self._inflight.pop(0)
            entry.pending.wait()
            entry.pending = None
        if entry is None:
            entry = self._new_staging()
            self.pool.append(entry)
        entry.holder = holder
        return entry

    def staging_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for e in self.pool for t in (e.input, e.output, e.scratch) if t is not None
        )

    # ---------------------------------------------------------------- backward
    def _on_grad(self, group: FlatGroup, index: int, global_index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"zero_ext.ZeroAdamW: parameter {self._names[global_index]!r} received a {grad.layout} gradient; "
                "only dense gradients are supported (use nn.Embedding(sparse=False))"
            )
        ref = self._ref_of[(id(group), group.layout.slots[index].bucket)]
        slot = group.layout.slots[index]
        if self.stage == 1:
            self._adopt_grad(group, slot, param, grad)
            if not self.sync_enabled:
                self._unreduced = True
                return
        self._open_round()
        if self.stage == 2 and self._direct:
            start = ref.bucket.shard_offset + slot.offset - ref.bucket.offset
            accumulate_into(group.grad_shard[start : start + slot.numel], grad)
            param.grad = None
        elif self.stage == 2:
            entry = self._staging_of[ref.order]
            if entry is None:
                entry = self._staging_of[ref.order] = self._acquire(ref.order)
                self._typed(entry.input, ref).zero_()
            start = slot.offset - ref.bucket.offset
            cast_scale_into(self._typed(entry.input, ref)[start : start + slot.numel], grad, self.prescale)
            param.grad = None
        self._arrived[ref.order] += 1
        if self._arrived[ref.order] == len(ref.bucket.slots):
            self._launch_ready()

    def _open_round(self) -> None:
        if not self._round_open:
            self._round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._close_round)
            if self.stage == 2 and self.stepped_since_zero_grad and not self._warned_no_zero_grad:
                self._warned_no_zero_grad = True
                warnings.warn(
                    "zero_ext.ZeroAdamW(stage=2): backward after step() without opt.zero_grad(): this gradient is "
                    "added to the previous step's, as torch accumulates .grad. If that is not meant, call "
                    "opt.zero_grad(): model.zero_grad() cannot clear stage 2's sharded gradients.",
                    stacklevel=2,
                )

    def _launch_ready(self) -> None:
        while self._next < len(self.refs) and self._arrived[self._next] == len(self.refs[self._next].bucket.slots):
            self._launch(self.refs[self._next])
            self._next += 1

    def _close_round(self) -> None:
        """End of a backward pass: launch every bucket not launched yet (missing gradients are zero)."""
        while self._next < len(self.refs):
            self._launch(self.refs[self._next])
            self._next += 1
        self._round_open = False
        self._arrived = [0] * len(self.refs)
        self._staging_of = [None] * len(self.refs)
        self._next = 0
        if self.stage == 1:
            self._unreduced = False
        if self._send_from_grad_buffer:
            self._wait_inflight()

    def _launch(self, ref: _BucketRef) -> None:
        group, bucket = ref.group, ref.bucket
        grad_shard = group.shard_of(group.grad_shard, bucket)
        if self.stage == 1 and self._arrived[ref.order] < len(bucket.slots):
            self._settle_missing(group, bucket)
        if self._direct:
            if self.stage == 1:
                grad_shard.copy_(group.bucket_view(self._grad_buffer_of[id(group)], bucket))
            return
        if self.stage == 1:
            entry = self._acquire(ref.order)
            grads = group.bucket_view(self._grad_buffer_of[id(group)], bucket)
            if self._send_from_grad_buffer:
                send = grads
            else:
                send = self._typed(entry.input, ref)
                cast_scale_into(send, grads, self.prescale)
            if entry.output is None:
                out, then = grad_shard, None
            else:
                out = entry.output[: bucket.shard_numel]
                then = functools.partial(grad_shard.copy_, out)
        else:
            entry = self._staging_of[ref.order]
            if entry is None:  # no parameter of this bucket got a gradient this round
                entry = self._acquire(ref.order)
                self._typed(entry.input, ref).zero_()
            send = self._typed(entry.input, ref)
            if self._local_sum:
                out = entry.input.view(torch.float32)[: bucket.shard_numel]
            else:
                out = entry.output[: bucket.shard_numel]
            then = functools.partial(accumulate_into, grad_shard, out)
        entry.pending = self.comm.reduce_scatter(
            out,
            send,
            then=then,
            scratch=self._typed(entry.scratch, ref),
            divide_by=self._divide_by,
        )
        entry.holder = None
        self._inflight.append(entry)

    def _adopt_grad(self, group: FlatGroup, slot: Slot, param: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Stage 1: make ``param``'s slot of the flat grad buffer hold ``grad`` and ``param.grad`` a view of it.
        A slot holds the parameter's gradient only while ``param.grad`` is that view: after zero_grad() (or the
        user's own set-to-None) autograd hands over a fresh tensor, meaning "the previous value was zero", so it
        is copied over the slot; no gradient at all (None) is zero."""
        view = self._grad_buffer_of[id(group)][slot.offset : slot.offset + slot.numel]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad.reshape(-1))
            param.grad = view.view(param.shape)

    def _settle_missing(self, group: FlatGroup, bucket: Bucket) -> None:
        """Stage 1, a bucket launched before all its parameters got a gradient this round: the slots of those
        parameters may hold old gradients; make each hold what its ``.grad`` says (None: zero)."""
        for i in bucket.slots:
            self._adopt_grad(group, group.layout.slots[i], group.params[i], group.params[i].grad)

    # ---------------------------------------------------------------- step / zero_grad
    def finish(self) -> None:
        """Make every reduction of the gradients so far visible in the grad shards (the current stream waits)."""
        if self._round_open:
            self._close_round()
        if self.stage == 1 and self._unreduced:
            # Backward ran only under no_sync(): reduce the accumulated gradients now.
            self._close_round()
        self._wait_inflight()

    def _wait_inflight(self) -> None:
        for entry in self._inflight:
            entry.pending.wait()
            entry.pending = None
        self._inflight.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.finish()
        self.stepped_since_zero_grad = False
        for g, buf in zip(self.groups, self.grad_buffers):
            if buf is not None:
                if set_to_none:
                    # No pass over the buffer: the next gradient is copied into its slot (see _on_grad), and a
                    # slot whose parameter still has no gradient at launch is zeroed then (_settle_missing).
                    for p in g.params:
                        p.grad = None
                else:
                    buf.zero_()
            g.grad_shard.zero_()
