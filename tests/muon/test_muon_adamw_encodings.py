"""ZeroMuon with the AdamW groups' encodings: ``param_remainders=True`` (bitwise the fp32 master, so the run is
bitwise the run without it) and ``moment_dtype=torch.int8`` (the AdamW groups exactly as ZeroAdamW with the same
options updates them; the Muon groups keep an fp32 master and momentum), at every stage on 2 gloo ranks, in one
launch; and errors raised through ZeroMuon's calls name ZeroMuon."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from muon_reference import ADAM, MUON, zero_muon_groups
from test_muon_parity import model_for
from tiny_transformer import batch, loss_fn

from zero_ext import ZeroAdamW, ZeroMuon


def _train(model, opt, rank) -> list[torch.Tensor]:
    for step in range(3):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        out = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return out


def _encodings(rank, world):
    for stage in (1, 2, 3):
        runs = {}
        for name, kw in {"plain": {}, "remainders": dict(param_remainders=True)}.items():
            model = model_for(torch.bfloat16)
            opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=stage, module=model, bucket_size=1500, **kw)
            runs[name] = _train(model, opt, rank)
        assert all(torch.equal(a, b) for a, b in zip(runs["plain"], runs["remainders"])), stage
        # int8 moments (and remainders): the Muon groups at lr 0 stay put, the AdamW group moves exactly as
        # ZeroAdamW moves it with the same options
        options = dict(moment_dtype=torch.int8, param_remainders=True, stage=stage, bucket_size=1500)
        model = model_for(torch.bfloat16)
        groups = zero_muon_groups(model)
        for g in groups[:2]:
            g["lr"] = 0.0
        muon = _train(model, ZeroMuon(groups, **MUON, module=model, **options), rank)
        model = model_for(torch.bfloat16)
        adam = zero_muon_groups(model)[2]
        adam = {k: v for k, v in adam.items() if k != "use_muon"}
        alone = _train(model, ZeroAdamW([adam], **ADAM, module=model, **options), rank)
        assert all(torch.equal(a, b) for a, b in zip(muon, alone)), stage
        assert any(not torch.equal(a, b) for a, b in zip(alone, model_for(torch.bfloat16).parameters()))
    return True


@pytest.mark.slow
def test_param_remainders_and_int8_moments_apply_to_the_adamw_groups():
    assert all(run_on_ranks(2, _encodings))


def test_errors_raised_through_zeromuon_name_it():
    model = model_for(torch.float32)
    with pytest.raises(ValueError, match=r"^zero_ext\.ZeroMuon") as caught:
        ZeroMuon(zero_muon_groups(model), stage=4)
    assert "ZeroAdamW" not in str(caught.value)
    opt = ZeroMuon(zero_muon_groups(model), **MUON)
    with pytest.raises(ValueError, match="ZeroMuon") as caught:
        opt.load_state_dict({"state": {}})
    assert "ZeroAdamW" not in str(caught.value)
    with pytest.raises(ValueError, match="ZeroMuon"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True})
    opt.close()
    # raised from the model's side (stage 3: a parameter read outside forward), not through a call on ZeroMuon
    model = model_for(torch.float32)
    opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=3, module=model)
    with pytest.raises(RuntimeError, match=r"^zero_ext\.ZeroMuon\(stage=3\): parameter 'blocks\.0\.qkv\.weight'"):
        model.blocks[0].qkv.weight.sum()
    opt.close()


def test_messages_from_the_hooks_name_zeromuon():
    """Raised or warned while backward runs, or by a gradient placeholder, not through a call on ZeroMuon."""
    model = model_for(torch.float32)
    model.embed.weight.grad = torch.ones_like(model.embed.weight)  # a gradient from before the optimizer existed
    with pytest.warns(UserWarning, match=r"^zero_ext\.ZeroMuon: dropping the gradients"):
        opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=2, module=model)
    loss_fn(model, batch(0, 0)).backward()
    with pytest.raises(
        RuntimeError, match=r"^zero_ext\.ZeroMuon: .*gradient of parameter 'blocks\.0\.qkv\.weight'"
    ) as caught:
        model.blocks[0].qkv.weight.grad.sum().item()
    assert "ZeroAdamW" not in str(caught.value)
    opt.close()
