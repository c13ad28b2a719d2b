"""Gradient reduction during backward: from autograd's gradients to this rank's fp32 grad shard, bucket by bucket.

A post-accumulate-grad hook on every parameter hands the gradient to the stage's strategy (``grads.py``) and
counts it against its bucket (a parameter split across buckets, ``zero_ext/layout.py``: a fragment against each). A bucket
whose gradients have all arrived is READY; READY buckets are launched (``start_grad_sync``) in one fixed global order on every rank (a bucket that completes early waits for its
predecessors), so the collectives of all ranks always pair up, whatever order gradients arrive in. At the end of
each backward pass (autograd's final callback) the buckets still open are launched too, their missing gradients
counting as zero. ``finish_grad_sync`` makes every reduction so far visible in the grad shards.

Each bucket's gradient phase is its :class:`zero_ext.engine.bucket_runtime.BucketRuntime`'s ``grad`` (one round = one
synchronised backward pass; the diagram and the legal moves are there): EMPTY, FILLING, READY, SYNCING (its
reduce-scatter in flight, held by the bucket), SYNCED. A reduction of an earlier round still in flight when the
bucket launches again is waited for first, so each bucket's reductions land in order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..state.sharded_state import FlatGroup, ShardedState
from .bucket_runtime import BucketRuntime, GradState
from .grad_placeholders import GradPlaceholders
from .grads import GradStrategy
from .runtime import BucketRuntimes
from .sleep import ASLEEP, refuse_if_asleep
from .weak_hooks import remove_all, remove_with, weak_call


class GradSync:
    """Hooks, rounds and the bucket launch order; what a gradient does on arrival is the strategy's business."""

    def __init__(self, state: ShardedState, runtimes: BucketRuntimes, strategy: GradStrategy, stage):
        """``stage``: the stage object (``engine.stages``), which the placeholders ask what ``.grad`` is."""
        self.state, self.strategy, self.comm = state, strategy, state.comm
        self.buckets = runtimes.in_launch_order()
        self.pool = runtimes.staging
        self._size_pool()
        self.sync_enabled = True
        self.on_ready = None  # called with each BucketRuntime whose gradients have all arrived (stage 3 frees it)
        self.on_round_end = None  # called at the end of every backward pass
        self.epoch = 0  # changes whenever the gradients may have: the step's agreement is cached per epoch
        self._round_open = False
        self._next = 0  # position in launch order of the next bucket to launch this round
        self._hooks = []
        self._hook(state.groups, runtimes)
        remove_with(self, self._hooks)  # dropped without close(): the model's hooks go with it (added ones too)
        # .grad after a synchronised backward: placeholders of the sharded mean gradients (torch's clipping works)
        self.placeholders = GradPlaceholders(state, self, stage)

    def extend(self, added: Sequence[FlatGroup], runtimes: BucketRuntimes) -> None:
        """Flat groups ``added`` (``add_param_group``; ``runtimes`` already holds their buckets): their buckets take their
        places in the launch order, the staging pool is sized for them too, their parameters get the hooks, the
        strategy and the placeholders their share. Nothing is in flight and no round is open (the caller finished every
        sync); what is recorded (gradients not yet applied, ``no_sync()``, clipping) stays."""
        self.placeholders.extend(added)  # (first: scaling recorded on the others reaches them before anything moves)
        self.strategy.extend(added)
        self.buckets = runtimes.in_launch_order()
        self._size_pool()
        self._hook(added, runtimes)
        self.epoch += 1  # more parameters: the step's agreement and the norms are made again

    def _size_pool(self) -> None:
        """Staging entries for the largest bucket's send buffer and the communicator's workspace."""
        strategy = self.strategy
        send = max((gb.bucket.numel * strategy.send_bytes(gb.group) for gb in self.buckets), default=0)
        workspace = 0
        if self.comm.communicates:
            workspace = max(
                (
                    self.comm.workspace_bytes(
                        gb.bucket.numel, strategy.wire_dtype(gb.group), strategy.reduce_dtype, strategy.accumulate
                    )
                    for gb in self.buckets
                ),
                default=0,  # no trainable parameter: no bucket
            )
        self.pool.size(send, workspace)

    def _hook(self, groups: Sequence[FlatGroup], runtimes: BucketRuntimes) -> None:
        """A post-accumulate-grad hook on every parameter of ``groups``, bound to its bucket's runtime."""
        by_key = runtimes.buckets
        for group in groups:
            for slot, p in zip(group.layout.slots, group.params):
                if slot.split:  # one gradient, a fragment for each of its buckets
                    gbs = tuple(by_key[(group.index, b)] for b in slot.buckets)
                    hook = weak_call(self._on_split_grad, gbs, slot)
                else:
                    hook = weak_call(self._on_grad, by_key[(group.index, slot.bucket)], slot)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        remove_all(self._hooks)

    # ---------------------------------------------------------------- backward
    @torch.compiler.disable
    def _on_grad(self, gb: BucketRuntime, slot, param: torch.Tensor) -> None:
        if self.state in ASLEEP:  # offload_states() parked the state (sleep.py)
            refuse_if_asleep(self.state, "a backward reached the gradient hooks")
        self.epoch += 1
        if self.placeholders.active:  # the gradients change from here: the placeholders go first
            self.placeholders.on_backward()
        if not self.strategy.on_grad(gb, slot, param, self.sync_enabled):
            return
        self._open_round()
        if gb.grad_arrived():  # READY
            if self.on_ready is not None:
                self.on_ready(gb)
            self._launch_ready()

    @torch.compiler.disable
    def _on_split_grad(self, gbs: tuple[BucketRuntime, ...], slot, param: torch.Tensor) -> None:
        """The gradient of a parameter split across ``gbs``: one fragment arrives in each (each bucket counts its
        fragments); the strategy writes a fragment when its bucket launches, so staging stays bucket-sized."""
        if self.state in ASLEEP:  # offload_states() parked the state (sleep.py)
            refuse_if_asleep(self.state, "a backward reached the gradient hooks")
        self.epoch += 1
        if self.placeholders.active:
            self.placeholders.on_backward()
        if not self.strategy.on_split_grad(gbs, slot, param, self.sync_enabled):
            return
        self._open_round()
        for gb in gbs:
            if gb.grad_arrived() and self.on_ready is not None:
                self.on_ready(gb)
        self._launch_ready()

    def _open_round(self) -> None:
        if self._round_open:
            return
        self._round_open = True
        if not self.comm.position.phase.startswith("backward"):  # stages 1, 2 (stage 3's hooks name the module)
            self.comm.position.at("backward")
        for gb in self.buckets:
            gb.move_grad(GradState.EMPTY)
            gb.arrived = 0
        self._next = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._close_round)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].grad is GradState.READY:
            self.start_grad_sync(self.buckets[self._next])
            self._next += 1

    @torch.compiler.disable
    def _close_round(self) -> None:
        """End of a backward pass: launch every bucket not launched yet (missing gradients are zero)."""
        for gb in self.buckets[self._next :]:
            if gb.grad is not GradState.READY:
                gb.move_grad(GradState.READY)
        self._launch_ready()
        self._round_open = False
        self.strategy.end_round()
        if self.on_round_end is not None:
            self.on_round_end()
        if getattr(self.strategy, "waits_at_round_end", False):
            self.wait_inflight()
        self.placeholders.install()

    def start_grad_sync(self, gb: BucketRuntime) -> None:
        """Launch ``gb``'s reduce-scatter into its grad shard: the bucket does it all (the strategy writes what goes
        on the wire, the pool lends the staging); the reducer only chose when."""
        gb.start_grad_sync(self.comm, self.strategy, self.pool)

    def finish_grad_sync(self) -> None:
        """Make every reduction of the gradients so far visible in the grad shards (the current stream waits)."""
        if self._round_open:
            self._close_round()
        if self.strategy.unreduced:  # backward ran only under no_sync(): reduce the accumulated gradients now
            self._open_round_without_backward()
        self.wait_inflight()
        if self.comm.held_keys():  # a mesh under no_sync(): the node-reduced sums cross nodes now
            self._release_held()

    def _release_held(self) -> None:
        held = self.comm.held_keys()
        for gb in self.buckets:
            if gb.key in held:
                gb.release_held(self.comm)
        self.wait_inflight()

    def _open_round_without_backward(self) -> None:
        for gb in self.buckets:
            gb.move_grad(GradState.READY)
            gb.arrived = 0
        self._next = 0
        self._launch_ready()
        self.strategy.end_round()

    def reduce_hand_grads(self, hand: dict, union: set[int]) -> None:
        """Collective: reduce the gradients assigned by hand (``hand``: this rank's, (group, slot) -> tensor; ``union``:
        the global indices of the parameters with one on some rank, agreed) into the grad shards, every bucket
        holding one in launch order (``hand_grads.py``). Nothing is in flight (the step finished every sync)."""
        chosen = [gb for gb in self.buckets if any(gb.group.param_indices[i] in union for i in gb.bucket.slots)]
        for gb in chosen:
            gb.move_grad(GradState.READY)
            self.strategy.load_hand(gb, hand)
            self.start_grad_sync(gb)
        self.wait_inflight()
        self.strategy.end_round()
        self.epoch += 1

    def wait_inflight(self) -> None:
        self.pool.wait_all()  # in launch order: each entry is reused only once its collective is done
        for gb in self.buckets:
            if gb.grad is GradState.SYNCING:
                gb.finish_grad_sync()
            else:
                gb.wait_grad()  # a reduction of an earlier round (SYNCING when its round ended)
        for group in self.state.groups:
            group.state.finish_landing()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.comm.drop_held()  # gradients held inside the node (a mesh's no_sync) are dropped with the others
        self.placeholders.zero_grad()
        self.finish_grad_sync()
        self.strategy.zero_grad(set_to_none)
        self.epoch += 1

    def after_step(self) -> None:
        self.strategy.after_step()
        self.placeholders.after_step()
        self.epoch += 1
