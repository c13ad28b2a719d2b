"""How a gradient gets from autograd to the wire: the gradient half of a stage's strategy.

- :class:`BufferedGrads` (stage 1): a persistent flat grad buffer per group; ``param.grad`` is a view into it,
  so autograd accumulates in place. At launch a bucket's slice is sent as it is (when the communicator's wire
  dtype is the gradient's and nothing is pre-scaled: gloo with an fp32 mean) or cast and pre-scaled into a
  staging buffer; the mean overwrites the bucket's grad shard. Inside ``no_sync()`` nothing is reduced; the
  next synchronised backward (or ``step()``) reduces the accumulated sum.
- :class:`StagedGrads` (stages 2 and 3): no full-size buffer. A bucket's gradients are cast and pre-scaled into
  its staging buffer, all in one call when the bucket launches (the bucket holds them in ``param.grad`` until then),
  then freed (``param.grad = None``); the mean is added to the grad shard in fp32, so several backward passes before
  ``step()`` accumulate. There is no buffer to accumulate a full gradient in, so ``no_sync()`` still reduces every
  backward pass (as DeepSpeed's ZeRO-2).
- :class:`ShardGrads` (stages 2 and 3 on one process): nothing to communicate, so a bucket's gradients are added
  straight into their places in the grad shard, in one call when it launches.

A policy is chosen once per engine (``stages.py``) and called by the buckets
(:class:`~zero_ext.engine.bucket_runtime.BucketRuntime`) with values: a group, a bucket's layout, its send buffer,
the gradients it held; it writes them where the stage keeps gradients and returns what goes on the wire
(:meth:`GradStrategy.send`). It never calls a bucket back and keeps no bucket's state: which gradients a bucket holds,
its fragments and its lease are the bucket's; the reducer (:class:`zero_ext.engine.reducer.GradSync`) asks the policy
only what a stage decides for every bucket (``holds``, ``keeps_unsynced``, ``fragments``, ...). Which parameters have
a gradient for the next ``step()`` is the buckets' record plus what the policy keeps outside them (stage 1).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from ..kernels.dispatch import accumulate_into, add_flattened, cast_scale_into, flatten_into
from ..layout import Slot
from ..state.sharded_state import FlatGroup, ShardedState


class GradStrategy:
    """The gradient policy of a stage: values in, values out. Each bucket
    (:class:`~zero_ext.engine.bucket_runtime.BucketRuntime`) calls it with its group, layout and buffers; it never
    calls a bucket back nor keeps a bucket's state."""

    accumulate = False  # the reduced bucket is added to the grad shard (True) or overwrites it
    holds = False  # a bucket's gradients wait in .grad until it launches (written in one call)
    writes_to_staging = False  # ... into the bucket's staging send buffer (else into the policy's own buffers)
    fragments = False  # a split parameter's gradient goes to its buckets as fragments written at their launch
    keeps_unsynced = False  # inside no_sync() a gradient is kept by the policy at once (keep_unsynced), not counted
    consumes = False  # step() consumes the gradients (the buckets forget which parameters had one)
    waits_at_round_end = False  # a backward pass waits for its reductions before it returns

    def __init__(self, state: ShardedState, reduce_dtype: torch.dtype):
        self.state, self.comm, self.reduce_dtype = state, state.comm, reduce_dtype
        self._travels: dict[torch.dtype, tuple[torch.dtype, float]] = {}

    def _travel(self, dtype: torch.dtype) -> tuple[torch.dtype, float]:
        """How gradients of ``dtype`` travel: the wire dtype and the pre-scale, asked of the communicator once per
        dtype (both are fixed for its life), not at every launch."""
        travel = self._travels.get(dtype)
        if travel is None:
            comm, reduce = self.comm, self.reduce_dtype
            travel = self._travels[dtype] = (comm.wire_dtype(dtype, reduce), comm.prescale(dtype, reduce))
        return travel

    def wire_dtype(self, group: FlatGroup) -> torch.dtype:
        return self._travel(group.dtype)[0]

    def prescale(self, group: FlatGroup) -> float:
        return self._travel(group.dtype)[1]

    def send_bytes(self, group: FlatGroup) -> int:
        """Staging bytes per element of a bucket of ``group`` (0: sent without staging)."""
        return self.wire_dtype(group).itemsize

    def travel(self, group: FlatGroup) -> tuple[torch.dtype, float, bool]:
        """How a bucket of ``group`` travels, fixed for its life: (wire dtype, pre-scale, whether it is sent from a
        staging send buffer)."""
        return self.wire_dtype(group), self.prescale(group), self.send_bytes(group) > 0

    def on_grad(self, group: FlatGroup, slot: Slot, param: torch.Tensor, syncing: bool) -> bool:
        """A policy that does not hold (stage 1's buffer): a gradient arrived in ``param.grad``; returns whether it
        counts towards launching its bucket now."""
        raise NotImplementedError

    def keep_unsynced(self, group: FlatGroup, slot: Slot, param: torch.Tensor) -> None:
        """``keeps_unsynced``: inside ``no_sync()``, keep ``param``'s gradient now (no launch comes to write it)."""
        raise NotImplementedError

    def write(self, group: FlatGroup, bucket, send, slots: list[Slot], grads: list[torch.Tensor], prescale) -> None:
        """Write a bucket's held gradients ``grads`` (of ``slots``; ``send``: its staging send buffer when the policy
        ``writes_to_staging``)."""
        raise NotImplementedError

    def add_again(self, group: FlatGroup, bucket, send, slot: Slot, grad: torch.Tensor, prescale) -> None:
        """A second gradient for a slot already written this round: add it to what was written."""
        raise NotImplementedError

    def add_split(self, group: FlatGroup, slot: Slot, flat: torch.Tensor) -> None:
        """A split parameter's flattened gradient, when the policy takes it whole (not ``fragments``)."""
        raise NotImplementedError

    @staticmethod
    def write_fragment(view: torch.Tensor, values: torch.Tensor, add: bool, prescale: float) -> None:
        """``values`` cast and pre-scaled into ``view`` of a send buffer (``add``: added to what is there, in the wire
        dtype, as the first was written)."""
        if add:
            scaled = torch.empty_like(view)
            cast_scale_into(scaled, values, prescale)
            view.add_(scaled)
        else:
            cast_scale_into(view, values, prescale)

    def send(self, group: FlatGroup, bucket, view, held, fragments, complete: bool, prescale) -> Optional[torch.Tensor]:
        """What a launching bucket sends: its ``held`` gradients ((slots, grads) or None) and split ``fragments``
        written first, then the tensor that goes on the wire (``view``: the send buffer of the staging entry it
        leases, None when it travels as it is), or None when there is nothing to send. ``complete``: all its
        gradients arrived this round."""
        raise NotImplementedError

    @property
    def unreduced(self) -> bool:
        """Gradients accumulated under ``no_sync()`` and not reduced yet."""
        return False

    def got_grads(self) -> set[int]:
        """Global indices of the parameters that have a gradient on this rank for the next ``step()``, besides those
        the buckets recorded (torch updates exactly the parameters whose ``.grad`` is not None)."""
        return set()

    def check_no_foreign_grads(self) -> None:
        """Raise if gradients arrived where this stage never puts them (another reducer is in the loop)."""

    def owns_grad(self, group: FlatGroup, slot: Slot, grad: torch.Tensor) -> bool:
        """Whether ``grad``, the parameter's ``.grad`` outside backward, is the engine's own (else it was assigned by
        hand: ``reducer.py``). Stages 2 and 3 free every gradient they take: any ``.grad`` there is the user's."""
        return False

    def load_hand(self, group: FlatGroup, bucket, send, hand: dict, prescale) -> None:
        """Before a bucket is reduced again for gradients assigned by hand (``hand``: (group, slot) -> tensor, this
        rank's): put them where :meth:`send` sends them from, without writing into them or replacing ``.grad``."""

    def end_round(self) -> None:
        """A backward pass's reductions were all launched (and every held gradient written)."""

    def after_step(self) -> None:
        """``step()`` has read the grad shards."""

    def rescaled(self) -> None:
        """The gradients were scaled in place by the engine itself (``grad_placeholders.py``: torch's clipping)."""

    def forget(self, gidxs: list[int]) -> None:
        """The user dropped these parameters' gradients (``.grad`` set to None after backward,
        ``grad_placeholders.py``), whose pieces are being zeroed: they have no gradient for the next ``step()``."""

    def zero_grad(self, set_to_none: bool, arrived: bool) -> None:
        """``arrived``: a gradient arrived since the last step() or zero_grad(). (A ``.grad`` assigned by hand was
        zeroed first, by the reducer.)"""
        for group in self.state.groups:
            group.state.grad.zero_()

    def extend(self, added: Sequence[FlatGroup]) -> None:
        """Flat groups ``added`` (``add_param_group``; already in the state): what this strategy needs of them. What it
        holds of the others (gradients still to be applied, their reduction) stays; nothing is in flight."""


class ShardedGradStrategy(GradStrategy):
    """Stages 2 and 3: the gradients live only in the fp32 grad shard, so ``step()`` consumes them (zeroes the
    shard: the next backward starts from zero, whatever ``model.zero_grad()`` did or did not do). A bucket's
    gradients wait in ``.grad`` and are written at once when it launches (the bucket holds them)."""

    accumulate = True
    holds = True
    consumes = True

    def __init__(self, state: ShardedState, reduce_dtype: torch.dtype):
        super().__init__(state, reduce_dtype)
        self._clean = False  # the grad shards are zero (and no gradient arrived since: the reducer says)
        _drop_early_grads(state.groups, state.stage, "the optimizer existed", state.optimizer_name)

    def after_step(self) -> None:
        for group in self.state.groups:
            group.state.grad.zero_()
        self._clean = True

    def extend(self, added) -> None:
        _drop_early_grads(added, self.state.stage, "their param group was added", self.state.optimizer_name)

    def zero_grad(self, set_to_none: bool, arrived: bool) -> None:
        if arrived or not self._clean:  # after step() there is nothing to zero: no second pass over the shards
            super().zero_grad(set_to_none, arrived)
            self._clean = True


def dense_grad(param: torch.Tensor, name: str, who: str) -> torch.Tensor:
    grad = param.grad
    if grad.layout != torch.strided:
        raise RuntimeError(
            f"{who}: parameter {name!r} received a {grad.layout} gradient; only dense gradients are "
            "supported (use nn.Embedding(sparse=False))"
        )
    return grad


class BufferedGrads(GradStrategy):
    """Stage 1: a persistent flat grad buffer; the reduced bucket overwrites its grad shard."""

    def __init__(self, state: ShardedState, reduce_dtype: torch.dtype):
        super().__init__(state, reduce_dtype)
        self._unreduced = False
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (group, slot) -> its slot of the buffer, shaped
        # The grad buffers' version counters (which every .grad, a view of them, moves) when the last backward had
        # reduced them; None while the buffers hold gradients no reduction has read yet.
        self._reduced_at: Optional[list[int]] = None
        self._forgotten: dict[int, tuple[FlatGroup, Slot]] = {}  # gidx -> where: a .grad the user replaced?
        self._take(state.groups)

    def _take(self, groups: Sequence[FlatGroup]) -> bool:
        """Start keeping the gradients of ``groups`` in their flat buffers; returns whether one of their parameters
        brought a gradient (kept, not reduced yet)."""
        early = False
        for group in groups:
            if group.grad_buffer is None or group.grad_buffer.dtype != self.buffer_dtype(group):
                raise AssertionError(
                    f"{type(self).__name__}: flat group {group.index} was built without its grad buffer"
                )
            for slot, p in zip(group.layout.slots, group.params):
                if p.grad is not None:  # a gradient from before construction (or the group's adding) is kept
                    self._keep_early_grad(group, slot, p)
                    early = self._unreduced = True
                # else .grad stays None, as torch has it: the first gradient is copied into the slot (_adopt)
        # Sending straight from the grad buffer needs it untouched until the transfer is done, so every backward
        # pass then waits for its reductions before it returns (as DDP's backward does); step() would anyway.
        self.waits_at_round_end = any(not self._staged(g) for g in self.state.groups) and self.comm.communicates
        return early

    def extend(self, added) -> None:
        # .grad of the other parameters (views of their flat buffers) is as it was, reduced or not; an added
        # parameter's early gradient is not reduced yet, and the buffers' versions at the last reduction cover the
        # added ones from now (a change in place to the others' since then is still refused at step())
        kept = len(self.state.groups) - len(added)
        if self._take(added) or self._reduced_at is None:
            self._reduced_at = None
        else:
            self._reduced_at = self._reduced_at[:kept] + [g.grad_buffer._version for g in added]

    def buffer_dtype(self, group: FlatGroup) -> torch.dtype:
        return group.dtype  # the buffer is .grad's storage

    def _keep_early_grad(self, group: FlatGroup, slot: Slot, p: torch.Tensor) -> None:
        view = slot.param_range.of(group.grad_buffer).view(p.shape)
        view.copy_(p.grad)
        p.grad = view

    def wire_dtype(self, group: FlatGroup) -> torch.dtype:
        return self._travel(self.buffer_dtype(group))[0]

    def prescale(self, group: FlatGroup) -> float:
        return self._travel(self.buffer_dtype(group))[1]

    def _staged(self, group: FlatGroup) -> bool:
        return self.wire_dtype(group) != self.buffer_dtype(group) or self.prescale(group) != 1.0

    def send_bytes(self, group: FlatGroup) -> int:
        return self.wire_dtype(group).itemsize if self._staged(group) else 0

    def travel(self, group: FlatGroup) -> tuple[torch.dtype, float, bool]:
        return self.wire_dtype(group), self.prescale(group), self._staged(group)

    @property
    def unreduced(self) -> bool:
        return self._unreduced

    def got_grads(self) -> set[int]:
        # Stage 1 keeps torch's .grad: a parameter has a gradient while its .grad is not None (zero_grad with
        # set_to_none=False keeps zeros, which torch's AdamW applies too: decay and moments move).
        return {gidx for group in self.state.groups for gidx, p in zip(group.param_indices, group.params)
                if p.grad is not None}  # fmt: skip

    def on_grad(self, group, slot, param, syncing) -> bool:
        self._reduced_at = None
        self._adopt(group, slot, param, dense_grad(param, group.names[slot.index], self.state.optimizer_name))
        if not syncing:
            self._unreduced = True
        return syncing

    def owns_grad(self, group, slot, grad) -> bool:
        return grad.data_ptr() == slot.param_range.of(group.grad_buffer).data_ptr()

    def send(self, group, bucket, view, held, fragments, complete, prescale) -> torch.Tensor:
        if not complete:
            # Launched before all its parameters got a gradient this round: the slots of those parameters may hold
            # old gradients; make each hold what its .grad says (None: zero; a gradient assigned by hand is copied,
            # and stays the user's .grad: reducer.py).
            for i in bucket.slots:
                self._adopt(group, group.layout.slots[i], group.params[i], group.params[i].grad, keep=True)
        return self._stage(bucket.bucket_range.of(group.grad_buffer), view, prescale)

    @staticmethod
    def _stage(grads: torch.Tensor, view: Optional[torch.Tensor], prescale: float) -> torch.Tensor:
        """What goes on the wire for the bucket's slice ``grads`` of the buffer: the slice itself, or it cast and
        pre-scaled into ``view``, the send buffer of the staging entry the bucket leases (None: not staged)."""
        if view is None:
            return grads
        cast_scale_into(view, grads, prescale)
        return view

    def end_round(self) -> None:
        self._unreduced = False
        self._reduced_at = [g.grad_buffer._version for g in self.state.groups]
        self._forgotten.clear()  # every .grad is its slot again (adopted at launch)

    def forget(self, gidxs: list[int]) -> None:
        where = {g.param_indices[s.index]: (g, s) for g in self.state.groups for s in g.layout.slots}
        self._forgotten.update((gidx, where[gidx]) for gidx in gidxs)

    def check_no_foreign_grads(self) -> None:
        """A .grad changed in place after backward had reduced it (through a reference kept from before: ``.grad``
        itself is then a placeholder, grad_placeholders.py) would be silently ignored: the step applies the
        reduction. (A ``.grad`` replaced by another tensor is a gradient assigned by hand: reducer.py.)"""
        if self._reduced_at is None:
            return
        for group, version in zip(self.state.groups, self._reduced_at):
            if group.grad_buffer._version != version:
                raise ValueError(
                    "zero_ext.ZeroAdamW.step: a gradient (`.grad`) was changed in place after backward had already "
                    "reduced it into the optimizer's gradient shard (through a reference to `.grad` kept from before "
                    "that backward); the step applies the shard, so the change would be silently ignored. Clip with "
                    "opt.clip_grad_norm_(max_norm) or torch.nn.utils.clip_grad_norm_; change gradients in a hook "
                    "(param.register_hook) before they are reduced"
                )

    def after_step(self) -> None:
        super().after_step()
        self._reduced_at = None

    def rescaled(self) -> None:
        if self._reduced_at is not None:  # the engine's own change: the reduction still stands for the buffers
            self._reduced_at = [g.grad_buffer._version for g in self.state.groups]

    def _adopt(
        self, group: FlatGroup, slot: Slot, param: torch.Tensor, grad: Optional[torch.Tensor], keep: bool = False
    ) -> None:
        """Make ``param``'s slot of the flat grad buffer hold ``grad`` and ``param.grad`` a view of it. A slot
        holds the parameter's gradient only while ``param.grad`` is that view: after zero_grad() (or the user's
        own set-to-None) autograd hands over a fresh tensor, meaning "the previous value was zero", so it is copied
        over the slot; no gradient at all (None) is zero."""
        key = (group.index, slot.index)
        view = self._views.get(key)
        if view is None:  # made once: a view per gradient cost ~1 us of backward's host time per parameter
            view = self._views[key] = slot.param_range.of(group.grad_buffer).view(param.shape)
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if not keep:  # (``keep``: a gradient assigned by hand stays the user's tensor)
                param.grad = view

    def load_hand(self, group, bucket, send, hand, prescale) -> None:
        pass  # the bucket counts no gradient: send() copies every slot's .grad, hand-assigned ones included

    def zero_grad(self, set_to_none: bool, arrived: bool) -> None:
        super().zero_grad(set_to_none, arrived)
        self._reduced_at = None
        self._forgotten.clear()
        for group in self.state.groups:
            if set_to_none:
                # No pass over the buffer: the next gradient is copied into its slot (_adopt), and a slot whose
                # parameter still has no gradient at launch is zeroed then.
                for p in group.params:
                    p.grad = None
            else:
                group.grad_buffer.zero_()


class Fp32GradBuffer(BufferedGrads):
    """Stage 1 with ``grad_accum_dtype=torch.float32``: an fp32 flat grad buffer (Megatron's fp32 ``main_grad``).
    Each low-precision gradient is added to its slot in fp32 (a bucket's at once, when it launches: the bucket holds
    them in ``.grad`` until then) and ``param.grad`` is freed, so micro-batches accumulate in fp32 as stage 2's grad
    shard does, instead of in bf16 ``.grad``. The gradients live until ``zero_grad()``, as at stage 1."""

    holds = True
    keeps_unsynced = True

    def __init__(self, state: ShardedState, reduce_dtype: torch.dtype):
        self._got: set[int] = set()  # parameters whose gradient was kept outside a bucket (early, no_sync())
        super().__init__(state, reduce_dtype)

    def buffer_dtype(self, group: FlatGroup) -> torch.dtype:
        return torch.float32

    def _keep_early_grad(self, group: FlatGroup, slot: Slot, p: torch.Tensor) -> None:
        accumulate_into(slot.param_range.of(group.grad_buffer), p.grad)
        self._got.add(group.param_indices[slot.index])
        p.grad = None

    def got_grads(self) -> set[int]:
        return set(self._got)

    def forget(self, gidxs: list[int]) -> None:
        self._got.difference_update(gidxs)

    def owns_grad(self, group, slot, grad) -> bool:
        return False  # (its gradients live in the fp32 buffer; .grad is freed as they are added there)

    def load_hand(self, group, bucket, send, hand, prescale) -> None:
        for i in bucket.slots:
            grad = hand.get((group.index, i))
            if grad is not None:  # overwrites: a hand .grad replaced what the slot held (dropped placeholders zero it)
                group.layout.slots[i].param_range.of(group.grad_buffer).copy_(grad.reshape(-1))

    def keep_unsynced(self, group, slot, param) -> None:
        self._keep_early_grad(group, slot, param)
        self._unreduced = True

    def write(self, group, bucket, send, slots, grads, prescale) -> None:
        add_flattened(group.grad_buffer, grads, [s.offset for s in slots])

    def add_again(self, group, bucket, send, slot, grad, prescale) -> None:
        accumulate_into(slot.param_range.of(group.grad_buffer), grad)

    def send(self, group, bucket, view, held, fragments, complete, prescale) -> torch.Tensor:
        if held is not None:
            self.write(group, bucket, None, *held, prescale)
        # slots without a gradient hold what they accumulated
        return self._stage(bucket.bucket_range.of(group.grad_buffer), view, prescale)

    def zero_grad(self, set_to_none: bool, arrived: bool) -> None:
        GradStrategy.zero_grad(self, set_to_none, arrived)
        if set_to_none:  # (zeroed in place, a gradient is still applied, as zero)
            self._got.clear()
        for group in self.state.groups:
            group.grad_buffer.zero_()


class StagedGrads(ShardedGradStrategy):
    """Stages 2 and 3: a bucket's gradients go into its staging buffer, cast and pre-scaled, in one write when the
    bucket launches (they wait in ``.grad`` until then), then are freed.

    A split parameter's gradient (autograd made it whole) waits until each of its buckets launches, which writes
    its fragment into that bucket's staging entry: the pool's entries are reused in launch order, so staging stays
    ``staging_buffers`` buckets however large the parameter (writing every fragment at arrival would take one
    entry per fragment while the buckets before them in launch order are still filling). The gradient is freed
    with its last fragment's write."""

    writes_to_staging = True
    fragments = True

    def write(self, group, bucket, send, slots, grads, prescale) -> None:
        start = bucket.offset
        flatten_into(send, grads, [s.offset - start for s in slots], prescale)

    def add_again(self, group, bucket, send, slot, grad, prescale) -> None:
        # (the whole parameter: its bucket's only fragment)
        self.write_fragment(bucket.slot_range(slot).of(send), grad, True, prescale)

    def load_hand(self, group, bucket, send, hand, prescale) -> None:
        for i in bucket.slots:
            grad = hand.get((group.index, i))
            if grad is None:
                continue
            slot = group.layout.slots[i]
            flat = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)  # (a copy, or a view read)
            cast_scale_into(bucket.slot_range(slot).of(send), bucket.fragment_range(slot).of(flat), prescale)

    def send(self, group, bucket, view, held, fragments, complete, prescale) -> torch.Tensor:
        if held is not None:
            self.write(group, bucket, view, *held, prescale)
        for at, values, add in fragments:
            self.write_fragment(at.of(view), values, add, prescale)
        return view  # zeros for a bucket none of whose parameters got a gradient


class ShardGrads(ShardedGradStrategy):
    """Stages 2 and 3 on one process: the gradients are added straight into the grad shard (nothing to reduce), a
    bucket's at once when it launches."""

    def __init__(self, state: ShardedState, reduce_dtype: torch.dtype):
        super().__init__(state, reduce_dtype)
        self._starts: dict[tuple[int, int], int] = {}  # (group, slot) -> where it starts in the grad shard

    def send_bytes(self, group: FlatGroup) -> int:
        return 0

    def _start(self, group: FlatGroup, slot: Slot) -> int:
        """Where the parameter starts in the grad shard, computed once."""
        key = (group.index, slot.index)
        start = self._starts.get(key)
        if start is None:
            start = self._starts[key] = group.layout.single_rank_shard_range(slot).start
        return start

    def write(self, group, bucket, send, slots, grads, prescale) -> None:
        add_flattened(group.state.grad, grads, [self._start(group, s) for s in slots])

    def add_again(self, group, bucket, send, slot, grad, prescale) -> None:
        start = self._start(group, slot)
        accumulate_into(group.state.grad[start : start + slot.numel], grad)

    def add_split(self, group, slot, flat) -> None:
        start = self._start(group, slot)  # one process: the parameter is contiguous in the grad shard too
        accumulate_into(group.state.grad[start : start + slot.numel], flat)

    def load_hand(self, group, bucket, send, hand, prescale) -> None:
        for i in bucket.slots:
            grad = hand.get((group.index, i))
            slot = group.layout.slots[i]
            if grad is not None and bucket.index == slot.bucket:  # (a split parameter: once, with its first)
                start = self._start(group, slot)  # one process: the parameter is contiguous in the grad shard
                accumulate_into(group.state.grad[start : start + slot.numel], grad)

    def send(self, group, bucket, view, held, fragments, complete, prescale) -> None:
        if held is not None:
            self.write(group, bucket, None, *held, prescale)
        return None


def _drop_early_grads(groups: Sequence[FlatGroup], stage: int, since: str, who: str) -> None:
    """Stages 2 and 3: a gradient the parameters of ``groups`` got before the engine took them (``since``) was never
    reduced, and nothing will reduce it: dropped, with a warning."""
    stale = [group.names[i] for group in groups for i, p in enumerate(group.params) if p.grad is not None]
    for group in groups:
        for p in group.params:
            p.grad = None
    if stale:
        warnings.warn(
            f"{who}: dropping the gradients of {len(stale)} parameters (e.g. {stale[0]!r}) computed "
            f"before {since}: stage {stage} reduces gradients while backward runs",
            stacklevel=4,
        )
