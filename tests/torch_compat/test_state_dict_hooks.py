"""torch.optim's state-dict hooks run around ZeroAdamW.state_dict() / load_state_dict() as torch runs them: the
pre hook gets the optimizer, the post hook may return a replacement dict, the load pre hook gets a shallow copy and
may return a replacement, the load post hook runs after loading, ``prepend=True`` runs a hook first, a removed
handle stops its hook. Stages 1-3 on 2 gloo ranks; a load pre hook failing on one rank fails the load on both."""

import pytest
import torch
from compat_training import build, make, train
from distributed import run_on_ranks

STAGES = [1, 2, 3]


def _state_dict_hooks(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre-first", o is opt)), prepend=True)

    def tag(o, sd):
        calls.append(("post", o is opt, isinstance(sd, dict) and "state" in sd))
        sd["tagged"] = True  # changed in place, returned None: the same dict goes on

    def replace(o, sd):
        calls.append(("replace", sd.get("tagged")))
        return {**sd, "replaced": True}

    opt.register_state_dict_post_hook(replace)
    opt.register_state_dict_post_hook(tag, prepend=True)
    sd = opt.state_dict()
    assert calls == [("pre-first", True), ("pre", True), ("post", True, True), ("replace", True)], calls
    assert sd["tagged"] and sd["replaced"], sorted(sd)
    handle = opt.register_state_dict_pre_hook(lambda o: calls.append("removed"))
    handle.remove()
    calls.clear()
    opt.state_dict()
    assert "removed" not in calls


def _load_state_dict_hooks(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    after_one = opt.state_dict()
    train(model, opt, rank, 1, start=1)
    after_two = opt.state_dict()
    with opt.gathered_params():
        weights = [p.detach().clone() for p in model.parameters()]
    calls = []

    def pre(o, sd):
        calls.append(("pre", o is opt, sd is not after_one, sd == after_one))
        return after_two  # the dict the optimizer loads instead

    def pre_first(o, sd):
        calls.append(("pre-first", sd is not after_one))
        sd["seen"] = True  # the shallow copy: the caller's dict is untouched

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_pre_hook(pre_first, prepend=True)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o is opt)))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post-first", o is opt)), prepend=True)
    opt.load_state_dict(after_one)
    assert calls == [("pre-first", True), ("pre", True, True, False), ("post-first", True), ("post", True)], calls
    assert "seen" not in after_one
    # the replacement was loaded: the state after two steps, and the parameters follow its master
    loaded = opt.state_dict()
    for index, entry in after_two["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded["state"][index][key], value), (index, key)
    with opt.gathered_params():
        for p, w in zip(model.parameters(), weights):
            assert torch.equal(p.detach(), w)


def _load_pre_hook_fails_on_one_rank(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    sd = opt.state_dict()
    train(model, opt, rank, 1, start=1)
    before = opt.state_dict()

    def pre(o, state_dict):
        if rank == 1:
            raise RuntimeError("hook failed on rank 1")

    opt.register_load_state_dict_pre_hook(pre)
    with pytest.raises((RuntimeError, ValueError), match="rank 1|rank\\(s\\) \\[1\\]"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for index, entry in before["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][index][key], value), (index, key)
    train(model, opt, rank, 1, start=2)  # both ranks still step together


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_hooks_run_as_torch_runs_them(stage):
    run_on_ranks(2, _state_dict_hooks, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_load_state_dict_hooks_run_as_torch_runs_them(stage):
    run_on_ranks(2, _load_state_dict_hooks, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_load_pre_hook_failing_on_one_rank_fails_every_rank(stage):
    run_on_ranks(2, _load_pre_hook_fails_on_one_rank, stage)
