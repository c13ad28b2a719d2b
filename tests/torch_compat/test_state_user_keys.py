"""``opt.state`` takes what torch.optim's takes from users: keys that are not parameters (torch's own optimizer tests
write ``opt.state["test"] = 1`` in a state-dict pre hook and pop it in the post hook; a load post hook writes
``opt.state["ran_load_state_dict_post_hook"] = True``). Each hook sequence runs on ZeroAdamW and on
torch.optim.AdamW, and what each keeps is compared: the user's keys in ``opt.state`` and in ``state_dict()["state"]``,
per rank, through a round trip. Parameter entries stay read-only. Stages 1-3 in one launch of 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from compat_training import HYPER, build, make, train
from distributed import run_on_ranks


def _user_keys(mapping) -> dict:
    return {k: v for k, v in mapping.items() if not isinstance(k, (torch.Tensor, int))}


def _hooks(opt) -> None:
    """torch's test_optim.py hooks, as it registers them."""

    def pre(o):
        o.state["test"] = 1

    def post(o, sd):
        sd["ran_state_dict_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd

    def load_post(o):
        o.state["ran_load_state_dict_post_hook"] = True

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_post_hook(load_post)


def _script(opt, rank) -> list:
    """The hook sequence and a round trip of a per-rank key; what the optimizer kept at each point."""
    seen = []
    _hooks(opt)
    sd = opt.state_dict()
    seen.append(("saved", sd["ran_state_dict_pre_hook"], _user_keys(sd["state"]), _user_keys(opt.state)))
    opt.state["rank"] = rank
    opt.state.setdefault(("a", "tuple"), [rank])
    sd = opt.state_dict()
    seen.append(("saved again", _user_keys(sd["state"])))
    del opt.state["rank"]
    opt.state["dropped by the load"] = 0
    opt.load_state_dict(copy.deepcopy(sd))
    seen.append(("loaded", _user_keys(opt.state)))
    seen.append(("pop", opt.state.pop("rank"), "rank" in opt.state, opt.state.get("rank", "gone")))
    return seen


def _run(rank, world):
    torch_model = build()
    reference = torch.optim.AdamW(torch_model.parameters(), **HYPER)
    train(torch_model, reference, rank, 1)
    expected = _script(reference, rank)
    for stage in (1, 2, 3):
        model = build()
        opt = make(model, stage)
        train(model, opt, rank, 1)
        assert _script(opt, rank) == expected, stage
        # parameter entries stay read-only views, with the message saying what to do; nothing changed
        p = next(p for p in model.parameters() if p in opt.state)
        before = opt.state[p]["exp_avg"].clone()
        for attempt in (lambda: opt.state.__setitem__(p, {}), lambda: opt.state.update({p: {}}),
                        lambda: opt.state.pop(p), lambda: opt.state.setdefault(p, {})):  # fmt: skip
            with pytest.raises(TypeError, match="tensor key is a parameter's entry.*load_state_dict"):
                attempt()
        assert torch.equal(opt.state[p]["exp_avg"], before)
        # a load that fails changes no key of the user's
        opt.state["kept"] = 1
        bad = opt.state_dict()
        bad["zero"]["world_size"] = 99
        bad["state"]["would be loaded"] = 2
        with pytest.raises(ValueError, match="world_size"):
            opt.load_state_dict(bad)
        assert opt.state["kept"] == 1 and "would be loaded" not in opt.state
        opt.close()
    return True


def test_user_keys_in_state_round_trip_as_torch_keeps_them():
    assert all(run_on_ranks(2, _run))
