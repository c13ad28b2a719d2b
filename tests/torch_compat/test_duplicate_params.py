"""A parameter listed twice in one param group: torch warns (UserWarning, its words) and builds the optimizer; so
does ZeroAdamW, at the constructor and at add_param_group, on every rank, and trains each parameter once (torch would
update a listed-twice parameter once per entry: see zero_ext/torch_compat/duplicates.py). The same parameter in two
groups raises, as in torch."""

import re
import warnings

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, set_mean_grads

from zero_ext import ZeroAdamW

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TORCH_REGEX = ".*a parameter group with duplicate parameters.*"  # common_optimizers.py's error input


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))


def _warned(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(TORCH_REGEX, m) for m in messages), messages
    return out


def _duplicates(rank, world, stage):
    model = _model()
    first, second = model[0], model[1]
    # torch: warns and builds
    _warned(lambda: torch.optim.AdamW([first.weight, first.weight], **HYPER))
    module = model if stage == 3 else None
    opt = _warned(lambda: ZeroAdamW([first.weight, first.bias, first.weight], **HYPER, stage=stage, module=module))
    _warned(lambda: opt.add_param_group({"params": [second.weight, second.bias, second.weight]}))
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    ref_model = _model()  # the reference's gradients are its own (a stage-3 model has none outside backward)
    ref_params = list(ref_model.parameters())
    ref = torch.optim.AdamW(ref_params, **HYPER)
    for step in range(2):
        per_rank = []
        for r in range(world):
            torch.manual_seed(100 * step + r)
            x = torch.randn(3, 5)
            per_rank.append(list(torch.autograd.grad(ref_model(x).square().sum(), ref_params)))
        set_mean_grads(ref_params, per_rank)
        ref.step()
        torch.manual_seed(100 * step + rank)
        model(torch.randn(3, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    if stage == 3:
        with opt.gathered_params():
            check_against_reference(opt, model, ref_params, rank)
    else:
        check_against_reference(opt, model, ref_params, rank)
    opt.load_state_dict(opt.state_dict())
    opt.close()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_listed_twice_warns_as_torch_and_trains_once(world, stage):
    assert run_on_ranks(world, _duplicates, stage) == [True] * world


def test_a_parameter_in_two_groups_raises_as_torch():
    p = torch.nn.Parameter(torch.randn(2, 2))
    for cls in (torch.optim.AdamW, ZeroAdamW):
        with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
            cls([{"params": p}, {"params": p}])
