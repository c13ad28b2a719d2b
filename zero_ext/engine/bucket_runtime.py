"""One bucket at run time: everything in flight or alive for it, in one object with an explicit state.

A :class:`BucketRuntime` is made once per (flat group, bucket) by :class:`zero_ext.engine.runtime.BucketRuntimes`,
which owns them for the engine's whole life (``add_param_group`` adds those of its buckets); the reducer, the parameter all-gathers (stages 1 and 2) and stage 3's gather scheduler all act on these
objects, never on private lists of their own. It owns both directions of its communication, as Megatron's bucket
group does: ``start_grad_sync`` has the stage's gradient strategy write what goes on the wire (into the staging
entry it leases) and launches its reduce-scatter (into the grad shard, or the landing buffer its placement gives),
and ``finish_grad_sync`` waits for it; ``start_param_sync`` launches its all-gather and
``finish_param_sync`` waits for it. The object holds

- its gradients: how many arrived this round, the staging-pool entry it leases (``staging``), its reduce-scatter
  in flight (``grad_pending``), and the phase :class:`GradState`;
- its parameters: the all-gather in flight (``param_pending``) into the bucket's gathered storage (stage 3: the
  one storage that is resized to zero bytes when released, :mod:`zero_ext.state.sharded_params`), and the phase
  :class:`ParamState`;
- stage 3's scheduling facts about it (who uses it now, why it is held): read and written by
  :mod:`zero_ext.engine.param_gather` only.

The two phases are separate enums because they overlap in time: at stage 3 a bucket is GATHERED while its
gradients are FILLING (its backward runs). Each moves through a table of legal transitions, and every move goes
through the paired verbs below (``start_grad_sync`` / ``finish_grad_sync``, ``start_param_sync`` /
``finish_param_sync`` / ``reshard``), which do what they say; a move the table does not list raises
:class:`IllegalTransition` (a bucket gathered twice, freed while its all-gather is in flight, reduced twice).

Gradients (one round = one synchronised backward pass)::

    EMPTY --grad--> FILLING --last grad--> READY --its turn: start_grad_sync--> SYNCING --finish_grad_sync--> SYNCED
      |___________ end of backward (missing gradients count as zero) ____^        |
    a new round starts from SYNCED (or SYNCING: the previous reduction is waited for at the next launch); on a mesh
    under no_sync() SYNCED --release_held--> SYNCING sends the node-held sums across nodes (comm/hsdp.py)

Parameters::

    stage 3:     SHARDED --start_param_sync--> GATHERING --finish_param_sync--> GATHERED --reshard--> SHARDED
    stages 1, 2:                               GATHERING --finish_param_sync--> GATHERED --start_param_sync (after
                                                                                          the step's update)--^
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

from ..comm import Pending

if TYPE_CHECKING:  # types only: buffers.py imports this module
    from ..layout import Bucket
    from ..state.sharded_state import FlatGroup
    from .staging import StagingEntry

Key = tuple[int, int]  # (flat group index, bucket index)


class IllegalTransition(RuntimeError):
    """A bucket was asked to move to a state it cannot reach from where it is: an engine bug, never a user's."""


class GradState(enum.Enum):
    EMPTY = "empty"  # no gradient of this round has arrived
    FILLING = "filling"  # some have
    READY = "ready"  # all have (or the round is closing); launched when every bucket before it in order is
    SYNCING = "syncing"  # its reduce-scatter is in flight
    SYNCED = "synced"  # its mean is in the grad shard


class ParamState(enum.Enum):
    SHARDED = "sharded"  # stage 3: only this rank's slice exists; the gathered storage holds zero bytes
    GATHERING = "gathering"  # the all-gather into the gathered storage is in flight
    GATHERED = "gathered"  # the full values are in the storage


class Hold(enum.Enum):
    """Stage 3: why a gathered bucket nobody is using now stays gathered (param_gather.py)."""

    NONE = "none"  # nothing: released by the next trigger that finds it unused
    AHEAD = "ahead"  # prefetched for a module about to run; not evicted
    BACKWARD = "backward"  # kept from forward for the first modules of backward; may be evicted
    RECOMPUTED = "recomputed"  # gathered for a forward activation checkpointing recomputes: until its backward
    UNTIL_READY = "until_ready"  # read by backward and only its gradients' arrival (READY) says when it is done


_GRAD_MOVES = {
    GradState.EMPTY: {GradState.EMPTY, GradState.FILLING, GradState.READY},  # EMPTY: a round with none of its grads
    GradState.FILLING: {GradState.FILLING, GradState.READY},
    GradState.READY: {GradState.SYNCING},
    GradState.SYNCING: {GradState.SYNCED, GradState.EMPTY, GradState.READY},  # a new round while in flight
    # READY: step() reduces what no_sync() accumulated; SYNCING: a mesh sends its held gradients (release_held)
    GradState.SYNCED: {GradState.EMPTY, GradState.READY, GradState.SYNCING},
}
_PARAM_MOVES = {  # stage 3: a present bucket is never gathered again
    ParamState.SHARDED: {ParamState.GATHERING},
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.SHARDED},
}
_FULL_PARAM_MOVES = {  # stages 1 and 2: never sharded; each update is gathered in place
    ParamState.SHARDED: set(),
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.GATHERING},
}


class BucketRuntime:
    __slots__ = (
        "group", "bucket", "key", "order", "nbytes",
        "grad", "arrived", "staging", "grad_pending",
        "params", "param_pending",
        "forward_users", "backward_users", "hold", "forward_uses_left", "backward_uses_left",
    )  # fmt: skip

    def __init__(self, group: "FlatGroup", bucket: "Bucket", order: int):
        self.group, self.bucket, self.order = group, bucket, order
        self.key: Key = (group.index, bucket.index)
        self.nbytes = bucket.numel * group.dtype.itemsize  # of the gathered storage
        self.grad = GradState.EMPTY
        self.arrived = 0  # gradients counted this round
        self.staging: Optional["StagingEntry"] = None  # the pool entry it fills or sends from
        self.grad_pending: Optional[Pending] = None  # its reduce-scatter, until finish_grad_sync
        self.params = ParamState.SHARDED if group.flat_params.shards_params else ParamState.GATHERED
        self.param_pending: Optional[Pending] = None  # its all-gather, until finish_param_sync
        # Stage 3's scheduler (param_gather.py): module calls running forward / backward that use it now, why it
        # is held otherwise, and the uses still to come this step (predicted from the previous step).
        self.forward_users = 0
        self.backward_users = 0
        self.hold = Hold.NONE
        self.forward_uses_left = 0
        self.backward_uses_left = 0

    def __repr__(self) -> str:
        return f"BucketRuntime{self.key}(grad={self.grad.name}, params={self.params.name}, hold={self.hold.name})"

    # ---------------------------------------------------------------- transitions
    def move_grad(self, to: GradState) -> None:
        self._check_grad_move(to)
        self.grad = to

    def _check_grad_move(self, to: GradState) -> None:
        if to not in _GRAD_MOVES[self.grad]:
            raise IllegalTransition(f"bucket {self.key}: gradients cannot go from {self.grad.name} to {to.name}")

    def _move_params(self, to: ParamState) -> None:
        if to not in (_PARAM_MOVES if self.group.flat_params.shards_params else _FULL_PARAM_MOVES)[self.params]:
            raise IllegalTransition(f"bucket {self.key}: parameters cannot go from {self.params.name} to {to.name}")
        self.params = to

    # ---------------------------------------------------------------- gradients
    def grad_arrived(self) -> bool:
        """One more of its gradients arrived this round; True when that was the last (READY)."""
        self.arrived += 1
        self.move_grad(GradState.READY if self.arrived >= len(self.bucket.slots) else GradState.FILLING)
        return self.grad is GradState.READY

    def start_grad_sync(self, comm, gradients, pool) -> None:
        """Launch its reduce-scatter: READY -> SYNCING. Its reduction of an earlier round, if still in flight, lands
        first; ``gradients`` (the stage's gradient strategy, ``grads.py``) writes what goes on the wire, leasing an
        entry of the staging ``pool`` in ``staging`` (None: nothing to send, no collective); the mean goes into its
        grad shard, or into the landing buffer its placement gives (offload), which then takes it. The lease passes
        back to the pool with the collective, which reuses the entry once it is waited for."""
        self._check_grad_move(GradState.SYNCING)  # before anything is written or launched
        self.wait_grad()
        send = gradients.send(self)
        pending = None
        if send is not None:
            placement = self.group.state
            target, direct = placement.grad_target(self.bucket)  # the grad shard, or a landing buffer (offload)
            comm.position.bucket = self.key  # labels the collective (divergence.py)
            entry = self.staging
            accumulate = gradients.accumulate
            pending = comm.start_reduce_scatter(
                send,
                target,
                reduce_dtype=gradients.reduce_dtype,
                accumulate=accumulate and direct,
                workspace=None if entry is None else entry.workspace,
            )
            if not direct:
                placement.landed(self.bucket, target, pending, accumulate)
            if entry is not None:
                pool.launched(entry, pending)
        self.move_grad(GradState.SYNCING)
        self.grad_pending = pending
        self.staging = None

    def release_held(self, comm) -> None:
        """A mesh under ``no_sync()`` held its node-reduced gradients (``comm.hsdp``): send them across nodes into its
        grad shard (added), SYNCED -> SYNCING."""
        self._check_grad_move(GradState.SYNCING)
        placement = self.group.state
        target, direct = placement.grad_target(self.bucket)
        comm.position.bucket = self.key
        pending = comm.start_release(self.key, target, accumulate=direct)
        if not direct:
            placement.landed(self.bucket, target, pending, True)
        self.move_grad(GradState.SYNCING)
        self.grad_pending = pending

    def finish_grad_sync(self) -> None:
        """Wait for its reduce-scatter (the grad shard then holds the mean): SYNCING -> SYNCED."""
        self.wait_grad()
        self.move_grad(GradState.SYNCED)

    def wait_grad(self) -> None:
        """Wait for a reduce-scatter still in flight, whatever round launched it (a new launch must follow it)."""
        if self.grad_pending is not None:
            self.grad_pending.wait()
            self.grad_pending = None

    # ---------------------------------------------------------------- parameters
    def start_param_sync(self, comm) -> None:
        """Start gathering every rank's slice into the gathered storage (stage 3: its bytes come back first)."""
        self._move_params(ParamState.GATHERING)
        flat = self.group.flat_params
        full = flat.unshard(self.bucket)
        comm.position.bucket = self.key  # labels the collective (divergence.py)
        self.param_pending = comm.start_all_gather(full, flat.gather_input(self.bucket, full))

    def finish_param_sync(self) -> None:
        """Wait for the all-gather (the current stream, on CUDA): GATHERING -> GATHERED."""
        self._move_params(ParamState.GATHERED)
        self.param_pending.wait()
        self.param_pending = None

    def reshard(self) -> None:
        """Stage 3: free the full values (the storage shrinks to zero bytes, for every view of it): GATHERED ->
        SHARDED. Never while the all-gather writes into it (GATHERING raises), nor at stages 1 and 2."""
        self._move_params(ParamState.SHARDED)
        self.group.flat_params.release(self.bucket)
