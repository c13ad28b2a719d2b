"""Gradient reduction during backward: from autograd's gradients to this rank's fp32 grad shard, bucket by bucket.

A post-accumulate-grad hook on every parameter hands the gradient to the stage's strategy (``grads.py``) and
counts it against its bucket. A bucket whose gradients have all arrived is READY; READY buckets are launched
(``start_grad_sync``) in one fixed global order on every rank (a bucket that completes early waits for its
predecessors), so the collectives of all ranks always pair up, whatever order gradients arrive in. At the end of
each backward pass (autograd's final callback) the buckets still open are launched too, their missing gradients
counting as zero. ``finish_grad_sync`` makes every reduction so far visible in the grad shards.

A bucket's status describes the current round (one synchronised backward pass)::

    EMPTY --first gradient--> FILLING --last gradient--> READY --its turn--> SYNCING --finish_grad_sync--> SYNCED
      |______________________ end of backward (missing gradients are zero) __^

Collectives of an earlier round still in flight when a new round starts are tracked by the staging pool.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from .buffers import FlatGroup, ShardedState
from .comm import Pending
from .grads import GradStrategy
from .layout import Bucket
from .staging import StagingEntry, StagingPool
from .weak_hooks import remove_all, remove_with, weak_call


class BucketStatus(enum.Enum):
    EMPTY = "empty"  # no gradient of this round has arrived
    FILLING = "filling"  # some have
    READY = "ready"  # all have (or the round is closing); launched when every bucket before it in order is
    SYNCING = "syncing"  # its reduce-scatter is in flight
    SYNCED = "synced"  # its mean is in the grad shard


class GradBucket:
    """One bucket's gradient reduction: its place in the launch order and its status this round."""

    __slots__ = ("group", "bucket", "order", "status", "arrived", "staging")

    def __init__(self, group: FlatGroup, bucket: Bucket, order: int):
        self.group, self.bucket, self.order = group, bucket, order
        self.status = BucketStatus.EMPTY
        self.arrived = 0  # gradients counted this round
        self.staging: Optional[StagingEntry] = None  # the pool entry it fills or sends from


class GradSync:
    """Hooks, rounds and the bucket launch order; what a gradient does on arrival is the strategy's business."""

    def __init__(self, state: ShardedState, strategy: GradStrategy, pool_capacity: int = 2):
        self.state, self.strategy, self.comm = state, strategy, state.comm
        self.buckets = [GradBucket(g, b, order) for order, (g, b) in enumerate(state.launch_order())]
        send = max((gb.bucket.numel * strategy.send_bytes(gb.group) for gb in self.buckets), default=0)
        workspace = 0
        if self.comm.communicates:
            workspace = max(
                self.comm.workspace_bytes(
                    gb.bucket.numel, strategy.wire_dtype(gb.group), strategy.reduce_dtype, strategy.accumulate
                )
                for gb in self.buckets
            )
        self.pool = StagingPool(send, workspace, min(pool_capacity, len(self.buckets)), state.device)
        strategy.pool = state.staging = self.pool
        self.sync_enabled = True
        self.on_ready = None  # called with each bucket whose gradients have all arrived (stage 3 frees its params)
        self.on_round_end = None  # called at the end of every backward pass
        self.epoch = 0  # changes whenever the gradients may have: the step's agreement is cached per epoch
        self._round_open = False
        self._next = 0  # position in launch order of the next bucket to launch this round
        self._inflight: list[Pending] = []  # collectives with no staging entry to track them
        by_key = {(gb.group.index, gb.bucket.index): gb for gb in self.buckets}
        self._hooks = []
        for group in state.groups:
            for slot, p in zip(group.layout.slots, group.params):
                gb = by_key[(group.index, slot.bucket)]
                self._hooks.append(p.register_post_accumulate_grad_hook(weak_call(self._on_grad, gb, slot)))
        remove_with(self, self._hooks)  # dropped without close(): the model's hooks go with it

    def remove_hooks(self) -> None:
        remove_all(self._hooks)

    # ---------------------------------------------------------------- backward
    @torch.compiler.disable
    def _on_grad(self, gb: GradBucket, slot, param: torch.Tensor) -> None:
        self.epoch += 1
        if not self.strategy.on_grad(gb, slot, param, self.sync_enabled):
            return
        self._open_round()
        gb.arrived += 1
        gb.status = BucketStatus.READY if gb.arrived >= len(gb.bucket.slots) else BucketStatus.FILLING
        if gb.status is BucketStatus.READY:
            if self.on_ready is not None:
                self.on_ready(gb.group.index, gb.bucket.index)
            self._launch_ready()

    def _open_round(self) -> None:
        if self._round_open:
            return
        self._round_open = True
        for gb in self.buckets:
            gb.status, gb.arrived = BucketStatus.EMPTY, 0
        self._next = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._close_round)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].status is BucketStatus.READY:
            self.start_grad_sync(self.buckets[self._next])
            self._next += 1

    @torch.compiler.disable
    def _close_round(self) -> None:
        """End of a backward pass: launch every bucket not launched yet (missing gradients are zero)."""
        for gb in self.buckets[self._next :]:
            gb.status = BucketStatus.READY
        self._launch_ready()
        self._round_open = False
        self.strategy.end_round()
        if self.on_round_end is not None:
            self.on_round_end()
        if getattr(self.strategy, "waits_at_round_end", False):
            self.wait_inflight()

    def start_grad_sync(self, gb: GradBucket) -> None:
        """Launch ``gb``'s reduce-scatter into its grad shard (the strategy says what goes on the wire)."""
        send = self.strategy.send(gb)
        if send is not None:
            entry = gb.staging
            placement = gb.group.state
            target, direct = placement.grad_target(gb.bucket)  # the grad shard, or a landing buffer (offload)
            pending = self.comm.start_reduce_scatter(
                send,
                target,
                reduce_dtype=self.strategy.reduce_dtype,
                accumulate=self.strategy.accumulate and direct,
                workspace=None if entry is None else entry.workspace(),
            )
            if not direct:
                placement.landed(gb.bucket, target, pending, self.strategy.accumulate)
            if entry is None:
                self._inflight.append(pending)
            else:
                self.pool.launched(entry, pending)
        gb.staging = None
        gb.status = BucketStatus.SYNCING

    def finish_grad_sync(self) -> None:
        """Make every reduction of the gradients so far visible in the grad shards (the current stream waits)."""
        if self._round_open:
            self._close_round()
        if self.strategy.unreduced:  # backward ran only under no_sync(): reduce the accumulated gradients now
            self._open_round_without_backward()
        self.wait_inflight()

    def _open_round_without_backward(self) -> None:
        for gb in self.buckets:
            gb.status, gb.arrived = BucketStatus.READY, 0
        self._next = 0
        self._launch_ready()
        self.strategy.end_round()

    def wait_inflight(self) -> None:
        self.pool.wait_all()
        for pending in self._inflight:
            pending.wait()
        self._inflight.clear()
        for group in self.state.groups:
            group.state.finish_landing()
        for gb in self.buckets:
            if gb.status is BucketStatus.SYNCING:
                gb.status = BucketStatus.SYNCED

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.finish_grad_sync()
        self.strategy.zero_grad(set_to_none)
        self.epoch += 1

    def after_step(self) -> None:
        self.strategy.after_step()
        self.epoch += 1
