"""ZeroMuon checkpoints: saved at one world size, stage and offload, loaded at others, training on bitwise as the
unsharded reference replayed; consolidated offline into files that torch.optim.Muon and torch.optim.AdamW load
(``checkpoint.torch_state_dicts``) and continue as the uninterrupted run."""

import pytest
import torch
from distributed import run_on_ranks
from muon_reference import ADAM, MUON, MUON_LR_1, MuonReference, group_names
from safetensors.torch import load_file
from test_muon_parity import means_at, model_for, optimizer
from tiny_transformer import batch, loss_fn

from zero_ext import checkpoint

SAVED_STEPS = 3


def _save(rank, world, path, root):
    model = model_for(torch.float32)
    opt = optimizer(model, 2, "cpu", root, rank, "save")
    for step in range(SAVED_STEPS):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, opt)
    opt.close()


def _replayed(saved_world):
    ref = MuonReference(model_for(torch.float32))
    for step in range(SAVED_STEPS):
        ref.step(means_at(ref, step, saved_world, torch.float32))
    return ref


def _load(rank, world, saved_world, path, stage, offload, root):
    model = model_for(torch.float32)
    with torch.no_grad():  # other weights: the load must bring the saved ones
        for p in model.parameters():
            p.add_(1.0)
    opt = optimizer(model, stage, offload, root, rank, f"load{stage}")
    checkpoint.load(path, opt)
    ref = _replayed(saved_world)
    with opt.gathered_params():
        ref.check(opt, model, "after load")
    for step in range(SAVED_STEPS, SAVED_STEPS + 2):
        ref.step(means_at(ref, step, world, torch.float32))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            ref.check(opt, model, f"loaded at {world} ranks, stage {stage}, step {step}")
    opt.close()


@pytest.mark.slow
def test_checkpoints_cross_world_sizes_stages_and_offload(tmp_path):
    path, root = str(tmp_path / "ck"), str(tmp_path / "offload")
    run_on_ranks(2, _save, path, root)
    run_on_ranks(1, _load, 2, path, 3, "nvme", root)
    run_on_ranks(3, _load, 2, path, 1, None, root)
    run_on_ranks(2, _load, 2, path, 3, "cpu", root)


def _continue_in_torch(rank, world, out, saved_world):
    """Load the consolidated files into a plain model and torch's two optimizers, step on with the reference's mean
    gradients; return the params next to the reference's. Both step torch.optim.Muon on the same matrices, momentum
    and gradients: bitwise. The AdamW parameters: torch's AdamW against the fused kernel, which differ by fp32
    roundings (torch's per-dtype tolerance). Gradients the torch model computed itself would differ from the
    reference's by those roundings too, and Newton-Schulz's bf16 GEMMs amplify such a difference by an amount that
    depends on the CPU (issue 46), so the reference's means are fed to both."""
    model = model_for(torch.float32)
    model.load_state_dict(load_file(f"{out}/model.safetensors"), strict=True)
    named = dict(model.named_parameters())
    m0, m1, adam = group_names(model)
    m0 = [n for n in m0 if named[n].requires_grad]
    adam = [n for n in adam if named[n].requires_grad]
    muon = torch.optim.Muon([{"params": [named[n] for n in m0]}, {"params": [named[n] for n in m1], "lr": MUON_LR_1}],
                            **MUON)  # fmt: skip
    adamw = torch.optim.AdamW([named[n] for n in adam], **ADAM)
    dicts = checkpoint.torch_state_dicts(out)
    muon.load_state_dict(dicts["muon"])
    adamw.load_state_dict(dicts["adamw"])
    ref = _replayed(saved_world)
    for name in m0 + m1:
        assert torch.equal(named[name].detach(), ref.master[name]), f"{name}: the consolidated parameter"
    for step in range(SAVED_STEPS, SAVED_STEPS + 2):
        means = means_at(ref, step, saved_world, torch.float32)
        for name, p in named.items():
            p.grad = None if means[name] is None or not p.requires_grad else means[name].clone()
        ref.step(means)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    for name, p in model.named_parameters():
        if name in m0 or name in m1:
            assert torch.equal(p.detach(), ref.master[name]), f"{name}: torch.optim.Muon on the same inputs"
        else:
            torch.testing.assert_close(p.detach(), ref.master[name], msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.slow
def test_consolidated_checkpoint_continues_in_torch_muon_and_adamw(tmp_path):
    path, root, out = str(tmp_path / "ck"), str(tmp_path / "offload"), str(tmp_path / "out")
    run_on_ranks(2, _save, path, root)
    checkpoint.consolidate(path, out)
    dicts = checkpoint.torch_state_dicts(out)
    assert set(dicts) == {"muon", "adamw"}
    assert all(set(s) == {"momentum_buffer"} for s in dicts["muon"]["state"].values())
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in dicts["adamw"]["state"].values())
    assert [g["lr"] for g in dicts["muon"]["param_groups"]] == [MUON["lr"], MUON_LR_1]
    assert run_on_ranks(1, _continue_in_torch, out, 2) == [True]
