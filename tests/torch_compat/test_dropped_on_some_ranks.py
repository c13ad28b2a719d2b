"""A reduced gradient dropped (``model.zero_grad()``, ``p.grad = None``) or replaced by a hand-assigned tensor between
backward and step on some ranks only: the mean gradient is sharded, so each such rank could drop only its own pieces
and the ranks would update differently. ``step()`` refuses on every rank, nothing updated; ``opt.zero_grad()`` on
every rank starts clean. On every rank at once it is torch's meaning (tests/torch_compat/test_hand_assigned_grads.py,
tests/trainer/test_zero_grad_between_backward_and_step.py)."""

import pytest
import torch
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

SOME_RANKS = r"gradients of the last backward were dropped on 1 of 2 ranks only"


def _habit(model, how):
    if how == "model.zero_grad":
        model.zero_grad()
    elif how == "grad = None":
        model.head.weight.grad = None
    else:  # replaced by a tensor of the user's
        model.head.weight.grad = torch.ones(model.head.weight.shape)


def _some_ranks(rank, world, stage, how, where):
    model = build(torch.float32)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, module=model, bucket_size=1024)
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, batch(0, rank)).backward()
    if rank == 0:
        _habit(model, how)
    if where == "before the next backward":
        loss_fn(model, batch(1, rank)).backward()
    with pytest.raises(ValueError, match=SOME_RANKS):
        opt.step()
    with opt.gathered_params():
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing updated
    opt.zero_grad()
    loss_fn(model, batch(2, rank)).backward()
    opt.step()  # clean again
    opt.close()
    return True


CASES = [
    (how, where)
    for how in ("model.zero_grad", "grad = None", "replaced")
    for where in ("before step", "before the next backward")
    if (how, where) != ("replaced", "before the next backward")
]  # (that is the next backward's start, as in torch)


@pytest.mark.parametrize("how, where", CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dropping_a_reduced_gradient_on_one_rank_is_refused_on_every_rank(stage, how, where):
    assert all(run_on_ranks(2, _some_ranks, stage, how, where))
