"""Stages 1 and 2: parameter all-gathers, ``start_param_sync`` after a bucket's update, ``finish_param_sync``
before its parameters are read (each bucket's all-gather in flight is its BucketRuntime's, state GATHERING).

By default ``step()`` finishes every gather before it returns. With ``defer_all_gather_to=model`` it returns at
once and the waits move into the next forward: a forward pre-hook on each module waits for the buckets of the
parameters it owns directly, just before it runs. A parameter can also be read by a module that does not own it
(``F.embedding(x, self.wte.weight)`` in a parent, with ``wte`` never called): to cover that, the model's root
waits, before anything runs, for every bucket that no module's pre-hook claimed in the previous forward (all of
them in the first forward), and the root's forward post-hook waits for whatever is still in flight, so nothing
is in flight when backward starts. Reading parameters outside forward after ``step()`` needs
``opt.finish_sync()`` first: the gather may still be writing them.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from ..layout import Bucket
from ..state.params import master_follows
from ..state.sharded_state import FlatGroup, ShardedState
from .bucket_runtime import Key, ParamState
from .runtime import BucketRuntimes
from .weak_hooks import remove_with, weak_call


class ParamSync:
    def __init__(self, state: ShardedState, runtimes: BucketRuntimes):
        self.state, self.comm = state, state.comm
        self.runtime = runtimes.buckets
        self._hooks = []
        self.deferred = False
        self._claimed: set[Key] = set()  # buckets some module's pre-hook waited for in the last forward
        self._claiming: set[Key] = set()

    def bucket_updated(self, group: FlatGroup, bucket: Bucket) -> None:
        """``step()`` queued the update of this rank's slice of ``bucket``: gather every rank's into the full param
        buffer (in place)."""
        self.runtime[(group.index, bucket.index)].start_param_sync(self.comm)

    def finish_param_sync(self, keys: Optional[Iterable[Key]] = None) -> None:
        """The current stream waits for the gathers of ``keys`` (default: all in flight)."""
        for rt in self.runtime.values() if keys is None else (self.runtime[k] for k in keys):
            if rt.params is ParamState.GATHERING:
                rt.finish_param_sync()

    settle = finish_param_sync  # what step() and finish_sync() call: nothing of the parameters left in flight

    def extend(self, added: Sequence[FlatGroup]) -> None:
        """Flat groups ``added`` (``add_param_group``; their runtimes are in ``runtime`` already): with
        ``defer_all_gather_to``, the forward waits for their buckets too."""
        if self.deferred:
            self._wait_in_forward(added)

    # ---------------------------------------------------------------- deferred waits
    def defer_to(self, module: torch.nn.Module) -> None:
        """Install the forward hooks that make ``step()``'s gathers finish in the next forward of ``module``."""
        self._module, self._root_keys = module, []
        self._hooks.append(module.register_forward_pre_hook(weak_call(self._root_pre_hook)))
        self._hooks.append(module.register_forward_hook(weak_call(self._root_post_hook)))
        remove_with(self, self._hooks)  # (hooks added later too)
        self.deferred = True
        self._wait_in_forward(self.state.groups)

    def _wait_in_forward(self, groups: Sequence[FlatGroup]) -> None:
        """Each module owning parameters of ``groups`` waits for their buckets before its forward (the root's own are
        waited for by its pre-hook, with every bucket no module claimed in the last forward)."""
        where = {}
        for group in groups:
            for slot, p in zip(group.layout.slots, group.params):
                where[id(p)] = [(group.index, b) for b in slot.buckets]  # a split parameter: each of its buckets
        module = self._module
        for m in module.modules():
            keys = sorted({k for p in m.parameters(recurse=False) if id(p) in where for k in where[id(p)]})
            if keys and m is not module:
                self._hooks.append(m.register_forward_pre_hook(weak_call(self._pre_hook, keys)))
        self._root_keys += sorted({k for p in module.parameters(recurse=False) if id(p) in where for k in where[id(p)]})

    @torch.compiler.disable
    def _pre_hook(self, keys: list[Key], _module, _args) -> None:
        self._claiming.update(keys)
        self.finish_param_sync(keys)

    @torch.compiler.disable
    def _root_pre_hook(self, _module, _args) -> None:
        self._claiming = set()
        self.finish_param_sync(self._root_keys)
        self.finish_param_sync([k for k in self.runtime if k not in self._claimed])  # skips those not gathering

    @torch.compiler.disable
    def _root_post_hook(self, _module, _args, _output) -> None:
        self._claimed = self._claiming
        self.finish_param_sync()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.deferred = False


@torch.no_grad()
def write_back(state: ShardedState, modifier_rank: int) -> None:
    """Collective: rank ``modifier_rank``'s full parameters become every rank's, and each rank's shard and fp32
    master follow them (the master only where a value changed: unchanged elements keep their fp32 bits)."""
    for group, bucket in state.buckets():
        full = group.flat_params.gathered(bucket)
        with torch._C.DisableTorchFunctionSubclass():
            state.comm.broadcast(full, modifier_rank)
            mine = bucket.rank_range(state.rank).shifted(-bucket.offset).of(full)
            if group.state.master_copy:
                # Against the master, not the values before the broadcast: at stages 1 and 2 the modifier's own
                # shard is part of `full`, already edited.
                master_follows(group, bucket, mine)
            group.flat_params.follow(bucket, full)  # stage 3's kept shard (or mesh chunk)
    if state.param_edits is not None:
        state.param_edits.record()


def start_after_update(comm, group: FlatGroup, bucket: Bucket):
    """Start the gather ``group``'s params need after ``bucket``'s update (state/params.py ``AfterUpdate``): its
    Pending, or None where the next use gathers anyway (stage 3 on a 1-D layout)."""
    need = group.flat_params.after_update(bucket)
    if need is None:
        return None
    start = comm.start_all_gather if need.over == "all" else comm.start_replica_gather
    return start(need.into, need.own)


def params_from_master(state: ShardedState) -> None:
    """Collective: round this rank's master slices into the param buffer and gather every rank's (after the master
    was loaded: checkpoints, local state dicts). The sharded state is data; this is the engine's collective on it."""
    pending = []
    with torch.no_grad():
        for group, bucket in state.buckets():
            mine = group.flat_params.rank_slice(bucket)  # None: stage 3 casts the master at each gather
            if group.state.master_copy and mine is not None:
                mine.copy_(group.state.read("master", bucket.shard_range))
            synced = start_after_update(state.comm, group, bucket)
            if synced is not None:
                pending.append(synced)
    for p in pending:
        p.wait()
    if state.param_edits is not None:
        state.param_edits.record()
