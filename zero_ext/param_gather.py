"""Stage 3: parameters gathered bucket by bucket just before a module uses them, and freed after.

Forward: a pre-hook on every module that owns parameters gathers their buckets (waiting for those already in
flight) and pins them while the module runs; it then prefetches up to ``prefetch`` buckets ahead, in the execution
order learned from the previous forward. The post-hook unpins and frees a bucket once the uses the previous forward
made of it are done (the first forward frees after every use; a module met again gathers again). A bucket held for
a later use is evicted (and gathered again later) when the window would exceed its bound.
The buckets backward needs first (the root's, then the last modules', ``prefetch + 1`` of them) are kept from
forward into backward instead of freed and gathered again at once. ``reshard_after_forward=False`` keeps every
bucket until its backward is done (no second gather). Under ``torch.no_grad()`` buckets are always freed after use.

Backward: the post-hook puts a hook on the module's outputs and an identity autograd function on its inputs. When
the outputs' gradient arrives (before the module's backward runs) its buckets are gathered again and those of the
modules before it prefetched; when the inputs' gradient has been computed (the module's backward is done) a
bucket whose backward uses are all done is freed. Whatever has no such hook (an input that needs no gradient) is
freed when all its bucket's gradients have arrived (the reducer's READY), or at the end of backward.

Any other read of a parameter goes through ``sharded_params``' check: inside forward or backward its bucket is
gathered on demand and remembered for the reading module (gathered with it from then on, so a parent reading a
child's weight works from the first step); outside, a clear error. The order is relearned every forward: control
flow that changes between steps costs extra gathers, never correctness. Every rank must run the same modules in
the same order (the gathers are collectives), as with any ZeRO-3.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .buffers import ShardedState
from .comm import Pending
from .sharded_params import shard_class

Key = tuple[int, int]  # (flat group index, bucket index)


class _Call:
    """One call of a module: its backward pre-hook must run once, however many outputs carry a gradient."""

    __slots__ = ("module", "started")

    def __init__(self, module):
        self.module, self.started = module, False


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward has produced their gradients."""

    @staticmethod
    def forward(ctx, gather, call, *inputs):
        ctx.gather, ctx.call = gather, call
        ctx.set_materialize_grads(False)
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gather._post_backward(ctx.call)
        return (None, None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParamGather:
    deferred = True  # step() never gathers: the next use does

    def __init__(self, state: ShardedState, module: torch.nn.Module, reshard_after_forward: bool, prefetch: int):
        self.state, self.comm, self.module = state, state.comm, module
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.bucket_of = {(g.index, b.index): (g, b) for g, b in state.buckets()}
        self.live: dict[Key, Optional[Pending]] = {}  # gathered buckets (None) or in flight (their Pending)
        self.pins: Counter = Counter()  # modules running forward (and gathered_params) that use a bucket
        self.in_backward: Counter = Counter()  # module calls whose backward runs and uses a bucket
        self.keep: set[Key] = set()  # needed in backward and nothing tells us when: freed at READY
        self.recomputed: set[Key] = set()  # gathered for a forward recomputed in backward: freed at READY
        self.peak_bytes = 0  # the most bytes the gathered storages held at once (gathered_params() aside)
        self._ahead: set[Key] = set()  # prefetched and not yet used: at most `prefetch` of them
        self._stack: list[torch.nn.Module] = []
        self._trace: list[torch.nn.Module] = []  # this forward's module order
        self._last: list[torch.nn.Module] = []  # the previous forward's
        self._uses_left: Counter = Counter()  # forward uses still to come (from the previous forward)
        self._backward_uses: Counter = Counter()  # backward uses still to come (from this forward)
        self._pos = 0  # where this forward is in the previous one's order
        self._tail: list[Key] = []  # used first in backward: kept from their last use in forward (predicted)
        self._manual = 0  # gathered_params() depth
        where = {}
        # Each bucket's parameters with their two classes: the checking one while the bucket is not gathered (or
        # its gather is in flight), their own once it is: a gathered parameter is an ordinary tensor, and the ops
        # of forward and backward on it pay nothing for the checks (about 600 calls per step on the benchmark GPT).
        self.classes: dict[Key, list[tuple[torch.Tensor, type, type]]] = {}
        for group in state.groups:
            for slot, p in zip(group.layout.slots, group.params):
                key = (group.index, slot.bucket)
                where[id(p)] = key
                p._zero_ext_key, p._zero_ext_name, p._zero_ext_gather = key, group.names[slot.index], self
                original = type(p)
                p.__class__ = shard_class(original)
                self.classes.setdefault(key, []).append((p, original, type(p)))
        self._exposed: set[Key] = set()
        self.keys: dict[int, set[Key]] = {}  # id(module) -> buckets it uses (own parameters, then learned reads)
        self._hooks = []
        for m in module.modules():
            own = {where[id(p)] for p in m.parameters(recurse=False) if id(p) in where}
            if own or m is module:
                self.keys[id(m)] = own
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(m.register_forward_hook(self._post_forward))
        self.nbytes = {key: b.numel * g.flat_params.dtype.itemsize for key, (g, b) in self.bucket_of.items()}
        self._static_bound = self._bound()
        self._recompute_peak = 0  # the most bytes a recomputed (checkpointed) forward held gathered at once

    @property
    def window_bound(self) -> int:
        """Bytes of gathered buckets the window may hold at once: the static bound, plus the largest segment
        activation checkpointing recomputed so far (a recompute needs its whole segment gathered)."""
        return min(sum(self.nbytes.values()), self._static_bound + self._recompute_peak)

    def _bound(self) -> int:
        """The window's static bound, in bytes: the buckets the deepest chain of nested modules uses (a module
        runs inside its parents, whose buckets stay pinned), plus the ``prefetch + 1`` largest buckets (those
        gathered ahead of use, and one more: one gathered on demand, or one whose gradients are still arriving);
        every bucket when nothing is freed in forward."""
        total = sum(self.nbytes.values())
        if not self.reshard_after_forward:
            return total
        deepest = 0

        def walk(m, held):
            nonlocal deepest
            held = held | self.keys.get(id(m), set())
            deepest = max(deepest, sum(self.nbytes[k] for k in held))
            for child in m.children():
                walk(child, held)

        walk(self.module, set())
        ahead = sum(sorted(self.nbytes.values(), reverse=True)[: self.prefetch + 1])
        return min(total, deepest + ahead)

    def gathered_bytes(self) -> int:
        """Bytes the buckets' gathered storages hold now (measured on the storages, not counted here)."""
        return sum(group.flat_params.gathered_bytes() for group in self.state.groups)

    def _live_bytes(self) -> int:
        return sum(self.nbytes[k] for k in self.live)

    # ---------------------------------------------------------------- gather / free
    def _gather(self, key: Key, wait: bool) -> None:
        if wait:
            self._ahead.discard(key)
        if key not in self.live:
            self._make_room(self.nbytes[key])
            group, bucket = self.bucket_of[key]
            full = group.flat_params.allocate(bucket)
            self.live[key] = self.comm.start_all_gather(full, group.flat_params.gather_input(bucket, full))
            if not self._manual:  # gathered_params() holds everything on purpose: not the window
                self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())
        if wait and self.live[key] is not None:
            self.live[key].wait()
            self.live[key] = None
        if wait and key not in self._exposed:
            self._exposed.add(key)
            for p, original, _ in self.classes[key]:
                p.__class__ = original

    def _free(self, key: Key) -> None:
        if key in self.live and not self.pins[key] and not self.in_backward[key] and key not in self.recomputed:
            pending = self.live.pop(key)
            self._ahead.discard(key)
            if pending is not None:
                pending.wait()  # the gather must be done before its buffer can be reused
            if key in self._exposed:
                self._exposed.discard(key)
                for p, _, checking in self.classes[key]:
                    p.__class__ = checking
            group, bucket = self.bucket_of[key]
            group.flat_params.release(bucket)

    def _make_room(self, incoming: int) -> None:
        """Evict held buckets (gathered again at their next use) while ``incoming`` bytes would not fit, the one
        needed farthest ahead first; never one in use, needed in backward with nothing to gather it again, or
        prefetched."""
        while self._live_bytes() + incoming > self.window_bound and not self._manual:
            held = [k for k in self.live if not self.pins[k] and not self.in_backward[k] and k not in self._ahead
                    and k not in self.keep and k not in self.recomputed]  # fmt: skip
            if not held:
                return
            upcoming = self._last[self._pos :]
            next_use = {k: next((i for i, m in enumerate(upcoming) if k in self.keys[id(m)]), len(upcoming))
                        for k in held}  # fmt: skip
            self._free(max(held, key=next_use.__getitem__))

    def release_all(self) -> None:
        """Free every gathered bucket (before step() updates the shards they were gathered from)."""
        self._stack.clear()
        self.recomputed.clear()
        self.keep.clear()
        for key in list(self.live):
            self.pins[key] = self.in_backward[key] = 0
            self._free(key)
        self._ahead.clear()

    def ensure(self, param, func) -> None:
        """A read of ``param`` (torch op ``func``): its bucket must be gathered."""
        key = param._zero_ext_key
        if key in self.live:
            if self.live[key] is not None:
                self._gather(key, wait=True)
            return
        if not (self._stack or self._manual or _in_backward()):
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"zero_ext.ZeroAdamW(stage=3): parameter {param._zero_ext_name!r} is sharded here (outside forward "
                f"and backward), so `{name}` cannot use it. Read parameters inside `with opt.gathered_params():` "
                "(on every rank: it gathers them), change them (e.g. `model.load_state_dict`) inside "
                "`with opt.gathered_params(modifier_rank=r):`, or get a full copy with zero_ext.checkpoint.consolidate."
            )
        self._gather(key, wait=True)
        if self._stack:  # remembered for the reading module: gathered with it from now on
            owner = self._stack[-1]
            if key not in self.keys[id(owner)]:
                self.keys[id(owner)].add(key)
                self.pins[key] += 1  # pinned like its own parameters until the module's post-hook

    # ---------------------------------------------------------------- forward
    @torch.compiler.disable
    def _pre_forward(self, module, args):
        if _in_backward():
            # Activation checkpointing recomputing a forward inside backward (and perhaps stopping it early, so
            # no post-hook may follow): gather, and keep until the bucket's gradients are in.
            for key in self.keys[id(module)]:
                self.recomputed.add(key)
                self._recompute_peak = max(self._recompute_peak, sum(self.nbytes[k] for k in self.recomputed))
                self._gather(key, wait=True)
            return None
        if module is self.module and (not self._stack or self._stack[0] is module):
            self._begin_forward()  # (a stack left over means the previous forward raised: start clean)
        self._stack.append(module)
        if self._stack[0] is self.module:
            self._trace.append(module)
        for key in self.keys[id(module)]:
            self.pins[key] += 1
            self._gather(key, wait=True)
        self._prefetch_after(module)
        if torch.is_grad_enabled() and not _in_backward() and self.keys[id(module)]:
            return self._wrap_inputs(module, args)
        return None

    @torch.compiler.disable
    def _post_forward(self, module, _args, output) -> None:
        if _in_backward():
            return
        self._stack.pop()
        keys = self.keys[id(module)]
        for key in keys:
            self.pins[key] -= 1
        training = torch.is_grad_enabled()
        if training and keys and not self._hook_outputs(module, output):
            self.keep |= keys  # nothing will tell us when its backward starts: keep them until their READY
        if self.reshard_after_forward or not training:
            for key in keys:
                self._uses_left[key] -= 1
                if self._uses_left[key] <= 0 and (not training or (key not in self.keep and key not in self._tail)):
                    self._free(key)
        if not self._stack and module is self.module:
            self._end_forward(training)

    def _begin_forward(self) -> None:
        for module in self._stack:  # a forward that raised left these pinned
            for key in self.keys[id(module)]:
                self.pins[key] = max(0, self.pins[key] - 1)
        self._stack.clear()
        self._last, self._trace, self._pos = self._trace or self._last, [], 0
        self._uses_left = Counter(key for m in self._last for key in self.keys[id(m)])
        self._tail = self._backward_head(self._last)
        self.keep.clear()

    def _end_forward(self, training: bool) -> None:
        self._backward_uses = Counter(key for m in self._trace for key in self.keys[id(m)])
        tail = self._backward_head(self._trace) if training else []
        if self.reshard_after_forward or not training:
            for key in list(self.live):
                if not training or (key not in self.keep and key not in tail):
                    self._free(key)
        self._tail = []

    def _backward_head(self, trace) -> list[Key]:
        """The first ``prefetch + 1`` buckets backward gathers: the root's (its output's gradient arrives first),
        then those of the last modules of ``trace``. Freeing them at the end of forward only to gather them again
        at once, with nothing to overlap that gather, is waste (the benchmark GPT, fp32, 2 gloo ranks: 1.196x ->
        1.120x DDP, bench/results/engine_step_before_after_stage3.md); they are kept, as FSDP2 keeps its root's
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
        """Start gathering the first buckets ``upcoming`` modules use that are not gathered, keeping at most
        ``prefetch`` gathered ahead of use and the window within its bound."""
        for m in upcoming:
            for key in sorted(self.keys[id(m)]):
                if len(self._ahead) >= self.prefetch:
                    return
                if key not in self.live:
                    if self._live_bytes() + self.nbytes[key] > self.window_bound:
                        return
                    self._gather(key, wait=False)
                    self._ahead.add(key)

    # ---------------------------------------------------------------- backward
    def _wrap_inputs(self, module, args):
        flat, spec = tree_flatten(args)
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        call = _Call(module)
        module._zero_ext_call = call  # the post-hook's outputs belong to this call
        wrapped = _AfterBackward.apply(self, call, *(flat[i] for i in idx))
        for i, t in zip(idx, wrapped if len(idx) > 1 else (wrapped,)):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _hook_outputs(self, module, output) -> bool:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        call = getattr(module, "_zero_ext_call", None) or _Call(module)
        module._zero_ext_call = None
        for t in tensors:
            t.register_hook(lambda grad, c=call: self._pre_backward(c) or grad)
        return bool(tensors)

    @torch.compiler.disable
    def _pre_backward(self, call: _Call) -> None:
        if call.started:
            return
        call.started = True
        module = call.module
        for key in self.keys[id(module)]:
            self.in_backward[key] += 1
            self._gather(key, wait=True)
        if self.prefetch and module in self._trace:  # the modules before it run their backward next
            # ... except the root: its outputs' gradient arrives first, so its pre-backward has run already, and a
            # bucket of its own freed since (all its gradients in) is needed by no one (prefetching it again was a
            # second gather of the bucket holding a root parameter such as `pos`, measured with small buckets).
            before = self._trace[: self._trace.index(module)]
            self._prefetch(m for m in reversed(before) if m is not self.module)

    @torch.compiler.disable
    def _post_backward(self, call: _Call) -> None:
        for key in self.keys[id(call.module)]:
            if call.started and self.in_backward[key] > 0:
                self.in_backward[key] -= 1
            self._backward_uses[key] -= 1
            if self._backward_uses[key] <= 0 and key not in self.keep:
                self.recomputed.discard(key)
                self._free(key)

    def bucket_reduced(self, group_index: int, bucket_index: int) -> None:
        """All gradients of the bucket arrived (the reducer's READY): its parameters are not needed any more."""
        key = (group_index, bucket_index)
        self.keep.discard(key)
        self.recomputed.discard(key)
        self.in_backward[key] = 0
        self._free(key)

    def backward_done(self) -> None:
        self.recomputed.clear()
        for key in list(self.live):
            self.in_backward[key] = 0
            self.keep.discard(key)
            self._free(key)

    # ---------------------------------------------------------------- the ParamSync interface
    def start_param_sync(self, group, bucket) -> None:
        pass  # the shard is updated in place; the next use gathers it

    def finish_param_sync(self, keys=None) -> None:
        if not self._stack and not self._manual:
            self.release_all()

    @contextlib.contextmanager
    def gathered(self):
        """Every bucket gathered and pinned for the duration (collective)."""
        self._manual += 1
        try:
            for key in self.bucket_of:
                self.pins[key] += 1
                self._gather(key, wait=True)
            yield
        finally:
            for key in self.bucket_of:
                self.pins[key] -= 1
            self._manual -= 1
            if not self._manual and not self._stack:
                self.release_all()

    def restore(self) -> None:
        """Undo what construction did to the model: every parameter a full tensor of its own again (collective),
        its original class back, the hooks gone."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with self.gathered():
            for members in self.classes.values():
                for p, original, _ in members:
                    with torch._C.DisableTorchFunctionSubclass():
                        full = p.data.clone()
                    p.data = full
                    p.__class__ = original
                    del p._zero_ext_gather, p._zero_ext_key, p._zero_ext_name
            self.live.clear()
            self._exposed.clear()

    def remove_hooks(self) -> None:
        self.restore()
