"""Stage 3's two signals from autograd about one module call: its backward is about to run (a hook on the
gradient of its outputs), and its backward is done (an identity autograd function on its inputs, whose backward
runs once the module's backward has produced their gradients), held by one :class:`BackwardSignals` per scheduler.
param_gather.py decides what they do."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class Call:
    """One call of a module: its backward pre-hook must run once, however many outputs carry a gradient.
    ``after``: whether its inputs were wrapped, so that a post-backward signal will come."""

    __slots__ = ("module", "started", "after")

    def __init__(self, module, after: bool = False):
        self.module, self.started, self.after = module, False, after


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward has produced their gradients."""

    @staticmethod
    def forward(ctx, done, call, *inputs):
        ctx.done, ctx.call = done, call
        ctx.set_materialize_grads(False)
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(ctx.call)
        return (None, None, *grads)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BackwardSignals:
    """The two signals of module calls, for one scheduler: the call whose inputs a module's pre-hook wrapped waits
    here (a weak key: nothing is stamped on the user's module, and a module dropped takes its entry with it) until
    the module's post-hook hooks its outputs."""

    __slots__ = ("_calls",)

    def __init__(self):
        self._calls: "weakref.WeakKeyDictionary[torch.nn.Module, Call]" = weakref.WeakKeyDictionary()

    def wrap_inputs(self, module: torch.nn.Module, args, done: Callable[[Call], None]):
        """``args`` with every tensor that needs a gradient passed through :class:`_AfterBackward` (``done(call)``
        when the module's backward is done), or None when none needs one. The call waits here for
        :meth:`hook_outputs`."""
        flat, spec = tree_flatten(args)
        # One wrapped tensor per distinct input, so that an input passed several times stays one tensor: modules test
        # identity (nn.MultiheadAttention's ``query is key is value`` picks its packed in-projection, one matmul
        # whose input gradient is rounded to bf16 once; three distinct tensors take three projections and autograd
        # sums their bf16 input gradients: stage 3 then differed from stages 1/2 in the last bit,
        # test_stage3_input_identity.py).
        distinct = {id(t): t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad}
        if not distinct:
            return None
        call = Call(module, after=True)
        self._calls[module] = call  # the post-hook's outputs belong to this call
        wrapped = _AfterBackward.apply(done, call, *distinct.values())
        to = dict(zip(distinct, wrapped if len(distinct) > 1 else (wrapped,)))
        return tree_unflatten([to.get(id(t), t) for t in flat], spec)

    def hook_outputs(self, module: torch.nn.Module, output, starts: Callable[[Call], None]) -> bool:
        """Call ``starts(call)`` when a gradient of ``output`` arrives (before the module's backward runs); False
        when no output needs a gradient (then nothing will signal the module's backward)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        call = self._calls.pop(module, None) or Call(module)
        for t in tensors:
            t.register_hook(lambda grad, c=call: starts(c) or grad)
        return bool(tensors)


def refuse_backward(output, message: str) -> None:
    """Make a backward into ``output`` raise ``RuntimeError(message)`` when its gradient arrives (before the
    backward of what produced it runs). Leaves are skipped: a hook on a parameter would outlive this call."""
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            t.register_hook(lambda grad: _raise(message))


def _raise(message: str):
    raise RuntimeError(message)
