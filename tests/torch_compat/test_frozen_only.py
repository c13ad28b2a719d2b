"""An optimizer over parameters none of which requires grad: torch builds it and its ``step()`` is a no-op; so does
ZeroAdamW at every stage and offload, with every call of its API working and changing nothing. An empty parameter
list raises torch's error. On 1, 2 and 3 gloo ranks (every call on every rank: the collective ones must not hang)."""

import os

import pytest
import torch
from distributed import run_on_ranks

from zero_ext import ZeroAdamW, checkpoint

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _frozen_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    model.requires_grad_(False)
    return model


def _frozen_only(rank, world, stage, offload, root):
    model = _frozen_model()
    ref_model = _frozen_model()
    ref = torch.optim.AdamW(ref_model.parameters(), **HYPER)
    opt = ZeroAdamW(model.parameters(), **HYPER, stage=stage, offload=offload, module=model if stage == 3 else None)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(2, 5)
    for _ in range(2):
        model(x).sum()  # no graph: nothing requires grad
        assert opt.step() is None and ref.step() is None
        opt.zero_grad()
        opt.zero_grad(set_to_none=False)
        ref.zero_grad()
    assert opt.step(lambda: 3.0) == 3.0  # a closure is still called, as torch calls it
    for p, b, r in zip(model.parameters(), before, ref_model.parameters()):
        assert torch.equal(p, b) and torch.equal(p, r) and p.grad is None
    sd = opt.state_dict()
    assert sd["state"] == {} and len(sd["param_groups"]) == 1
    assert sd["param_groups"][0]["lr"] == ref.state_dict()["param_groups"][0]["lr"]
    opt.load_state_dict(sd)
    opt.memory_report()
    path = os.path.join(root, "ckpt")
    checkpoint.save(path, opt)
    checkpoint.load(path, opt)
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.close()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_without_trainable_parameters_is_a_no_op(world, stage, tmp_path):
    for offload in (None, "cpu"):
        root = str(tmp_path / str(offload))
        assert run_on_ranks(world, _frozen_only, stage, offload, root) == [True] * world


def test_an_empty_parameter_list_raises_torchs_error():
    for cls in (torch.optim.AdamW, ZeroAdamW):
        with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
            cls([])
