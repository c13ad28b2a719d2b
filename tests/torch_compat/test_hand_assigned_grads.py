"""A ``.grad`` assigned by hand (no backward), which torch's AdamW applies: ZeroAdamW applies the mean over the ranks
(a rank that assigned none counting as zero, as a rank without a backward gradient does), at every stage, alone or
mixed with backward's gradients in the same step, and never replaces or writes into the user's tensor; zero_grad()
then does what torch's does. Against torch.optim.AdamW fed the mean gradients, on 1, 2 and 3 gloo ranks."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import mean_grads
from pairwise import pairwise_params

from zero_ext import ZeroAdamW

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Net(torch.nn.Module):
    """``a`` and ``b`` are used by forward; ``extra`` never is (its gradients come by hand or not at all)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _grads(model):
    with torch._C.DisableTorchFunctionSubclass():  # (stage 3's parameters: read .grad itself, no gather)
        return [p.grad for p in model.parameters()]


def _hand(names, step, rank, which):
    """Rank ``rank``'s hand gradients at ``step`` for the parameters named in ``which`` (others None)."""
    out = []
    for i, (name, shape) in enumerate(names):
        gen = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
        out.append(torch.randn(shape, generator=gen) if name in which else None)
    return out


def _full(model, opt):
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def _scenario(rank, world, stage, scenario):
    model, ref_model = Net(), Net()
    names = [(n, p.shape) for n, p in model.named_parameters()]
    ref_params = list(ref_model.parameters())
    ref = torch.optim.AdamW(ref_params, **HYPER)
    opt = ZeroAdamW(model.parameters(), **HYPER, stage=stage, bucket_size=64, module=model if stage == 3 else None)
    hand_names = {"extra.weight", "extra.bias"}
    for step in range(3):
        # what every rank does this step: backward on a batch (or not), hand gradients for some parameters
        backward = scenario in ("before_backward", "after_backward", "replace")
        which = set(hand_names)
        if scenario == "replace":
            which = hand_names | {"b.weight"}  # b.weight got one from backward: the hand one replaces it (torch)
        if scenario == "some_ranks":
            which = hand_names if (rank == 0 or step == 1) else set()  # rank 0 only, except at step 1: every rank
        per_rank = []
        for r in range(world):
            hand = _hand(names, step, r, which if scenario != "some_ranks" else
                         (hand_names if (r == 0 or step == 1) else set()))  # fmt: skip
            if backward:
                torch.manual_seed(100 * step + r)
                x = torch.randn(3, 5)
                loss = ref_model(x).square().sum()
                auto = torch.autograd.grad(loss, ref_params, allow_unused=True)
                hand = [h if h is not None else g for h, g in zip(hand, auto)]
            per_rank.append(hand)
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            p.grad = g
        ref.step()

        mine = _hand(names, step, rank, which)
        if scenario == "before_backward":
            for p, g in zip(model.parameters(), mine):
                if g is not None:
                    p.grad = g
        if backward:
            torch.manual_seed(100 * step + rank)
            model(torch.randn(3, 5)).square().sum().backward()
        if scenario != "before_backward":
            for p, g in zip(model.parameters(), mine):
                if g is not None:
                    p.grad = g
        kept = [None if g is None else g.clone() for g in mine]
        opt.step()
        for (name, _), g, k, now in zip(names, mine, kept, _grads(model)):
            if g is not None:  # the user's tensor is still .grad, its values untouched
                assert now is g, f"step {step}: the .grad of {name} was replaced"
                assert torch.equal(g, k), f"step {step}: the hand gradient of {name} was written into"
        for (name, _), p, r in zip(names, _full(model, opt), ref_params):
            torch.testing.assert_close(p, r.detach(), msg=lambda m: f"step {step}, {name}: {m}")
        if step == 1:  # as torch: zeroed in place, still the user's tensor, and applied (as zero) by the next step
            opt.zero_grad(set_to_none=False)
            ref.zero_grad(set_to_none=False)
            if stage > 1:  # (stages 2 and 3: step() consumed backward's gradients, documented; hand ones stay)
                for (name, _), p in zip(names, ref_params):
                    p.grad = p.grad if name in which else None
            for g, now in zip(mine, _grads(model)):
                if g is not None:
                    assert now is g and not g.any()
            opt.step()
            ref.step()
            for (name, _), p, r in zip(names, _full(model, opt), ref_params):
                torch.testing.assert_close(p, r.detach(), msg=lambda m: f"zeroed step, {name}: {m}")
        opt.zero_grad()
        ref.zero_grad()
        assert all(g is None for g in _grads(model))
    opt.close()
    return True


# World size, stage and scenario act independently: every pair of their values (15 runs of the 45 combinations,
# tests/helpers/pairwise.py).
AXES = {"world": [1, 2, 3], "stage": [1, 2, 3],
        "scenario": ["alone", "before_backward", "after_backward", "replace", "some_ranks"]}  # fmt: skip


@pytest.mark.parametrize("world,stage,scenario", pairwise_params(AXES))
def test_hand_assigned_gradients_are_applied_as_their_mean(world, stage, scenario):
    assert run_on_ranks(world, _scenario, stage, scenario) == [True] * world


def _again(rank, world, stage):
    """Without zero_grad(), torch applies the same hand gradient again at the next step: so does ZeroAdamW."""
    model, ref_model = Net(), Net()
    ref = torch.optim.AdamW(ref_model.parameters(), **HYPER)
    opt = ZeroAdamW(model.parameters(), **HYPER, stage=stage, module=model if stage == 3 else None)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    per_rank = [[torch.randn(p.shape, generator=gens[r]) for p in ref_model.parameters()] for r in range(world)]
    for p, g in zip(model.parameters(), per_rank[rank]):
        p.grad = g
    for p, g in zip(ref_model.parameters(), mean_grads(per_rank, list(ref_model.parameters()))):
        p.grad = g
    for _ in range(2):
        opt.step()
        ref.step()
    for p, r in zip(_full(model, opt), ref_model.parameters()):
        torch.testing.assert_close(p, r.detach())
    opt.close()
    return True


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_hand_gradient_left_in_place_is_applied_again_as_torch_does(world, stage):
    assert run_on_ranks(world, _again, stage) == [True] * world
