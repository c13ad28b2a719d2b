"""ZeroAdamW's param groups have torch.optim.AdamW's keys with AdamW's values and defaults, ``decoupled_weight_decay``
(True) included; a group asking for Adam's coupled (L2) decay, ``decoupled_weight_decay=False``, is refused on every
rank, at construction, in add_param_group, in a loaded state dict and in step(). Stages 1-3 on 2 gloo ranks."""

import pytest
import torch
from compat_training import HYPER, build, make, train
from distributed import run_on_ranks

from zero_ext import ZeroAdamW

STAGES = [1, 2, 3]


def _same_keys(rank, world, stage):
    model = build()
    opt = make(model, stage)
    ref = torch.optim.AdamW(build().named_parameters(), **HYPER)
    ours, theirs = opt.param_groups[0], ref.param_groups[0]
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for key in theirs:
        if key != "params":
            assert ours[key] == theirs[key], key
    assert opt.defaults == ref.defaults
    assert ours["decoupled_weight_decay"] is True


def _coupled_decay_refused(rank, world, stage):
    model = build()
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        _build_coupled(stage)
    opt = make(model, stage)
    train(model, opt, rank, 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    partial = build()
    partial[2].requires_grad_(False)
    grown = ZeroAdamW(partial[0].parameters(), stage=stage, module=partial)
    partial[2].requires_grad_(True)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        grown.add_param_group({"params": partial[2].parameters(), "decoupled_weight_decay": False})
    assert len(grown.param_groups) == 1
    opt.param_groups[0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        train(model, opt, rank, 1, start=1)


def _build_coupled(stage):
    model = build()
    return ZeroAdamW([{"params": model.parameters(), "decoupled_weight_decay": False}], stage=stage, module=model)


@pytest.mark.parametrize("stage", STAGES)
def test_param_group_keys_are_adamws(stage):
    run_on_ranks(2, _same_keys, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_coupled_weight_decay_is_refused(stage):
    run_on_ranks(2, _coupled_decay_refused, stage)
