"""``param.grad`` after a synchronised backward: a placeholder for the sharded mean gradient, so that
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works at every stage, as FSDP2's DTensor gradients
make it work there.

After backward the mean gradient exists only in pieces, one per rank (the fp32 grad shard; at stage 1 ``.grad``
would hold this rank's own, un-reduced gradient). So after every synchronised backward each trainable parameter's
``.grad`` becomes a :class:`GradPlaceholder`: a tensor of the parameter's shape, dtype and device with no storage,
whose ops the engine implements on the shards:

- its 2-norm (``torch.linalg.vector_norm``, ``torch._foreach_norm``, ``Tensor.norm``) is the norm of the
  parameter's mean gradient over the ranks. The first norm after a backward computes every parameter's at once:
  one pass over this rank's grad shard and one all-reduce of a vector of one float per parameter. **Collective**:
  every rank must take it, in the same place, as under FSDP2 (torch's function does, when every rank calls it, as
  every DDP trainer does); a rank that does not leaves the others waiting in the all-reduce until the process
  group's timeout. The norm is fp32 whatever the parameter's dtype (the engine's mean gradient is fp32; DDP's
  would be in the parameter's dtype, and so would its norm).
- an in-place multiply (``mul_``, ``_foreach_mul_``: the clipping) is recorded. When every parameter was scaled
  by the same coefficient (torch's function, over all the model's parameters), the next ``step()`` feeds it to the
  fused kernel as its ``grad_scale`` (``ZeroAdamW.clip_grad_norm_``'s path: no pass over the gradients); otherwise
  each parameter's pieces of the grad shard (and stage 1's flat grad buffer) are scaled where they are.
- ``zero_()`` (``model.zero_grad(set_to_none=False)``) zeroes the parameter's pieces.
- autograd's accumulation into an existing ``.grad`` (``grad += new``: the next backward without ``zero_grad``)
  adds nothing to what the shard holds: the new gradient is kept and handed to the reducer as usual.

Any other use (reading values: ``p.grad.sum()``, ``p.grad * 2``, ``.cpu()``, ``clip_grad_value_``, DDP's copy
into ``.grad``) raises on every rank that makes it, naming ``opt.clip_grad_norm_``; ``repr`` says what it is. The
placeholders go before anything else touches the gradients: at the next backward's first gradient (scaling still
pending is then applied, so accumulation continues from the clipped gradients, as with torch), at ``step()`` and at
``zero_grad()``. ``model.zero_grad()`` (or ``p.grad = None``) between backward and ``step()`` drops them, and with
them the gradients, as torch drops a ``.grad`` set to None: a placeholder found gone at ``step()`` or at the next
backward zeroes the parameter's pieces of the shards, and the step leaves the parameter alone (before, stages 2 and 3,
whose shard is the only copy of the gradient, applied it anyway). Stage 1 keeps its gradients across ``step()`` as
torch does, so after a step that applied a clipping (with ``grad_accum_dtype=torch.float32``: after every step, so that
``model.zero_grad()`` reaches that buffer) they come back (see :meth:`after_step`). Inside ``no_sync()`` stage 1's
``.grad`` is this rank's accumulated gradient, as under DDP; nothing is installed.

Cost when nothing clips: installing and dropping them, ~0.9 us a parameter per step on this CPU (100 parameters,
stages 1-3); no memory.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..state.sharded_state import ShardedState
from .grads import Fp32GradBuffer

aten = torch.ops.aten

_NORMS = (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar)
_SCALES = (aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar,
           aten._foreach_mul_.ScalarList)  # fmt: skip


class GradPlaceholder(torch.Tensor):
    """The sharded mean gradient of one parameter: shape, dtype and device of the parameter, no storage."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, owner: "GradPlaceholders", gidx: int):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        t._owner, t._gidx, t._added = weakref.ref(owner), gidx, None
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op reaches __torch_dispatch__ as aten

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = next(t._owner() for t in _flat(args) if isinstance(t, GradPlaceholder))
        if owner is None:
            raise RuntimeError("zero_ext: this gradient belonged to a ZeroAdamW that no longer exists")
        return owner.dispatch(func, args, kwargs)

    def numpy(self, *args, **kwargs):  # (torch refuses any subclass here, before an op could dispatch)
        owner = self._owner()
        if owner is None:
            raise RuntimeError("zero_ext: this gradient belonged to a ZeroAdamW that no longer exists")
        raise owner.refused("numpy()", self)

    def __repr__(self) -> str:
        owner = self._owner()
        name = owner.names[self._gidx] if owner is not None else "?"
        return f"GradPlaceholder(sharded mean gradient of {name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _plain_params():
    """Stage 3's parameters read and set ``.grad`` without their ``__torch_function__`` check (metadata only
    here): 8.1 -> 0.9 us a parameter for installing and dropping the placeholders (100 parameters, this CPU)."""
    return torch._C.DisableTorchFunctionSubclass()


def _autograd_accumulates(args, kwargs) -> bool:
    """``grad += new`` from autograd's AccumulateGrad: inside a backward pass, a plain tensor of the gradient's
    shape and dtype (a user's in-place add outside backward raises like any other use)."""
    ph, new = args[0], args[1]
    return (
        isinstance(ph, GradPlaceholder)
        and type(new) is torch.Tensor
        and new.shape == ph.shape
        and new.dtype == ph.dtype
        and len(args) == 2
        and kwargs.get("alpha", 1) == 1
        and torch._C._current_graph_task_id() != -1
    )


class GradPlaceholders:
    """The placeholders of one optimizer's parameters, their norms and the scaling recorded on them."""

    def __init__(self, state: ShardedState, grad_sync, stage):
        self.state, self.grad_sync = state, weakref.proxy(grad_sync)  # (its owner: no cycle)
        self.stage = stage  # (engine.stages: whether .grad is the full gradient, kept across step())
        self.names = state.names
        self.members = list(state.members())  # (group, gidx, param)
        self._ph = {gidx: GradPlaceholder(p, self, gidx) for _, gidx, p in self.members}
        self._fp32_buffer = isinstance(grad_sync.strategy, Fp32GradBuffer)
        # dropped without close(): no parameter keeps a placeholder of an optimizer that is gone (added ones too)
        self._pairs = [(p, self._ph[gidx]) for _, gidx, p in self.members]
        weakref.finalize(self, _drop_all, self._pairs)
        self._restore: dict[int, Optional[torch.Tensor]] = {}  # gidx -> the .grad a placeholder stands in for
        self.installed = False
        # The next gradient hook has something to do first (placeholders installed or scaling recorded): a plain
        # attribute, so that the hook of a backward's first gradient reads it without entering this file. Set by
        # everything that installs or records, cleared only where all of it is gone (on_backward, zero_grad): it may
        # be True with nothing to do (then on_backward is a no-op), never False with something to do.
        self.armed = False
        self._pending: dict[int, list[torch.Tensor]] = {}  # gidx -> coefficients recorded, not applied yet
        self.deferred: Optional[torch.Tensor] = None  # one coefficient for every parameter, for the next step()
        # stage 1: a coefficient the step applied in its kernel that the gradients (kept until zero_grad) still owe
        self._owed: Optional[torch.Tensor] = None
        self._norms: Optional[tuple[int, torch.Tensor]] = None  # (gradient epoch, every parameter's norm)
        # a reduced gradient was dropped on this rank since the last step or zero_grad(): the step checks that every
        # rank dropped (zeroing its own pieces of the shards), or none did
        self.dropped = False

    def extend(self, added) -> None:
        """Flat groups ``added`` (``add_param_group``): placeholders for their parameters from the next synchronised
        backward on (they have no reduced gradient yet). Scaling recorded so far is applied first to the gradients it
        was recorded on (a clipping owed by all of them must not reach the new ones); installed placeholders stay."""
        if self._pending or self.deferred is not None or self._owed is not None:
            self._materialise()
        new = [(group, gidx, p) for group in added for gidx, p in zip(group.param_indices, group.params)]
        self.members += new
        for _, gidx, p in new:
            self._ph[gidx] = GradPlaceholder(p, self, gidx)
            self._pairs.append((p, self._ph[gidx]))
        self._norms = None

    # ---------------------------------------------------------------- life
    def install(self) -> None:
        """End of a synchronised backward: every trainable parameter's ``.grad`` becomes its placeholder (a
        ``.grad`` some other code wrote at stages 2 and 3 is left for ``step()`` to refuse)."""
        full = self.stage.keeps_full_grads  # .grad is this rank's view of the flat grad buffer, not someone else's
        with _plain_params():
            for _, gidx, p in self.members:
                grad = p.grad
                if isinstance(grad, GradPlaceholder):
                    continue
                if grad is not None and not full:
                    continue
                self._restore[gidx] = grad
                ph = self._ph[gidx]
                ph._added = None
                p.grad = ph
        self.installed = self.armed = True

    def drop(self) -> None:
        """Every ``.grad`` that is still a placeholder becomes what it stood for again (None; stage 1: its view of
        the flat grad buffer, or None), or the gradient autograd added to it. A placeholder already gone (the user's
        ``model.zero_grad()`` or ``p.grad = None`` between backward and step, or before the next backward) dropped
        its gradient, as torch drops a ``.grad`` set to None: see :meth:`_forget`."""
        if not self.installed:
            return
        gone = []
        with _plain_params():
            for _, gidx, p in self.members:
                ph = self._ph[gidx]
                grad = p.grad
                if grad is ph:
                    p.grad = ph._added if ph._added is not None else self._restore.get(gidx)
                elif gidx in self._restore and (ph._added is None or grad is not ph._added):
                    gone.append(gidx)  # (not the sum autograd made out of place, under create_graph=True)
                ph._added = None
        self._restore.clear()
        self.installed = False
        if gone:
            self._forget(gone)

    def _forget(self, gone: list[int]) -> None:
        """The gradients of ``gone`` were dropped by the user: their pieces of the grad shard (and stage 1's fp32
        buffer slots) are zeroed before anything reads or adds to them (:meth:`settle` or :meth:`on_backward`
        materialises), and they no longer count as having a gradient, so ``step()`` leaves them alone as torch
        leaves a parameter whose ``.grad`` is None. At stages 2 and 3 the shard is the only copy of the gradient:
        without this the step applied it anyway. (A ``.grad`` the user put in its place instead is refused at
        ``step()`` at stages 2 and 3; before the next backward it is that backward's starting value, as in torch.)"""
        self.dropped = self.armed = True
        for gidx in gone:
            self._pending[gidx] = [_ZERO]
        self.grad_sync.forget(gone)
        self._norms = None

    def on_backward(self) -> None:
        """A gradient arrived: the gradients change from here, so the placeholders go and recorded scaling is
        applied first (the new gradients add to the clipped ones, as with torch)."""
        self.drop()
        if self._pending or self.deferred is not None or self._owed is not None:
            self._materialise()
        self.armed = False

    def settle(self, defer: bool) -> Optional[torch.Tensor]:
        """Before ``step()`` (``defer``) or the engine's own norm: the placeholders go; returns the coefficient the
        step's kernel should apply to every gradient, or None (any other scaling is applied to the shards now)."""
        self.drop()
        if self._owed is not None:  # (a second step without backward or zero_grad)
            self._materialise()
        elif self._pending and defer and self._uniform():
            coef = _product(self._pending[self.members[0][1]], self.state.update_device)
            self.deferred = coef if self.deferred is None else self.deferred * coef
            self.armed = True
            self._pending.clear()
        elif self._pending or (self.deferred is not None and not defer):
            self._materialise()
        return self.deferred

    def after_step(self) -> None:
        """``step()`` applied the deferred coefficient in its kernel. Stage 1 keeps its gradients until
        ``zero_grad()`` (as torch does), and they still owe it: the placeholders go back on, so that a backward
        without ``zero_grad()`` first applies it (in :meth:`_accumulate` or :meth:`on_backward`) and then adds.
        With the fp32 grad buffer they always go back on, so that ``model.zero_grad()`` drops what it holds."""
        if self.stage.keeps_full_grads and (self.deferred is not None or self._fp32_buffer):
            # (the fp32 buffer's .grad is None whatever it holds: without placeholders model.zero_grad() could not
            # reach it, and the gradients would accumulate across steps)
            self._owed = self.deferred
            self.install()
        self.deferred = None
        self.dropped = False

    def zero_grad(self) -> None:
        self.drop()
        self.dropped = False  # (every gradient goes now, on every rank that calls it)
        self._pending.clear()
        self.deferred = self._owed = None
        self.armed = False

    def _uniform(self) -> bool:
        first = self._pending.get(self.members[0][1])
        if first is None or len(self._pending) != len(self.members) or any(c is _ZERO for c in first):
            return False  # (a zeroed gradient is zeroed where it is: 0 * inf would be nan in the kernel)
        return all(len(c) == len(first) and all(a is b for a, b in zip(c, first)) for c in self._pending.values())

    def _materialise(self) -> None:
        """Apply every recorded coefficient where the gradients are: this rank's pieces of the grad shard and, at
        stage 1, the parameter's slot of the flat grad buffer."""
        self.grad_sync.finish_grad_sync()
        dev = self.state.update_device
        pending = {g: _product(c, dev) for g, c in self._pending.items()}
        zeroed = {g for g, c in self._pending.items() if any(x is _ZERO for x in c)}  # zero_(), as torch: inf * 0
        for every in (self.deferred, self._owed):  # coefficients of every gradient
            if every is not None:
                pending = {g: pending.get(g, 1.0) * every for _, g, _ in self.members}
        self._pending.clear()
        self.deferred = self._owed = None
        with torch.no_grad():
            for group in self.state.groups:
                shard = group.state.grad
                for piece in group.owned_pieces():
                    gidx = group.param_indices[piece.index]
                    coef = pending.get(gidx)
                    if gidx in zeroed:
                        shard[piece.shard_offset : piece.shard_offset + piece.numel].zero_()
                    elif coef is not None:
                        shard[piece.shard_offset : piece.shard_offset + piece.numel].mul_(coef)
                if group.grad_buffer is not None:
                    for slot, p in zip(group.layout.slots, group.params):
                        if not self._slot_holds_grad(group.param_indices[slot.index], p):
                            continue  # .grad None: the slot is stale, the next gradient overwrites it (_adopt)
                        gidx = group.param_indices[slot.index]
                        coef = pending.get(gidx)
                        if gidx in zeroed:
                            slot.param_range.of(group.grad_buffer).zero_()
                        elif coef is not None:
                            slot.param_range.of(group.grad_buffer).mul_(coef.to(group.grad_buffer.device))
        self.grad_sync.strategy.rescaled()
        self.grad_sync.epoch += 1

    def _slot_holds_grad(self, gidx: int, p: torch.Tensor) -> bool:
        """Stage 1: whether the parameter's slot of the flat buffer holds a gradient still to be used (so that,
        after ``model.zero_grad()``, a scaling owed to the buffer costs no pass over it)."""
        if self._fp32_buffer:  # the fp32 buffer accumulates whatever .grad is (always None there)
            return True
        grad = p.grad
        return self._restore.get(gidx) is not None if isinstance(grad, GradPlaceholder) else grad is not None

    # ---------------------------------------------------------------- the ops
    def dispatch(self, func, args, kwargs):
        if func in _NORMS:
            return self._norm_op(func, args, kwargs)
        if func in _SCALES:
            return self._scale_op(func, args, kwargs)
        if func in (aten.add_.Tensor, aten.add.Tensor) and _autograd_accumulates(args, kwargs):
            return self._accumulate(args[0], args[1], out_of_place=func is aten.add.Tensor)
        if func is aten.zero_.default:
            self._zero(args[0]._gidx)
            return args[0]
        raise self.refused(func, next(t for t in _flat(args) if isinstance(t, GradPlaceholder)))

    def refused(self, what, ph: GradPlaceholder) -> RuntimeError:
        if torch._C._current_graph_task_id() != -1:  # written inside backward, after the engine's reduction
            why = (
                " Inside backward, something else writes .grad: a model wrapped in DistributedDataParallel (do not "
                "wrap it: ZeroAdamW reduces gradients itself) or another gradient reducer."
            )
        elif what is aten._to_copy.default:
            why = " (Moving or casting the model after the optimizer was built is refused anyway: build it after.)"
        else:
            why = ""
        return RuntimeError(
            f"{self.state.optimizer_name}: `{what}` on the gradient of parameter {self.names[ph._gidx]!r}: at stage "
            f"{self.state.stage} the mean gradients are sharded over the ranks, and `.grad` after backward is a "
            "placeholder that supports only what torch.nn.utils.clip_grad_norm_ does with it (its 2-norm, an "
            "in-place multiply, zero_()). Clip with opt.clip_grad_norm_(max_norm) or torch.nn.utils.clip_grad_norm_; "
            "read or change a gradient in a hook before it is reduced (param.register_hook), or read the grad shard "
            f"through opt.sharded_state.{why}"
        )

    def _norm_op(self, func, args, kwargs):
        if func is aten.linalg_vector_norm.default:
            x, ord_ = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
            extra = args[2:] or any(kwargs.get(k) not in (None, False) for k in ("dim", "keepdim", "dtype"))
            self._check_norm(x, ord_, extra)
            return self._norm_of(x)
        tensors, ord_ = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
        out = []
        for t in tensors:
            if isinstance(t, GradPlaceholder):
                self._check_norm(t, ord_, kwargs.get("dtype") is not None)
                out.append(self._norm_of(t))
            else:
                out.append(torch.linalg.vector_norm(t, ord_))
        return out

    def _check_norm(self, ph, ord_, extra) -> None:
        if float(ord_) != 2.0 or extra:
            raise RuntimeError(
                f"{self.state.optimizer_name}: the gradient of {self.names[ph._gidx]!r} is sharded over the ranks; of its "
                f"norms only the 2-norm of the whole tensor is available (asked: ord={ord_!r}"
                f"{', with dim/keepdim/dtype' if extra else ''}). Use norm_type=2.0, or opt.clip_grad_norm_(max_norm)"
            )

    def _norm_of(self, ph: GradPlaceholder) -> torch.Tensor:
        # fp32 whatever the gradient's dtype: the engine's mean gradient is fp32 (DDP's would be in the param dtype)
        return self.norms()[ph._gidx].to(device=ph.device)

    def norms(self) -> torch.Tensor:
        """Every trainable parameter's mean-gradient 2-norm (fp32, by global index); collective the first time
        after the gradients changed."""
        if self._pending or self.deferred is not None or self._owed is not None:
            self._materialise()  # a norm after a scaling sees the scaled gradients
        epoch = self.grad_sync.epoch
        if self._norms is not None and self._norms[0] == epoch:
            return self._norms[1]
        self.grad_sync.finish_grad_sync()
        dev = self.state.update_device
        count = 1 + max((gidx for _, gidx, _ in self.members), default=-1)
        sumsq = torch.zeros(count, dtype=torch.float32, device=dev)
        for group in self.state.groups:
            pieces = group.owned_pieces()
            if not pieces:
                continue
            shard = group.state.grad
            views = [shard[p.shard_offset : p.shard_offset + p.numel] for p in pieces]
            index = torch.tensor([group.param_indices[p.index] for p in pieces], device=dev)
            sumsq.index_add_(0, index, torch.stack(torch._foreach_norm(views)).square())
        self.state.comm.reduce_step_stats(torch.zeros(1), sumsq)  # summed over ranks, in place
        norms = sumsq.sqrt_()
        self._norms = (epoch, norms)
        return norms

    def _scale_op(self, func, args, kwargs):
        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        factors = args[1] if isinstance(args[1], (list, tuple)) else [args[1]] * len(tensors)
        plain = [(t, f) for t, f in zip(tensors, factors) if not isinstance(t, GradPlaceholder)]
        for t, f in plain:
            t.mul_(f)
        for t, f in zip(tensors, factors):
            if isinstance(t, GradPlaceholder):
                if not isinstance(f, torch.Tensor):
                    f = torch.tensor(float(f), dtype=torch.float32)
                elif f.numel() != 1:
                    raise RuntimeError(
                        f"{self.state.optimizer_name}: the gradient of {self.names[t._gidx]!r} is sharded over the ranks; it "
                        "can be multiplied in place by a scalar only (as clipping does), use opt.clip_grad_norm_"
                    )
                self._pending.setdefault(t._gidx, []).append(f)
                self.armed = True
        self._norms = None
        return args[0] if func in (aten.mul_.Tensor, aten.mul_.Scalar) else None

    def _zero(self, gidx: int) -> None:
        self._pending[gidx] = [_ZERO]
        self.armed = True
        self._norms = None

    def _accumulate(self, ph: GradPlaceholder, new: torch.Tensor, out_of_place: bool = False):
        """autograd adds a new gradient to ``.grad`` (still this placeholder, before the engine's hook saw it):
        what the placeholder stands for is already in the shard (stage 1: in the flat buffer), so the new
        gradient alone goes to the reducer."""
        added = new.clone()  # (autograd may still hold ``new`` elsewhere: it steals a gradient only when it can tell)
        restore = self._restore.get(ph._gidx)
        if restore is not None:  # stage 1: .grad was a view of the flat buffer, which accumulates in place
            if self._pending or self.deferred is not None or self._owed is not None:
                self._materialise()  # the scaling reaches the buffer before the new gradient adds
            restore.add_(added)
            added = restore
        ph._added = added  # .grad is swapped for it at the engine's hook (not here, inside autograd's accumulation)
        return added if out_of_place else ph


_ZERO = torch.zeros(())


def _drop_all(pairs) -> None:
    for p, ph in pairs:
        if p.grad is ph:
            p.grad = None


def _product(coefs: list, device) -> torch.Tensor:
    out = torch.ones((), dtype=torch.float32, device=device)
    for c in coefs:
        out = out * c.to(device=device, dtype=torch.float32)
    return out
