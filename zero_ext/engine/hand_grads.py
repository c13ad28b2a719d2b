"""Gradients assigned by hand (``p.grad = tensor``, no backward), which torch's AdamW applies as it finds them.

The engine's own gradients reach it through autograd's hooks; a ``.grad`` the user assigned never passes one. At
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

import torch

from ..state.sharded_state import ShardedState

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
    """This rank's hand-assigned gradients."""
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
