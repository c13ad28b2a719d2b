"""Gradient reduction during backward: from autograd's gradients to this rank's fp32 grad shard, bucket by bucket.

A post-accumulate-grad hook on every parameter hands the gradient to the stage's strategy (``grads.py``) and
counts it against its bucket (a parameter split across buckets, ``zero_ext/layout.py``: a fragment against each). A
bucket whose gradients have all arrived is READY; READY buckets are launched (``start_grad_sync``) in one fixed global
order on every rank (a bucket that completes early waits for its predecessors), so the collectives of all ranks always pair up, whatever order gradients arrive in. At the end of
each backward pass (autograd's final callback) the buckets still open are launched too, their missing gradients
counting as zero. ``finish_grad_sync`` makes every reduction so far visible in the grad shards.

Each bucket's gradient phase is its :class:`zero_ext.engine.bucket_runtime.BucketRuntime`'s ``grad`` (one round = one
synchronised backward pass; the diagram and the legal moves: ``bucket_states.py``): EMPTY, FILLING, READY, SYNCING
(its reduce-scatter in flight, held by the bucket), SYNCED. A reduction of an earlier round still in flight when the
bucket launches again is waited for first, so each bucket's reductions land in order. The reducer learns what it
needs from what the bucket's verbs return (READY, launched, the elements released): a gradient that completes the
bucket whose turn it is launches it in the same call (``take``), and nothing asks a bucket its phase again.

Gradients assigned by hand (``p.grad = tensor``, no backward), which torch's AdamW applies as it finds them. The
engine's own gradients reach it through autograd's hooks; a ``.grad`` the user assigned never passes one. At
``step()`` every rank looks for them (:func:`find_hand_grads`: a ``.grad`` that is not the engine's: at stages 2 and 3
any, since the engine frees every gradient it reduces; at stage 1 one that is not the parameter's view of the flat
grad buffer) and says which parameters have one in the step's flag collective, so every rank learns the union
without a collective of its own. When the union is not empty every rank reduces, bucket by bucket in launch order,
the buckets holding one (:meth:`GradSync.reduce_hand_grads`), through the same bucket runtimes as backward's:

- stage 1: the hand gradient's values are copied into the parameter's slot of the flat buffer (``.grad`` stays the
  user's tensor) and the whole bucket is reduced again, overwriting its grad shard as every stage-1 reduction does;
- stages 2 and 3: the hand gradients alone are written into the bucket's staging buffer (zeros elsewhere) and their
  mean is added to the grad shard, to what backward reduced for the other parameters.

So the step applies the mean over the ranks, a rank without a hand gradient for the parameter counting as zero, as a
rank on which a parameter got no gradient in backward does (DDP with ``find_unused_parameters`` averages the same way):
no rank waits for another. The user's tensor is never replaced nor written into, and stays ``.grad`` until
``zero_grad()``, as in torch (so the next ``step()`` applies it again, as torch would).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..state.sharded_state import FlatGroup, ShardedState
from .bucket_runtime import BucketRuntime, GradState
from .grad_placeholders import GradPlaceholders
from .grads import GradStrategy, dense_grad
from .runtime import BucketRuntimes
from .sleep import ASLEEP, refuse_if_asleep
from .weak_hooks import remove_all, remove_with, weak_call

# NOTE: 2^24 elements (32 MiB of bf16): writing once per 16M elements is one call per many parameters for any model,
# while the hold stays small next to a large model's buckets (the NCCL default cuts the model in 8).
HOLD_ELEMENTS = 1 << 24


class GradSync:
    """Hooks, rounds, the bucket launch order and the bound on held gradients; what a gradient does on arrival is
    its bucket's business, with the stage's policy (``grads.py``) that the bucket calls."""

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
        self._phase = None  # the phase the round's first launch names (_open_round)
        self._next = 0  # position in launch order of the next bucket to launch this round
        # The buckets holding gradients in .grad, oldest first (order -> bucket), and the elements they hold: at
        # most HOLD_ELEMENTS, beyond which the oldest bucket writes its own (see below)
        self._holding: dict[int, BucketRuntime] = {}
        self._held = 0
        self._ready: set[int] = set()  # launch positions of the buckets that reported READY this round
        self._arrived = False  # a gradient arrived since the last step() or zero_grad() (the policy's shards moved)
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
                        gb.bucket.numel, gb.wire_dtype, strategy.reduce_dtype, strategy.accumulate
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
    def _arriving(self) -> None:
        """Every gradient hook first: refused while asleep; the placeholders go before the first gradient changes."""
        if self.state in ASLEEP:  # offload_states() parked the state (sleep.py)
            refuse_if_asleep(self.state, "a backward reached the gradient hooks")
        self.epoch += 1
        # (inside an open round the first gradient's hook did this already: nothing records scaling in backward)
        if not self._round_open and self.placeholders.armed:  # the gradients change from here: they go first
            self.placeholders.on_backward()

    @torch.compiler.disable
    def _on_grad(self, gb: BucketRuntime, slot, param: torch.Tensor) -> None:
        self._arriving()
        strategy = self.strategy
        if not strategy.holds:  # (stage 1's buffer: .grad is its slot)
            if not strategy.on_grad(gb.group, slot, param, self.sync_enabled):
                return
            self._open_round()
            if gb.grad_arrived():
                self._ready_now((gb,))
            return
        grad = param.grad
        if grad.layout is not torch.strided:
            dense_grad(param, gb.group.names[slot.index], self.state.optimizer_name)
        if not self.sync_enabled and strategy.keeps_unsynced:  # inside no_sync() no launch comes to write it
            self._let_go_all()
            strategy.keep_unsynced(gb.group, slot, param)
            return
        self._arrived = True
        self._open_round()
        # Its turn in the launch order: a gradient that completes it launches it in the same call (and stage 3's
        # on_ready frees its parameters right after)
        turn = self.comm if gb.order == self._next else None
        first, ready, released = gb.take(slot, param, grad, strategy, self.pool, turn)
        if released is not None:  # (the bound counted what it held before this one)
            self._launched(gb, released - (slot.numel if first else 0))
        elif first:
            self._hold(gb, slot.numel)
        if ready:
            self._ready_now((gb,), launched=released is not None)

    @torch.compiler.disable
    def _on_split_grad(self, gbs: tuple[BucketRuntime, ...], slot, param: torch.Tensor) -> None:
        """The gradient of a parameter split across ``gbs``: one fragment arrives in each (each bucket counts its
        fragments); each bucket writes its fragment when it launches, so staging stays bucket-sized. A policy that
        keeps gradients whole (stage 1's buffer) takes it with the first bucket, which launches before the others."""
        strategy = self.strategy
        self._arriving()
        if not strategy.consumes:
            head = gbs[0]
            if not strategy.holds:
                if not strategy.on_grad(head.group, slot, param, self.sync_enabled):
                    return
                self._open_round()
                ready = [head] if head.grad_arrived() else []  # (the others below)
            else:
                grad = param.grad
                if grad.layout is not torch.strided:
                    dense_grad(param, head.group.names[slot.index], self.state.optimizer_name)
                if not self.sync_enabled:  # keeps_unsynced
                    self._let_go_all()
                    strategy.keep_unsynced(head.group, slot, param)
                    return
                self._arrived = True
                self._open_round()
                first, head_ready, _ = head.take(slot, param, grad, strategy, self.pool)
                if not first:  # a second gradient this round: counted already
                    return
                self._hold(head, slot.numel)
                ready = [head] if head_ready else []
            ready += [gb for gb in gbs[1:] if gb.grad_arrived()]
        else:
            grad = dense_grad(param, gbs[0].group.names[slot.index], self.state.optimizer_name)
            self._arrived = True
            first = gbs[0].arrive_split(slot)
            param.grad = None  # kept here until written: a second gradient this round arrives on its own
            flat = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
            if strategy.fragments:
                for gb in gbs:
                    gb.take_fragment(slot, flat, first, strategy, self.pool)
            else:
                strategy.add_split(gbs[0].group, slot, flat)
            if not first:
                return
            self._open_round()
            ready = [gb for gb in gbs if gb.grad_arrived()]
        self._ready_now(ready)

    def _ready_now(self, ready, launched: bool = False) -> None:
        """Buckets ``ready`` reported READY (``launched``: the one of them whose turn it was launched already):
        stage 3 frees their parameters, and the READY buckets whose turn has come launch."""
        self._ready.update(gb.order for gb in ready)
        if launched:
            self._next += 1
        if self.on_ready is not None:
            for gb in ready:
                self.on_ready(gb)
        self._launch_ready()

    def _hold(self, gb: BucketRuntime, numel: int) -> None:
        """``gb`` holds ``numel`` more elements in .grad: beyond ``HOLD_ELEMENTS`` in all, the oldest buckets write
        theirs now (into a staging entry, held until they launch). When buckets fill one after another that is one
        bucket's gradients; a parameter larger than that is written at once (autograd produced it whole anyway)."""
        self._holding.setdefault(gb.order, gb)
        self._held += numel
        while self._held >= HOLD_ELEMENTS:
            self._held -= self._holding.pop(next(iter(self._holding))).let_go(self.strategy, self.pool)

    def _let_go_all(self) -> None:
        """Every held gradient written, oldest bucket first."""
        while self._holding:
            self._held -= self._holding.pop(next(iter(self._holding))).let_go(self.strategy, self.pool)

    def _open_round(self) -> None:
        if self._round_open:
            return
        self._round_open = True
        # Stages 1 and 2 (stage 3's hooks name the phase and module): the round's first reduce-scatter says
        # "backward" to the position (comm/base.py), so that no gradient hook calls into comm to say it itself.
        self._phase = None if self.comm.position.phase.startswith("backward") else "backward"
        for gb in self.buckets:
            gb.begin_round()
        self._next = 0
        self._ready.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self._close_round)

    def _launch_ready(self) -> None:
        while self._next in self._ready:
            self.start_grad_sync(self.buckets[self._next])
            self._next += 1

    def _end_round(self) -> None:
        """The round's reductions were all launched: what is still held is written (nothing: every bucket launched;
        kept for safety), the buckets forget the slots they saw, then the policy."""
        self._let_go_all()
        for gb in self.buckets:
            gb.end_round()
        self.strategy.end_round()

    @torch.compiler.disable
    def _close_round(self) -> None:
        """End of a backward pass: launch every bucket not launched yet (missing gradients are zero)."""
        for gb in self.buckets[self._next :]:
            if gb.order not in self._ready:
                gb.close()
                self._ready.add(gb.order)
        self._launch_ready()
        self._round_open = False
        self._end_round()
        if self.on_round_end is not None:
            self.on_round_end()
        if self.strategy.waits_at_round_end:
            self.wait_inflight()
        self.placeholders.install()

    def start_grad_sync(self, gb: BucketRuntime) -> None:
        """Launch ``gb``'s reduce-scatter into its grad shard: the bucket does it all (its policy says what goes on
        the wire, the pool lends the staging); the reducer only chose when."""
        phase, self._phase = self._phase, None
        self._launched(gb, gb.start_grad_sync(self.comm, self.strategy, self.pool, phase))

    def _launched(self, gb: BucketRuntime, released: int) -> None:
        """``gb`` launched, releasing ``released`` elements it held in .grad (counted in the bound)."""
        if self._holding.pop(gb.order, None) is not None:
            self._held -= released

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
            gb.reopen()
        self._next = 0
        self._ready = set(range(len(self.buckets)))
        self._launch_ready()
        self._end_round()

    def reduce_hand_grads(self, hand: dict, union: set[int]) -> None:
        """Collective: reduce the gradients assigned by hand (``hand``: this rank's, (group, slot) -> tensor; ``union``:
        the global indices of the parameters with one on some rank, agreed) into the grad shards, every bucket
        holding one in launch order (:func:`find_hand_grads`). Nothing is in flight (the step finished every sync)."""
        chosen = [gb for gb in self.buckets if any(gb.group.param_indices[i] in union for i in gb.bucket.slots)]
        for gb in chosen:
            gb.load_hand(hand, self.strategy, self.pool)
            self.start_grad_sync(gb)
        self.wait_inflight()
        self._end_round()
        self.epoch += 1

    def find_hand_grads(self) -> "HandGrads":
        """This rank's gradients assigned by hand, for the step's agreement (:func:`find_hand_grads`)."""
        return find_hand_grads(self.state, self.strategy)

    def wait_inflight(self) -> None:
        self.pool.wait_all()  # in launch order: each entry is reused only once its collective is done
        for gb in self.buckets:
            if gb.grad is GradState.SYNCING:
                gb.finish_grad_sync()
            else:
                gb.wait_grad()  # a reduction of an earlier round (SYNCING when its round ended)
        for group in self.state.groups:
            group.state.finish_landing()

    # ---------------------------------------------------------------- which parameters have a gradient
    def got_grads(self) -> set[int]:
        """Global indices of the parameters with a gradient on this rank for the next ``step()``: those the buckets
        saw arrive since the gradients were last consumed, and those the policy keeps otherwise."""
        got = self.strategy.got_grads()
        for gb in self.buckets:
            got.update(gb.got())
        return got

    def forget(self, gidxs: list[int]) -> None:
        """The user dropped these parameters' gradients: none for the next ``step()``."""
        self.strategy.forget(gidxs)
        gone = set(gidxs)
        for gb in self.buckets:
            gb.forget(gone)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.comm.drop_held()  # gradients held inside the node (a mesh's no_sync) are dropped with the others
        self.placeholders.zero_grad()
        self.finish_grad_sync()
        zero_hand_grads(self.state, self.strategy, set_to_none)  # a .grad assigned by hand, as torch zeroes it
        self.strategy.zero_grad(set_to_none, self._arrived)
        self._arrived = False
        if set_to_none:  # (zeroed in place, a gradient is still applied, as zero)
            for gb in self.buckets:
                gb.consumed()
        self.epoch += 1

    def after_step(self) -> None:
        self.strategy.after_step()
        self._arrived = False
        if self.strategy.consumes:
            for gb in self.buckets:
                gb.consumed()
        self.placeholders.after_step()
        self.epoch += 1


# (flat group index, slot index) -> the hand-assigned gradient
HandGrads = dict[tuple[int, int], torch.Tensor]


def plain_params():
    """Stage 3's parameters read ``.grad`` without their ``__torch_function__`` (metadata only here)."""
    return torch._C.DisableTorchFunctionSubclass()


def _user_grads(state: ShardedState, strategy):
    """``(group, slot, param, grad)`` for every ``.grad`` the engine does not own (``strategy.owns_grad`` tells its
    own apart); the caller holds :func:`plain_params`."""
    for group in state.groups:
        for slot, p in zip(group.layout.slots, group.params):
            grad = p.grad
            if grad is not None and not strategy.owns_grad(group, slot, grad):
                yield group, slot, p, grad


def find_hand_grads(state: ShardedState, strategy) -> HandGrads:
    """This rank's hand-assigned gradients (``step()`` looks for them, see the module docstring)."""
    found: HandGrads = {}
    with plain_params():
        for group, slot, _, grad in _user_grads(state, strategy):
            if grad.layout is not torch.strided:
                raise RuntimeError(
                    f"zero_ext.ZeroAdamW: parameter {group.names[slot.index]!r} has a {grad.layout} gradient; only "
                    "dense gradients are supported"
                )
            found[(group.index, slot.index)] = grad
    return found


def zero_hand_grads(state: ShardedState, strategy, set_to_none: bool) -> None:
    """``zero_grad()`` on the gradients the engine does not own, as torch's: None, or zeroed in place."""
    with plain_params():
        for _, _, p, grad in _user_grads(state, strategy):
            if set_to_none:
                p.grad = None
            else:  # torch.optim.Optimizer.zero_grad's in-place branch
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()
