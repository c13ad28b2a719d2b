"""Stage 3: parameters gathered bucket by bucket just before a module uses them, and released after.

Every bucket is a :class:`zero_ext.engine.bucket_runtime.BucketRuntime`; its parameter phase moves SHARDED ->
GATHERING (``start_param_sync``: the bucket's one storage gets its bytes back, the all-gather writes into it) ->
GATHERED (``finish_param_sync``: the parameters become plain tensors again) -> SHARDED (``reshard``: the storage
shrinks to zero bytes; autograd's saved views of it hold nothing until it is refilled). This file decides when.

Forward: a pre-hook on every gather unit (:mod:`zero_ext.engine.gather_units`: by default each block of a
``ModuleList`` with its whole subtree, and every other module that owns parameters, so that torch.compile traces a
block as one graph) gathers their buckets (waiting for those already in flight) and counts itself among their ``forward_users`` while it runs; it then prefetches up to ``prefetch``
buckets ahead (hold AHEAD), in the execution order learned from the previous forward. The post-hook releases a
bucket once the uses the previous forward made of it are done (the first forward releases after every use; a
module met again gathers again), except the first ``prefetch + 1`` buckets backward needs (the root's, then the
last modules'), held BACKWARD from forward into backward instead of released and gathered again at once.
``reshard_after_forward=False`` keeps every bucket until its backward is done. Under ``torch.no_grad()`` buckets
are always released after use. A bucket that would not fit in the window evicts the held bucket needed farthest
ahead (gathered again at its next use).

Backward: the post-hook puts a hook on the module's outputs and an identity autograd function on its inputs. When
the outputs' gradient arrives (before the module's backward runs) its buckets are gathered again unless present
(``backward_users``), and those of the modules before it prefetched; when the inputs' gradient has been computed
(the module's backward is done) a bucket whose backward uses are all done is released. A bucket with no such hook
(its module's outputs need no gradient) or gathered for a forward that activation checkpointing recomputes is held
UNTIL_READY / RECOMPUTED: released when all its gradients have arrived (the reducer's READY), or at the end of
backward. Every bucket is released before ``step()`` updates the shards.

A parameter split across several buckets (``zero_ext/layout.py``: larger than ``bucket_size``) is in each of them: its module
gathers them all, it becomes a plain tensor once every one is GATHERED and checks again when one is released; the
buckets share one storage (``sharded_params``), which the window counts once.

Any other read of a parameter goes through ``sharded_params``' check: inside forward or backward its bucket is
gathered on demand and remembered for the reading module (gathered with it from then on, so a parent reading a
child's weight works from the first step); outside, a clear error. The order is relearned every forward: control
flow that changes between steps costs extra gathers, never correctness. Every rank must run the same modules in
the same order (the gathers are collectives), as with any ZeRO-3; where they do not, every waiting rank raises
``RanksDiverged`` naming where each rank is (:mod:`zero_ext.comm.divergence`: a phase check at the start of every
forward and backward, and a comparison of positions through the store when a wait outlasts ``collective_timeout``).

Inside ``gathered_params()`` (:meth:`gathered`: collective, every bucket gathered on entry) a forward is local to
its rank: its hooks return at once, so it issues no collective and leaves the learned order, the prefetch schedule
and the window as the training forwards left them. That is what makes evaluation or generation on one rank work
(``with opt.gathered_params(): if rank == 0: evaluate()``): had it fed the order, that rank's next training forward
would prefetch differently from the others' and their all-gathers would pair up wrongly (gloo aborts: "op.preamble
.length <= op.nbytes"). Its graph (grad enabled) cannot be backpropagated: the gradients would be reduced by that
rank alone, so a backward into it raises (inside the context or after). A rank that enters the context while the
others do not gathers alone: wrong, the context is collective (its all-gathers pair with the others' training
ones: on gloo the process receiving the larger message aborts, "op.preamble.length <= op.nbytes"; NCCL may hang or
mix up data) unless the entry is checked: with ``collective_timeout`` (the default) it is a store barrier, so the
lone rank waits there, out of every collective, and every rank raises ``RanksDiverged`` (divergence.py).

[Note: stage 3 timeline]
``nn.Sequential`` of three Linear layers, one bucket each, ``prefetch=1``, ``reshard_after_forward=True``, a step
after the first (the order is known); traced from the engine. ``[`` start_param_sync (the storage gets its bytes
back, the all-gather is in flight: ``.``), ``|`` finish_param_sync (GATHERED: plain tensors, ``=``), ``r`` READY
(the bucket's gradients all arrived: its reduce-scatter is launched in turn), ``]`` reshard (zero bytes)::

              fwd: root L1          L2            L3         bwd: L3           L2           L1         step()
    b1 (L1)         [....|=======]                                 [..............................|===r]
    b2 (L2)                 [.......|========== held BACKWARD ====================r]
    b3 (L3)                               [.......|== held BACKWARD ======r]
                    root's pre-hook prefetches b1; each module's pre-hook waits for its bucket and prefetches the
                    next; backward's first module prefetches the one after the held ones. Nothing is gathered in
                    step(): every bucket is SHARDED, the shards are updated in place, the next forward gathers.

At most the deepest module chain's buckets plus the prefetched and held ones are gathered at once, and these
storages are the only full parameter values alive: autograd's saved views point into them, so what is alive is
what is drawn.
"""

from __future__ import annotations

import contextlib
import enum

import torch

from ..state.sharded_params import original_class, shard_class, watch
from ..state.sharded_state import ShardedState
from .backward_hooks import BackwardSignals, Call, in_backward, refuse_backward
from .bucket_runtime import BucketRuntime, Key, ParamState
from .gather_units import hooked_modules, own_params
from .model_state import wrapping_in_ddp
from .param_sync import start_after_update
from .runtime import BucketRuntimes
from .sleep import asleep

SHARDED, GATHERING, GATHERED = ParamState.SHARDED, ParamState.GATHERING, ParamState.GATHERED


class Hold(enum.Enum):
    """Why a gathered bucket nobody is using now stays gathered."""

    NONE = "none"  # nothing: released by the next trigger that finds it unused
    AHEAD = "ahead"  # prefetched for a module about to run; not evicted
    BACKWARD = "backward"  # kept from forward for the first modules of backward; may be evicted
    RECOMPUTED = "recomputed"  # gathered for a forward activation checkpointing recomputes: until its backward
    UNTIL_READY = "until_ready"  # read by backward and only its gradients' arrival (READY) says when it is done


class _Use:
    """The schedule's facts about one bucket (this file's alone): the module calls running forward / backward that
    use it now, why it is held otherwise, and the uses still to come this step (predicted from the previous step)."""

    __slots__ = ("forward_users", "backward_users", "hold", "forward_uses_left", "backward_uses_left")

    def __init__(self):
        self.forward_users = self.backward_users = self.forward_uses_left = self.backward_uses_left = 0
        self.hold = Hold.NONE


_LOCAL_BACKWARD = (
    "{name}(stage=3): backward through a forward that ran inside `opt.gathered_params()`. A forward "
    "there is local to its rank (evaluation, generation: no collective, the gather schedule untouched), so its "
    "gradients cannot be reduced with the other ranks'. Run training forwards and backwards outside the context; "
    "evaluate inside it under `torch.no_grad()`"
)


class ParamGather:
    deferred = True  # step() never gathers: the next use does

    def __init__(
        self, state: ShardedState, runtimes: BucketRuntimes, module: torch.nn.Module, reshard_after_forward: bool,
        prefetch: int, gather_units="auto", name: str = "zero_ext.ZeroAdamW",
    ):  # fmt: skip
        self.state, self.comm, self.module = state, state.comm, module
        self.name = name  # the optimizer, as messages name it
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.runtime: dict[Key, BucketRuntime] = runtimes.buckets
        self.live: dict[Key, BucketRuntime] = {}  # the window: buckets not SHARDED (changed by _gather, _release)
        self.peak_bytes = 0  # the most bytes the gathered storages held at once (gathered_params() aside)
        self._stack: list[torch.nn.Module] = []
        self._trace: list[torch.nn.Module] = []  # this forward's module order
        self._last: list[torch.nn.Module] = []  # the previous forward's
        self._pos = 0  # where this forward is in the previous one's order
        self._tail: list[Key] = []  # used first in backward: held from their last use in forward (predicted)
        self._manual = 0  # gathered_params() depth
        self.gather_units = gather_units
        self.use: dict[Key, _Use] = {}  # the schedule's facts about each bucket
        self._signals = BackwardSignals()  # a module call's backward starts / is done
        # A bucket's run (the buckets of one split parameter, or itself) shares one gathered storage: its bytes,
        # which the window counts once for all the run's buckets that are not SHARDED.
        self.run_of: dict[Key, tuple[int, int]] = {}
        self.run_bytes: dict[tuple[int, int], int] = {}
        self.keys: dict[int, set[Key]] = {}  # id(module) -> buckets it uses (own parameters, then learned reads)
        self.sharded: dict[int, tuple[tuple[Key, ...], str]] = {}  # id(parameter) -> (its buckets, its name)
        self._hooks = []
        self._replica_syncs = []  # mesh chunks being completed after step() (bucket_updated)
        self.position = self.comm.position  # where this rank is, for the divergence check (divergence.py)
        self.names = {id(m): name for name, m in module.named_modules()}
        self._recompute_peak = 0  # the most bytes a recomputed (checkpointed) forward held gathered at once
        self._backward_due = False  # a training forward ended: its backward's start is checked across ranks
        self._take(state.groups)

    def extend(self, added) -> None:
        """Flat groups ``added`` (``add_param_group``; their runtimes SHARDED in ``runtime`` already): their parameters
        sharded like the others, each gathered by the unit that owns it (hooked now if it had nothing to gather
        before). The learned order, the peak and what is gathered (nothing, between steps) stay; the window's bound
        grows by what the units now gather."""
        self._take(added)

    def _take(self, groups) -> None:
        """The parameters of ``groups`` become sharded tensors that their units' hooks gather."""
        where = {}
        for key in self.runtime:
            self.use.setdefault(key, _Use())
        for group in groups:
            layout = group.layout
            for run in layout.runs:
                self.run_bytes[(group.index, run.index)] = run.numel * group.dtype.itemsize
                for b in run.buckets:
                    self.run_of[(group.index, b)] = (group.index, run.index)
            for slot, p in zip(layout.slots, group.params):
                keys = tuple((group.index, b) for b in slot.buckets)
                where[id(p)] = keys
                self.sharded[id(p)] = (keys, group.names[slot.index])
                watch(p, self)  # (sharded_params: its reads gather through ensure())
                original = original_class(type(p))  # (a class of its own already sharded)
                p.__class__ = shard_class(original)
                # the checking class while a bucket of it is not GATHERED, its own once all are (the bucket swaps)
                buckets = tuple(self.runtime[key] for key in keys)
                for rt in buckets:
                    rt.add_member(p, original, type(p), buckets)
        for m, members in hooked_modules(self.module, self.gather_units):  # (gather_units.py: what one hook gathers)
            own = {key for p in own_params(members) if id(p) in where for key in where[id(p)]}
            if id(m) in self.keys:
                self.keys[id(m)] |= own
            elif own or m is self.module:
                self.keys[id(m)] = own
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._post_forward))
        self._static_bound = self._bound()

    # ---------------------------------------------------------------- the window
    @property
    def window_bound(self) -> int:
        """Bytes of gathered buckets the window may hold at once (``memory_report().window_bound``): the bytes of
        the buckets the deepest chain of nested modules uses (a module runs inside its parents, whose buckets stay
        in use), plus the ``prefetch + 1`` largest buckets (the prefetched ones, and one more: gathered on demand,
        or still waiting for its gradients), plus the largest segment activation checkpointing recomputed so far;
        every bucket with ``reshard_after_forward=False``. A parameter split across buckets (``zero_ext/layout.py``) is gathered
        whole, all its buckets with it, into one storage: the window is at least the largest parameter, inherently
        (its module needs all of it at once); what is bounded by bytes is every buffer beside it (staging, offload).
        A prefetched bucket is counted with its whole run's bytes. ``peak_bytes`` (``window_peak``) is the most bytes
        the gathered storages held at once, measured on them each time one is refilled (``gathered_params()`` aside:
        it gathers everything on purpose)."""
        return min(self._every_bucket(), self._static_bound + self._recompute_peak)

    def _every_bucket(self) -> int:
        return sum(rt.nbytes for rt in self.runtime.values())

    def _bound(self) -> int:
        if not self.reshard_after_forward:
            return self._every_bucket()
        deepest = 0

        def walk(m, held):
            nonlocal deepest
            held = held | self.keys.get(id(m), set())
            deepest = max(deepest, sum(self.runtime[k].nbytes for k in held))
            for child in m.children():
                walk(child, held)

        walk(self.module, set())
        # a prefetched bucket brings its whole run's storage
        ahead = sum(sorted(self.run_bytes.values(), reverse=True)[: self.prefetch + 1])
        return min(self._every_bucket(), deepest + ahead)

    def gathered_bytes(self) -> int:
        """Bytes the buckets' gathered storages hold now (measured on the storages, not counted here)."""
        return sum(group.flat_params.gathered_bytes() for group in self.state.groups)

    def _live_bytes(self) -> int:
        """Bytes of the storages of the runs with a bucket not SHARDED (what they hold, by construction)."""
        return sum(self.run_bytes[run] for run in {self.run_of[key] for key in self.live})

    def _incoming(self, rt: BucketRuntime) -> int:
        """Bytes gathering ``rt`` adds: its run's storage, unless another bucket of the run holds it already."""
        run = self.run_of[rt.key]
        return 0 if any(self.run_of[key] == run for key in self.live) else self.run_bytes[run]

    # ---------------------------------------------------------------- the two transitions this file makes
    def _gather(self, rt: BucketRuntime, wait: bool) -> None:
        """Make ``rt`` present: start its all-gather unless it is gathered or in flight; with ``wait``, finish it
        (its parameters then become plain tensors). Never a second gather of a bucket that is present."""
        if rt.params is SHARDED:
            self._make_room(self._incoming(rt))
            self._finish_replica_syncs()  # (a mesh's chunks complete first: bucket_updated)
            rt.start_param_sync(self.comm)
            self.live[rt.key] = rt
            if not self._manual:
                self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())
        if wait:
            if self.use[rt.key].hold is Hold.AHEAD:
                self.use[rt.key].hold = Hold.NONE
            if rt.params is GATHERING:
                rt.finish_param_sync()  # (its parameters become plain tensors: the bucket swaps their classes)

    def _release(self, rt: BucketRuntime) -> None:
        """The one path that frees a gathered bucket: when nothing uses it now and nothing holds it (the caller
        clears the holds its trigger ends). Waits for a gather in flight first (it writes into the storage)."""
        if (
            rt.params is SHARDED
            or self.use[rt.key].forward_users
            or self.use[rt.key].backward_users
            or self.use[rt.key].hold is not Hold.NONE
        ):
            return
        if rt.params is GATHERING:
            rt.finish_param_sync()
        rt.reshard()  # (its parameters check their reads again)
        del self.live[rt.key]

    def _make_room(self, incoming: int) -> None:
        """Evict held buckets (gathered again at their next use) while ``incoming`` bytes would not fit, the one
        needed farthest ahead first; never one in use, prefetched, or that backward could not gather again."""
        while self._live_bytes() + incoming > self.window_bound and not self._manual:
            held = [rt for rt in self.live.values() if not self.use[rt.key].forward_users and not self.use[rt.key].backward_users
                    and self.use[rt.key].hold in (Hold.NONE, Hold.BACKWARD)]  # fmt: skip
            if not held:
                return
            upcoming = self._last[self._pos :]
            next_use = {rt.key: next((i for i, m in enumerate(upcoming) if rt.key in self.keys[id(m)]), len(upcoming))
                        for rt in held}  # fmt: skip
            victim = max(held, key=lambda rt: next_use[rt.key])
            self.use[victim.key].hold = Hold.NONE
            self._release(victim)

    def _release_everything(self, forward_too: bool) -> None:
        """Release every bucket but those a running forward uses (all of them with ``forward_too``)."""
        for rt in list(self.live.values()):
            self.use[rt.key].backward_users = 0
            if forward_too:
                self.use[rt.key].forward_users = 0
            self.use[rt.key].hold = Hold.NONE
            self._release(rt)

    # ---------------------------------------------------------------- what step() and finish_sync() call
    def bucket_updated(self, group, bucket) -> None:
        """Nothing to gather: every bucket was released before the update, and the next use gathers the new
        values (this rank's slice, rounded from the master, goes straight into the all-gather). On a mesh whose
        state is sharded over every rank, the replicas' updated slices are gathered into this rank's chunk
        (``state.sharded_params.ChunkedParams``), in flight until the first gather after ``step()`` (or
        :meth:`settle`) waits for them all: ``step()`` returns without waiting (this scheduler is ``deferred``), and
        a gather from a chunk still being written would send the previous step's slices of the other replicas."""
        pending = start_after_update(self.comm, group, bucket)
        if pending is not None:
            self._replica_syncs.append(pending)

    def _finish_replica_syncs(self) -> None:
        while self._replica_syncs:
            self._replica_syncs.pop(0).wait()

    def settle(self) -> None:
        """Outside forward and backward nothing stays gathered: release every bucket (before ``step()`` updates
        the shards they were gathered from, and for ``finish_sync()``)."""
        self._finish_replica_syncs()
        if not self._stack and not self._manual:
            self._release_everything(forward_too=True)

    def ensure(self, param, func) -> None:
        """A read of ``param`` (torch op ``func``) while its bucket (one of its buckets) is not GATHERED: gather
        them (on demand)."""
        keys, param_name = self.sharded[id(param)]
        runtimes = [self.runtime[key] for key in keys]
        if all(rt.params is not SHARDED for rt in runtimes):
            self._gather_all(runtimes)
            return
        if not (self._stack or self._manual or in_backward()):
            refusal = wrapping_in_ddp(self.name)
            if refusal is not None:
                raise RuntimeError(refusal)
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"{self.name}(stage=3): parameter {param_name!r} is sharded here (outside forward "
                f"and backward), so `{name}` cannot use it. Read parameters inside `with opt.gathered_params():` "
                "(on every rank: it gathers them), change them (e.g. `model.load_state_dict`) inside "
                "`with opt.gathered_params(modifier_rank=r):`, or get a full copy with zero_ext.checkpoint.consolidate."
            )
        self._gather_all(runtimes)
        if self._stack:  # remembered for the reading module: gathered with it from now on
            owner = self._stack[-1]
            for rt in runtimes:
                if rt.key not in self.keys[id(owner)]:
                    self.keys[id(owner)].add(rt.key)
                    self.use[rt.key].forward_users += 1  # in use like its own parameters until the module's post-hook

    def _gather_all(self, runtimes) -> None:
        """Gather ``runtimes`` (a split parameter's buckets): every all-gather started, then each waited for."""
        for rt in runtimes:
            self._gather(rt, wait=False)
        for rt in runtimes:
            self._gather(rt, wait=True)

    # ---------------------------------------------------------------- forward
    def _local(self) -> bool:
        """A forward that began inside ``gathered_params()``: every bucket is gathered and in use, so it needs no
        gather, and it is often one rank's alone (evaluation or generation on rank 0). It runs on the hooks'
        bypass: no collective, and nothing it does reaches the trace, the prefetch schedule or the window, which
        must stay the same on every rank (the next step's gathers pair up across ranks in their order)."""
        return bool(self._manual) and not self._stack

    @torch.compiler.disable
    def _pre_forward(self, module, args, kwargs):
        if self._local():
            return None
        sleeping = asleep(self.state)  # offload_states() parked what the gathers read: refused before anything
        if sleeping is not None and sleeping.blocks_forward():
            raise sleeping.refusal("a stage-3 forward")
        if in_backward():
            # Activation checkpointing recomputing a forward inside backward (and perhaps stopping it early, so
            # no post-hook may follow): gather, and hold until the module's backward or the bucket's READY.
            self.position.at("backward (recomputing forward)", self.names.get(id(module), ""))
            for key in self.keys[id(module)]:
                rt = self.runtime[key]
                if self.use[rt.key].hold is not Hold.UNTIL_READY:
                    self.use[rt.key].hold = Hold.RECOMPUTED
                self._gather(rt, wait=True)
            recomputed = sum(rt.nbytes for rt in self.live.values() if self.use[rt.key].hold is Hold.RECOMPUTED)
            self._recompute_peak = max(self._recompute_peak, recomputed)
            return None
        if module is self.module and (not self._stack or self._stack[0] is module):
            if self.comm.watch is not None:  # every rank starts the same phase (divergence.py)
                phase = "forward" if torch.is_grad_enabled() else "forward (no_grad)"
                self.position.at(phase, "")
                self.comm.watch.boundary(phase)
            self._begin_forward()  # (a stack left over means the previous forward raised: start clean)
        self._stack.append(module)
        self.position.at("forward" if torch.is_grad_enabled() else "forward (no_grad)", self.names.get(id(module), ""))
        if self._stack[0] is self.module:
            self._trace.append(module)
        for key in self.keys[id(module)]:
            rt = self.runtime[key]
            self.use[rt.key].forward_users += 1
            self._gather(rt, wait=True)
        self._prefetch_after(module)
        if torch.is_grad_enabled() and self.keys[id(module)]:
            # keyword inputs too: attn(h, key=h, value=h) must still see one tensor (backward_hooks.wrap_inputs)
            return self._signals.wrap_inputs(module, (args, kwargs), self._post_backward)
        return None

    @torch.compiler.disable
    def _post_forward(self, module, _args, output) -> None:
        if self._local():
            if torch.is_grad_enabled():
                refuse_backward(output, _LOCAL_BACKWARD.format(name=self.name))
            return
        if in_backward():
            return
        self._stack.pop()
        keys = self.keys[id(module)]
        runtimes = [self.runtime[k] for k in keys]
        for rt in runtimes:
            self.use[rt.key].forward_users -= 1
        training = torch.is_grad_enabled()
        if training and keys and not self._signals.hook_outputs(module, output, self._pre_backward):
            for rt in runtimes:  # nothing will tell us when its backward starts: hold until READY
                self.use[rt.key].hold = Hold.UNTIL_READY
        if self.reshard_after_forward or not training:
            for rt in runtimes:
                self.use[rt.key].forward_uses_left -= 1
                if self.use[rt.key].forward_uses_left > 0 or self.use[rt.key].hold is Hold.UNTIL_READY:
                    continue
                if training and rt.key in self._tail:
                    self.use[rt.key].hold = Hold.BACKWARD
                else:
                    self._release(rt)
        if not self._stack and module is self.module:
            self._end_forward(training)

    def _begin_forward(self) -> None:
        for module in self._stack:  # a forward that raised left these in use
            for key in self.keys[id(module)]:
                rt = self.runtime[key]
                self.use[rt.key].forward_users = max(0, self.use[rt.key].forward_users - 1)
        self._stack.clear()
        self._last, self._trace, self._pos = self._trace or self._last, [], 0
        for rt in self.runtime.values():
            self.use[rt.key].forward_uses_left = 0
            if self.use[rt.key].hold in (Hold.BACKWARD, Hold.UNTIL_READY):  # from a forward whose backward never came
                self.use[rt.key].hold = Hold.NONE
        for m in self._last:
            for key in self.keys[id(m)]:
                self.use[key].forward_uses_left += 1
        self._tail = self._backward_head(self._last)

    def _end_forward(self, training: bool) -> None:
        self._backward_due = training
        for rt in self.runtime.values():
            self.use[rt.key].backward_uses_left = 0
        for m in self._trace:
            for key in self.keys[id(m)]:
                self.use[key].backward_uses_left += 1
        tail = self._backward_head(self._trace) if training else []
        if self.reshard_after_forward or not training:
            for rt in list(self.live.values()):
                if self.use[rt.key].hold is Hold.AHEAD:  # prefetched for a module that did not run this time
                    self.use[rt.key].hold = Hold.NONE
                if not training:
                    self.use[rt.key].hold = Hold.NONE
                elif rt.key in tail and self.use[rt.key].hold is Hold.NONE:
                    self.use[rt.key].hold = Hold.BACKWARD
                elif rt.key not in tail and self.use[rt.key].hold is Hold.BACKWARD:
                    self.use[rt.key].hold = Hold.NONE
                self._release(rt)
        self._tail = []

    def _backward_head(self, trace) -> list[Key]:
        """The first ``prefetch + 1`` buckets backward gathers: the root's (its output's gradient arrives first),
        then those of the last modules of ``trace``. Releasing them at the end of forward only to gather them
        again at once, with nothing to overlap that gather, is waste (the benchmark GPT, fp32, 2 gloo ranks: 1.196x
        -> 1.120x DDP, bench/results/engine_step_before_after_stage3.md); they are held, as FSDP2 keeps its root's
        parameters. The window bound holds: ``prefetch + 1`` is within it, and eviction may still free them."""
        head: list[Key] = []
        for m in ([self.module] if trace else []) + list(reversed(trace)):
            for key in sorted(self.keys[id(m)]):
                if len(head) > self.prefetch:
                    return head
                if key not in head:
                    head.append(key)
        return head

    def _prefetch_after(self, module) -> None:
        if not self.prefetch or not self._last:
            return
        try:
            self._pos = self._last.index(module, self._pos) + 1
        except ValueError:
            return
        self._prefetch(self._last[self._pos :])

    def _prefetch(self, upcoming) -> None:
        """Start gathering the first buckets ``upcoming`` modules use that are not present, keeping at most
        ``prefetch`` gathered ahead of use and the window within its bound."""
        ahead = sum(self.use[rt.key].hold is Hold.AHEAD for rt in self.live.values())
        for m in upcoming:
            for key in sorted(self.keys[id(m)]):
                if ahead >= self.prefetch:
                    return
                rt = self.runtime[key]
                if rt.params is SHARDED:
                    if self._live_bytes() + self._incoming(rt) > self.window_bound:
                        return
                    self._gather(rt, wait=False)
                    self.use[rt.key].hold = Hold.AHEAD
                    ahead += 1

    # ---------------------------------------------------------------- backward
    @torch.compiler.disable
    def _pre_backward(self, call: Call) -> None:
        if call.started:
            return
        call.started = True
        module = call.module
        if self._backward_due and self.comm.watch is not None:  # every rank starts the same phase (divergence.py)
            self._backward_due = False
            self.comm.watch.boundary("backward")
        self.position.at("backward", self.names.get(id(module), ""))
        for key in self.keys[id(module)]:
            rt = self.runtime[key]
            self.use[rt.key].backward_users += 1
            self._gather(rt, wait=True)
        if self.prefetch and module in self._trace:  # the modules before it run their backward next
            # ... except the root: its outputs' gradient arrives first, so its pre-backward has run already, and a
            # bucket of its own released since (all its gradients in) is needed by no one.
            before = self._trace[: self._trace.index(module)]
            self._prefetch(m for m in reversed(before) if m is not self.module)

    @torch.compiler.disable
    def _post_backward(self, call: Call) -> None:
        for key in self.keys[id(call.module)]:
            rt = self.runtime[key]
            if call.started and self.use[rt.key].backward_users > 0:
                self.use[rt.key].backward_users -= 1
            self.use[rt.key].backward_uses_left -= 1
            if self.use[rt.key].backward_uses_left <= 0 and self.use[rt.key].hold is not Hold.UNTIL_READY:
                self.use[rt.key].hold = Hold.NONE
                self._release(rt)

    def bucket_ready(self, rt: BucketRuntime) -> None:
        """All gradients of the bucket arrived (the reducer's READY): backward needs its parameters no more."""
        self.use[rt.key].backward_users = 0
        self.use[rt.key].hold = Hold.NONE
        self._release(rt)

    def backward_done(self) -> None:
        """The end of a backward pass (the reducer's round end): release what backward still held."""
        self._release_everything(forward_too=False)

    @contextlib.contextmanager
    def gathered(self):
        """Every bucket gathered and in use for the duration (collective: every rank enters). A forward that begins
        inside is local to its rank (see :meth:`_local`): rank 0 alone may evaluate or generate."""
        self.position.at("gathered_params")
        if self.comm.watch is not None:  # collective: a rank entering alone waits here, out of every collective
            self.comm.watch.enter_gathered()
        self._manual += 1
        try:
            for rt in self.runtime.values():
                self.use[rt.key].forward_users += 1
                self._gather(rt, wait=True)
            yield
        finally:
            for rt in self.runtime.values():
                self.use[rt.key].forward_users -= 1
            self._manual -= 1
            self.settle()

    def restore(self) -> None:
        """Undo what construction did to the model: every parameter a full tensor of its own again (collective),
        its original class back, the hooks gone; the gathered storages are then released for good."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with self.gathered():
            done = set()
            for rt in self.runtime.values():
                rt.unshard_params(done)  # released below without touching them again
            self.sharded.clear()

    def remove_hooks(self) -> None:
        self.restore()
