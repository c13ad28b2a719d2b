"""A bucket's two phases (:class:`GradState`, :class:`ParamState`), their legal moves, and how a gradient counts on
arrival (:class:`Arrival`): the data :class:`zero_ext.engine.bucket_runtime.BucketRuntime` moves through, which its
callers read (no code runs here).

The two phases are separate enums because they overlap in time: at stage 3 a bucket is GATHERED while its
gradients are FILLING (its backward runs). Each moves through a table of legal transitions, and every move goes
through the paired verbs of the bucket (``arrive``, ``start_grad_sync`` / ``finish_grad_sync``, ``start_param_sync`` /
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


GRAD_MOVES = {
    GradState.EMPTY: {GradState.EMPTY, GradState.FILLING, GradState.READY},  # EMPTY: a round with none of its grads
    GradState.FILLING: {GradState.FILLING, GradState.READY},
    GradState.READY: {GradState.SYNCING},
    GradState.SYNCING: {GradState.SYNCED, GradState.EMPTY, GradState.READY},  # a new round while in flight
    # READY: step() reduces what no_sync() accumulated; SYNCING: a mesh sends its held gradients (release_held)
    GradState.SYNCED: {GradState.EMPTY, GradState.READY, GradState.SYNCING},
}
PARAM_MOVES = {  # stage 3: a present bucket is never gathered again
    ParamState.SHARDED: {ParamState.GATHERING},
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.SHARDED},
}
FULL_PARAM_MOVES = {  # stages 1 and 2: never sharded; each update is gathered in place
    ParamState.SHARDED: set(),
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.GATHERING},
}


class Arrival(enum.Enum):
    """How a gradient counts when it arrives (:meth:`BucketRuntime.arrive`)."""

    FIRST = "first"  # the slot's first gradient this round: held, counts towards its bucket
    AGAIN_HELD = "again_held"  # again, still held: autograd summed it into param.grad
    AGAIN_WRITTEN = "again_written"  # again, after the first was written: added to what was written
