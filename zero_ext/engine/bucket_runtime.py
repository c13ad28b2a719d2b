"""One bucket at run time: everything in flight or alive for it, in one object that alone writes its state.

A :class:`BucketRuntime` is made once per (flat group, bucket) by :class:`zero_ext.engine.runtime.BucketRuntimes`,
which owns them for the engine's whole life (``add_param_group`` adds those of its buckets). The reducer
(:class:`zero_ext.engine.reducer.GradSync`: hooks, rounds, launch order), the parameter all-gathers (stages 1 and
2) and stage 3's gather schedule call its verbs; it never calls them back, and no other module assigns its fields
(others read them through read-only properties). It owns both directions of its communication, as Megatron's
bucket group does. The object holds

- its gradients: the phase :class:`GradState`, how many arrived this round and which slots, the gradients it holds
  in ``.grad`` until it launches and the fragments of split parameters (one write per bucket, see below), the wire
  dtype and pre-scale (asked of the stage's gradient policy once, at construction), the staging entry it leases,
  its reduce-scatter in flight and where it lands (its placement's grad target);
- its parameters: the phase :class:`ParamState`, the all-gather in flight into the bucket's gathered storage
  (stage 3: the one storage that is resized to zero bytes when released, :mod:`zero_ext.state.sharded_params`), and
  stage 3's class swaps (its parameters are ordinary tensors while GATHERED, checking ones otherwise).

What varies by stage is the gradient policy (``grads.py``), which the bucket calls with values (its group, layout,
send buffer, held gradients) and which returns values (what goes on the wire); it never calls the bucket back.

One write per bucket: a kernel launch costs the host a few microseconds in C++ and tens through a Python Triton
launcher, whatever the tensor's size; a model has hundreds of small parameters, so writing each gradient the moment
it arrives made backward launch-bound (bench/results/backward_hooks_cpu.md). A bucket holds its gradients where
autograd left them and has them written with one multi-tensor call when it launches, then frees them. The reducer
bounds what all buckets hold together (``HOLD_ELEMENTS``: beyond it the oldest bucket writes its own early, into
its staging lease). A gradient that arrives twice in one backward pass (reentrant activation checkpointing) is
summed by autograd into ``.grad`` while held, and added to what was written otherwise (:attr:`Arrival.AGAIN_WRITTEN`).

Its two phases, their legal moves and the diagrams: :mod:`zero_ext.engine.bucket_states`. The staging pool it
leases its send buffer from (:class:`StagingPool`) is here too: a lease is taken once per launch and handed back with
the collective that reads it, both inside the bucket's own verbs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..comm import Pending
from ..state.sharded_params import unwatch
from .bucket_states import (
    FULL_PARAM_MOVES,
    GRAD_MOVES,
    PARAM_MOVES,
    Arrival,
    GradState,
    IllegalTransition,
    ParamState,
)

if TYPE_CHECKING:  # types only: buffers.py imports this module
    from ..layout import Bucket, Slot
    from ..state.sharded_state import FlatGroup

Key = tuple[int, int]  # (flat group index, bucket index)


class BucketRuntime:
    __slots__ = (
        "group", "bucket", "key", "order", "nbytes",
        "_grad", "_arrived", "_staging", "_grad_pending", "_wire_dtype", "_prescale", "_staged",
        "_held", "_held_numel", "_seen", "_got", "_fragments",
        "_params", "_param_pending", "_members",
    )  # fmt: skip

    def __init__(self, group: "FlatGroup", bucket: "Bucket", order: int, travel: tuple):
        """``travel``: how its gradients go on the wire, from the stage's gradient policy (``grads.py``), once:
        (wire dtype, pre-scale, whether they go through a staging send buffer)."""
        self.group, self.bucket, self.order = group, bucket, order
        self.key: Key = (group.index, bucket.index)
        self.nbytes = bucket.numel * group.dtype.itemsize  # of the gathered storage
        self._wire_dtype, self._prescale, self._staged = travel
        self._grad = GradState.EMPTY
        self._arrived = 0  # gradients counted this round
        self._staging: Optional["StagingEntry"] = None  # the pool entry it fills or sends from (its lease)
        self._grad_pending: Optional[Pending] = None  # its reduce-scatter, until finish_grad_sync
        # Its gradients held where autograd left them until it launches (one write per bucket, see below): (slot,
        # parameter, its .grad), the slot indices that got one this round, and the elements held
        self._held: list[tuple["Slot", torch.Tensor, torch.Tensor]] = []
        self._held_numel = 0
        self._seen: set[int] = set()  # slot indices with a gradient this round
        self._got: set[int] = set()  # slot indices with a gradient since the policy's gradients were consumed
        # split parameters' fragments to write at its launch: (place in the bucket, values, added or written)
        self._fragments: list[tuple] = []
        self._params = ParamState.SHARDED if group.flat_params.shards_params else ParamState.GATHERED
        self._param_pending: Optional[Pending] = None  # its all-gather, until finish_param_sync
        # Stage 3: its parameters with their two classes (own, checking) and the buckets each lies in (a split
        # parameter is an ordinary tensor only once all of them are GATHERED)
        self._members: list[tuple[torch.Tensor, type, type, tuple["BucketRuntime", ...]]] = []

    def __repr__(self) -> str:
        return f"BucketRuntime{self.key}(grad={self._grad.name}, params={self._params.name})"

    def reorder(self, order: int) -> None:
        """Its place in the launch order changed (``add_param_group``: nothing in flight)."""
        self.order = order

    # ---------------------------------------------------------------- read-only views
    @property
    def grad(self) -> GradState:
        return self._grad

    @property
    def params(self) -> ParamState:
        return self._params

    @property
    def wire_dtype(self) -> torch.dtype:
        return self._wire_dtype

    def got(self) -> list[int]:
        """Global indices of its parameters with a gradient since the gradients were last consumed."""
        return [self.group.param_indices[i] for i in self._got]

    # ---------------------------------------------------------------- transitions
    def _move_grad(self, to: GradState) -> None:
        self._check_grad_move(to)
        self._grad = to

    def _check_grad_move(self, to: GradState) -> None:
        if to not in GRAD_MOVES[self._grad]:
            raise IllegalTransition(f"bucket {self.key}: gradients cannot go from {self._grad.name} to {to.name}")

    def _move_params(self, to: ParamState) -> None:
        if to not in (PARAM_MOVES if self.group.flat_params.shards_params else FULL_PARAM_MOVES)[self._params]:
            raise IllegalTransition(f"bucket {self.key}: parameters cannot go from {self._params.name} to {to.name}")
        self._params = to

    # ---------------------------------------------------------------- gradients: a round
    def begin_round(self) -> None:
        """A backward pass begins: no gradient of it counted yet (EMPTY)."""
        self._move_grad(GradState.EMPTY)
        self._arrived = 0

    def close(self) -> None:
        """The round closes before all its gradients came (missing ones count as zero), or a reduction without
        backward (``no_sync()``'s accumulation, gradients assigned by hand) needs it launched: READY."""
        self._move_grad(GradState.READY)

    def reopen(self) -> None:
        """READY again for a reduction without backward; no gradient counted (every slot is read as it is)."""
        self._move_grad(GradState.READY)
        self._arrived = 0

    def end_round(self) -> None:
        """The backward pass ended: the slots seen are forgotten (nothing is held: every bucket launched)."""
        self._seen.clear()

    # ---------------------------------------------------------------- gradients: arrivals
    def grad_arrived(self) -> bool:
        """One more of its gradients arrived this round; True when that was the last (READY)."""
        self._arrived += 1
        self._move_grad(GradState.READY if self._arrived >= len(self.bucket.slots) else GradState.FILLING)
        return self._grad is GradState.READY

    def arrive(self, slot: "Slot", param: torch.Tensor, grad: torch.Tensor) -> tuple[Arrival, bool]:
        """``param``'s gradient (``grad``, its ``.grad``) arrived: held in ``.grad`` until the bucket launches (or
        the reducer asks it to :meth:`let_go` earlier). Returns how it counts, and whether the bucket is READY now
        (a first arrival counts towards it; the round is open)."""
        self._got.add(slot.index)
        if slot.index in self._seen:
            for at, (s, _, _) in enumerate(self._held):
                if s.index == slot.index:  # autograd added the second into .grad, in place or as a new tensor
                    self._held[at] = (slot, param, grad)
                    return Arrival.AGAIN_HELD, False
            return Arrival.AGAIN_WRITTEN, False
        self._seen.add(slot.index)
        self._held.append((slot, param, grad))
        self._held_numel += slot.numel
        return Arrival.FIRST, self.grad_arrived()

    def take(
        self, slot: "Slot", param: torch.Tensor, grad: torch.Tensor, policy, pool, comm=None
    ) -> tuple[bool, bool, Optional[int]]:
        """``param``'s gradient arrived (``grad``, its ``.grad``): :meth:`arrive` (a second one after the first was
        written is added now), and with ``comm`` (its turn in the launch order has come) a bucket it completes
        launches in the same call (:meth:`start_grad_sync`). Returns whether it was the slot's first this round (now
        held, counted), whether the bucket is READY (or launched), and the elements its launch released (None: not
        launched): the reducer keeps its bound and launch order with these, without asking again."""
        arrival, ready = self.arrive(slot, param, grad)
        if arrival is Arrival.AGAIN_WRITTEN:
            self.add_again(slot, param, grad, policy, pool)
        first = arrival is Arrival.FIRST
        if ready and comm is not None:
            return first, True, self.start_grad_sync(comm, policy, pool)
        return first, ready, None

    def add_again(self, slot: "Slot", param: torch.Tensor, grad: torch.Tensor, policy, pool) -> None:
        """A second gradient for a slot already written this round: the policy adds it to what was written; the
        gradient is freed."""
        policy.add_again(self.group, self.bucket, self._send_view(policy, pool), slot, grad, self._prescale)
        param.grad = None

    def arrive_split(self, slot: "Slot") -> bool:
        """A split parameter's gradient arrived (the first of its buckets records it): whether it is its first this
        round."""
        self._got.add(slot.index)
        first = slot.index not in self._seen
        self._seen.add(slot.index)
        return first

    def take_fragment(self, slot: "Slot", flat: torch.Tensor, first: bool, policy, pool) -> None:
        """Its fragment of a split parameter's flattened gradient ``flat``: written at its launch (staging stays
        bucket-sized), or, a second gradient after its first was written, added now."""
        at, values = self.bucket.slot_range(slot), self.bucket.fragment_range(slot).of(flat)
        if first or self._fragments:
            self._fragments.append((at, values, not first))
        else:
            policy.write_fragment(at.of(self._send_view(policy, pool)), values, True, self._prescale)

    def let_go(self, policy, pool) -> int:
        """Write the gradients it holds (the policy writes them, in one call) and free them; returns how many
        elements it held."""
        if not self._held:
            return 0
        slots, grads = self._take_held()
        policy.write(self.group, self.bucket, self._send_view(policy, pool), slots, grads, self._prescale)
        return self._released()

    def _take_held(self) -> tuple[list, list]:
        slots, grads = [], []
        for slot, param, grad in self._held:
            slots.append(slot)
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
            param.grad = None
        self._held = []
        return slots, grads

    def _released(self) -> int:
        numel, self._held_numel = self._held_numel, 0
        return numel

    def forget(self, gidxs: set[int]) -> None:
        """The user dropped these parameters' gradients: none for the next step."""
        self._got.difference_update(i for i, g in enumerate(self.group.param_indices) if g in gidxs)

    def consumed(self) -> None:
        """The gradients were consumed (``step()`` at stages 2 and 3) or dropped (``zero_grad()``)."""
        self._got.clear()

    def load_hand(self, hand: dict, policy, pool) -> None:
        """Before a reduction of gradients assigned by hand (``hand``: (group, slot) -> tensor, this rank's): READY,
        the policy puts them where its send reads them."""
        self.reopen()
        policy.load_hand(self.group, self.bucket, self._send_view(policy, pool), hand, self._prescale)

    def _send_view(self, policy, pool) -> Optional[torch.Tensor]:
        """The send buffer its policy writes gradients into before the launch (a staging entry it leases, zeroed
        when leased), or None when the policy writes elsewhere."""
        if not policy.writes_to_staging:
            return None
        if self._staging is None:
            self._staging = pool.acquire(self, self._wire_dtype, self.bucket.numel)
            self._staging.send_view.zero_()
        return self._staging.send_view

    # ---------------------------------------------------------------- gradients: the reduce-scatter
    def start_grad_sync(self, comm, policy, pool, phase=None) -> int:
        """Launch its reduce-scatter: READY -> SYNCING. Its reduction of an earlier round, if still in flight, lands
        first; what it holds is written and the policy says what goes on the wire (from the staging entry it
        leases, or as it is; None: nothing to send, no collective); the mean goes into its grad shard, or into the
        landing buffer its placement gives (offload), which then takes it. The lease passes back to the pool with
        the collective, which reuses the entry once it is waited for. ``phase``: the phase the collective opens (its
        position label, comm/base.py). Returns the elements it held."""
        self._check_grad_move(GradState.SYNCING)  # before anything is written or launched
        self.wait_grad()
        held = self._take_held() if self._held else None
        fragments, self._fragments = self._fragments, []
        if policy.writes_to_staging:
            view = self._send_view(policy, pool)
        elif pool is not None and pool.used:
            self._staging = pool.acquire(self, self._wire_dtype if self._staged else None, self.bucket.numel)
            view = self._staging.send_view
        else:
            view = None
        complete = self._arrived >= len(self.bucket.slots)
        send = policy.send(self.group, self.bucket, view, held, fragments, complete, self._prescale)
        pending = None
        if send is not None:
            placement = self.group.state
            target, direct = placement.grad_target(self.bucket)  # the grad shard, or a landing buffer (offload)
            entry = self._staging
            accumulate = policy.accumulate
            pending = comm.start_reduce_scatter(
                send,
                target,
                reduce_dtype=policy.reduce_dtype,
                accumulate=accumulate and direct,
                workspace=None if entry is None else entry.workspace,
                bucket=self.key,
                phase=phase,
            )
            if not direct:
                placement.landed(self.bucket, target, pending, accumulate)
            if entry is not None:
                pool.launched(entry, pending)
        self._move_grad(GradState.SYNCING)
        self._grad_pending = pending
        self._staging = None
        return self._released()

    def release_held(self, comm) -> None:
        """A mesh under ``no_sync()`` held its node-reduced gradients (``comm.hsdp``): send them across nodes into its
        grad shard (added), SYNCED -> SYNCING."""
        self._check_grad_move(GradState.SYNCING)
        placement = self.group.state
        target, direct = placement.grad_target(self.bucket)
        pending = comm.start_release(self.key, target, accumulate=direct)
        if not direct:
            placement.landed(self.bucket, target, pending, True)
        self._move_grad(GradState.SYNCING)
        self._grad_pending = pending

    def finish_grad_sync(self) -> None:
        """Wait for its reduce-scatter (the grad shard then holds the mean): SYNCING -> SYNCED."""
        self.wait_grad()
        self._move_grad(GradState.SYNCED)

    def wait_grad(self) -> None:
        """Wait for a reduce-scatter still in flight, whatever round launched it (a new launch must follow it)."""
        if self._grad_pending is not None:
            self._grad_pending.wait()
            self._grad_pending = None

    # ---------------------------------------------------------------- parameters
    def add_member(self, param: torch.Tensor, original: type, checking: type, buckets: tuple) -> None:
        """Stage 3: ``param`` (its class now ``checking``) lies in this bucket (and in ``buckets``, all of them):
        it takes its ``original`` class while every one of them is GATHERED."""
        self._members.append((param, original, checking, buckets))

    def start_param_sync(self, comm) -> None:
        """Start gathering every rank's slice into the gathered storage (stage 3: its bytes come back first)."""
        self._move_params(ParamState.GATHERING)
        flat = self.group.flat_params
        full = flat.unshard(self.bucket)
        self._param_pending = comm.start_all_gather(full, flat.gather_input(self.bucket, full), self.key)

    def finish_param_sync(self) -> None:
        """Wait for the all-gather (the current stream, on CUDA): GATHERING -> GATHERED. Stage 3: its parameters
        become ordinary tensors (a split one once all its buckets are GATHERED): the ops of forward and backward on
        them pay nothing for the checks."""
        self._move_params(ParamState.GATHERED)
        self._param_pending.wait()
        self._param_pending = None
        for p, original, _, buckets in self._members:
            if len(buckets) == 1 or all(b._params is ParamState.GATHERED for b in buckets):
                p.__class__ = original

    def reshard(self) -> None:
        """Stage 3: free the full values (the storage shrinks to zero bytes, for every view of it): GATHERED ->
        SHARDED; its parameters check their reads again. Never while the all-gather writes into it (GATHERING
        raises), nor at stages 1 and 2."""
        self._move_params(ParamState.SHARDED)
        for p, _, checking, _ in self._members:
            p.__class__ = checking
        self.group.flat_params.release(self.bucket)

    def unshard_params(self, done: set[int]) -> None:
        """Stage 3, undoing the engine (every bucket GATHERED): each of its parameters not in ``done`` (ids) gets a
        full tensor of its own and its original class back, and is no longer watched; it keeps no member."""
        for p, original, _, _ in self._members:
            if id(p) in done:  # a split parameter is in each of its buckets
                continue
            done.add(id(p))
            with torch._C.DisableTorchFunctionSubclass():
                full = p.data.clone()
            p.data = full
            p.__class__ = original
            unwatch(p)
        self._members = []


# ---------------------------------------------------------------------------------------------------- staging
# The staging pool: byte buffers that carry buckets of gradients onto the wire.
#
# The staging pool: byte buffers that carry buckets of gradients onto the wire.
#
# An entry holds what one bucket's reduce-scatter needs while it is in flight: the send buffer (the gradients cast
# to the wire dtype and pre-scaled, when the gradient strategy stages them) followed by the communicator's
# workspace (gloo's receive buffer, NCCL's output shard). Entries are sized once, for the largest bucket, and
# viewed in whatever dtype a bucket travels in, so fp32 and bf16 flat groups share one pool.
#
# The pool is made with the sharded state and sized by the reducer (:meth:`StagingPool.size`), which knows the
# wire dtypes: at construction, and again when ``add_param_group`` adds buckets. It then holds ``capacity`` entries and reuses them in launch order: a bucket that needs an entry takes a
# free one, else waits for the oldest in flight (whose collective then has to finish first). Only when every entry
# is held by a bucket still filling (gradients arriving far out of layout order) does the pool grow by one; it
# never shrinks, so that happens in the first steps only, and ``nbytes`` is what the ledger reports.


class StagingEntry:
    """One byte buffer of the pool: ``send_bytes`` of send buffer, then the workspace."""

    __slots__ = ("buffer", "send_bytes", "workspace", "send_view", "holder", "pending")

    def __init__(self, send_bytes: int, workspace_bytes: int, device: torch.device):
        total = send_bytes + workspace_bytes
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device) if total else None
        self.send_bytes = send_bytes
        # Views made once (offload_states() resizes the storage in place, which every view follows): the
        # communicator's workspace, and the send buffer as the holder's bucket travels (set by acquire)
        self.workspace: Optional[torch.Tensor] = None if self.buffer is None else self.buffer[send_bytes:]
        self.send_view: Optional[torch.Tensor] = None
        self.holder: Optional[object] = None  # the bucket filling or sending from this entry
        self.pending: Optional[Pending] = None  # the collective reading/writing it

    def send(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The send buffer as ``numel`` elements of ``dtype``."""
        return self.buffer[: numel * dtype.itemsize].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


class StagingPool:
    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self.send_bytes = self.workspace_bytes = 0
        self.used = False
        self.entries: list[StagingEntry] = []
        self._inflight: list[StagingEntry] = []  # launched entries, oldest first

    def size(self, send_bytes: int, workspace_bytes: int) -> None:
        """Entries of ``send_bytes`` of send buffer and ``workspace_bytes`` of workspace each (the largest bucket's),
        ``capacity`` of them at least: before the first bucket is staged, and again when ``add_param_group`` added
        buckets (nothing in flight then). Entries of that size already here are kept; a larger size replaces them."""
        if self._inflight or any(e.holder is not None for e in self.entries):
            raise RuntimeError("StagingPool.size: entries are in use")
        if (send_bytes, workspace_bytes) != (self.send_bytes, self.workspace_bytes):
            self.entries = []
        self.send_bytes, self.workspace_bytes = send_bytes, workspace_bytes
        self.used = send_bytes + workspace_bytes > 0
        if not self.used:
            self.entries = []
        missing = max(0, self.capacity - len(self.entries)) if self.used else 0
        self.entries += [StagingEntry(send_bytes, workspace_bytes, self.device) for _ in range(missing)]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def tensors(self) -> list[torch.Tensor]:
        return [e.buffer for e in self.entries if e.buffer is not None]

    def acquire(self, holder: object, dtype: Optional[torch.dtype] = None, numel: int = 0) -> Optional[StagingEntry]:
        """An entry for ``holder``: a free one, else the oldest in flight (the current stream waits for its
        collective), else a new one. None when nothing needs staging. With ``dtype``, its ``send_view`` is the send
        buffer as ``numel`` elements of it (the holder's bucket as it travels)."""
        if not self.used:
            return None
        entry = next((e for e in self.entries if e.holder is None and e.pending is None), None)
        if entry is None and self._inflight:
            entry = self._inflight.pop(0)
            entry.pending.wait()
            entry.pending = None
        if entry is None:
            entry = StagingEntry(self.send_bytes, self.workspace_bytes, self.device)
            self.entries.append(entry)
        entry.holder = holder
        entry.send_view = None if dtype is None else entry.send(dtype, numel)
        return entry

    def launched(self, entry: Optional[StagingEntry], pending: Pending) -> None:
        """``entry``'s bucket is on the wire: it is busy until ``pending`` is waited for."""
        if entry is None:
            return
        entry.holder = None
        entry.pending = pending
        self._inflight.append(entry)

    def wait_all(self) -> None:
        """The current stream waits for every collective still using an entry."""
        for entry in self._inflight:
            entry.pending.wait()
            entry.pending = None
        self._inflight.clear()
