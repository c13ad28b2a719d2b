"""State-dict parameter ids and names as torch.optim.Optimizer makes them: ids follow the parameters' identity (a
param group listed twice gives its parameters the same ids twice), a state dict with ``param_names`` loaded into an
optimizer built without names gives it those names, and one without names leaves the optimizer's own. Stages 1-3 on
2 gloo ranks, each against torch.optim.AdamW doing the same."""

import pytest
import torch
from compat_training import HYPER, build, make, train
from distributed import run_on_ranks

STAGES = [1, 2, 3]


def _ids_follow_identity(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    ref = torch.optim.AdamW(build().named_parameters(), **HYPER)
    for o in (opt, ref):
        o.param_groups.append(o.param_groups[0])  # the same group object twice, as torch's state_dict allows
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert set(ours["state"]) <= set(range(len(list(model.parameters()))))


def _names_carry_over(rank, world, stage):
    named_model, plain_model = build(), build()
    named = make(named_model, stage, named=True)
    plain = make(plain_model, stage, named=False)
    train(named_model, named, rank, 1)
    train(plain_model, plain, rank, 1)
    names = [n for n, _ in named_model.named_parameters()]
    ref_named = torch.optim.AdamW(build().named_parameters(), **HYPER)
    ref_plain = torch.optim.AdamW(build().parameters(), **HYPER)
    ref_plain.load_state_dict(ref_named.state_dict())
    plain.load_state_dict(named.state_dict())
    assert ref_plain.param_groups[0]["param_names"] == names  # torch: the saved names are kept
    assert plain.param_groups[0]["param_names"] == names
    assert plain.state_dict()["param_groups"][0]["param_names"] == names
    # a dict without names leaves the optimizer's names alone (torch's update_group)
    other = make(build(), stage, named=False)
    named.load_state_dict(other.state_dict())
    assert named.param_groups[0]["param_names"] == names


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_ids_follow_parameter_identity(stage):
    run_on_ranks(2, _ids_follow_identity, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_param_names_carry_over_as_in_torch(stage):
    run_on_ranks(2, _names_carry_over, stage)
