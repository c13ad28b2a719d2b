"""A trainer's habits with ZeroMuon, against the unsharded reference: clipping (``opt.clip_grad_norm_`` and torch's
``clip_grad_norm_`` on the model), gradient accumulation under ``no_sync()``, ``model.zero_grad()`` before
backward, a Muon group added later (``add_param_group``, the unfreezing pattern), and bad input failing on every
rank, naming the parameter."""

import pytest
import torch
from distributed import run_on_ranks
from muon_reference import MUON, MUON_LR_1, MuonReference, group_names, nudged, zero_muon_groups
from test_muon_parity import means_at, model_for, optimizer
from tiny_transformer import batch, loss_fn

from zero_ext import ZeroMuon

CLIP = 0.05  # below the gradients' norm: every step clips


def _clipped(rank, world, how, root):
    model = model_for(torch.float32)
    opt = optimizer(model, 2, None, root, rank, "clip")
    ref, twin = MuonReference(model_for(torch.float32)), MuonReference(model_for(torch.float32))
    for step in range(3):
        ref.step(means_at(ref, step, world, torch.float32), clip=CLIP)
        twin.step(nudged(means_at(twin, step, world, torch.float32), step), clip=CLIP)
        loss_fn(model, batch(step, rank)).backward()
        norm = opt.clip_grad_norm_(CLIP) if how == "opt" else torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            # the norm is summed over shards in another order than torch's: its coefficient may differ in the last
            # bit, so the clipped runs agree at fp32 tolerance or the twin's distance (unclipped ones are bitwise:
            # test_muon_parity.py)
            ref.check(opt, model, f"clip {how} step {step}", exact=False, twin=twin)
    opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["opt", "torch"])
def test_clipping(tmp_path, how):
    run_on_ranks(2, _clipped, how, str(tmp_path))


def _accumulated(rank, world, stage, root):
    """Two micro-batches per step under no_sync() (the second synchronises), model.zero_grad() between steps."""
    model = model_for(torch.float32)
    opt = optimizer(model, stage, None, root, rank, "accum")
    ref, twin = MuonReference(model_for(torch.float32)), MuonReference(model_for(torch.float32))
    for step in range(2):
        for r, seed in ((ref, None), (twin, step)):
            first = means_at(r, 2 * step, world, torch.float32)
            second = means_at(r, 2 * step + 1, world, torch.float32)
            summed = {n: None if g is None else first[n] + second[n] for n, g in first.items()}
            r.step(summed if seed is None else nudged(summed, seed))
        with opt.no_sync():
            loss_fn(model, batch(2 * step, rank)).backward()
        loss_fn(model, batch(2 * step + 1, rank)).backward()
        opt.step()
        model.zero_grad()
        with opt.gathered_params():
            ref.check(opt, model, f"accumulation stage {stage} step {step}", exact=False, twin=twin)
    opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_and_model_zero_grad(tmp_path, stage):
    run_on_ranks(2, _accumulated, stage, str(tmp_path))


def _added_later(rank, world, root):
    """blocks.1's matrices frozen at construction, unfrozen and added as a Muon group after two steps."""
    model = model_for(torch.float32)
    _, m1, _ = group_names(model)
    named = dict(model.named_parameters())
    for n in m1:
        named[n].requires_grad_(False)
    groups = zero_muon_groups(model)
    opt = ZeroMuon([groups[0], groups[2]], **MUON, stage=2, module=model, bucket_size=1500)
    ref = MuonReference(model_for(torch.float32))
    for step in range(4):
        means = means_at(ref, step, world, torch.float32)
        if step < 2:
            means = {n: None if n in m1 else g for n, g in means.items()}
        if step == 2:
            for n in m1:
                named[n].requires_grad_(True)
            opt.add_param_group({"params": [named[n] for n in m1], "lr": MUON_LR_1})
        ref.step(means)
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            ref.check(opt, model, f"add_param_group step {step}")
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, True]
    opt.close()


@pytest.mark.slow
def test_a_muon_group_added_later(tmp_path):
    run_on_ranks(2, _added_later, str(tmp_path))


def _refused(rank, world, root):
    model = model_for(torch.float32)
    with pytest.raises(ValueError, match=r"'blocks.0.ln1.weight'.*2-D"):
        ZeroMuon([{"params": [model.blocks[0].ln1.weight, model.blocks[0].qkv.weight]}], module=model)
    with pytest.raises(ValueError, match="use_muon"):
        ZeroMuon([{"params": [model.blocks[0].qkv.weight], "use_muon": "no"}], module=model)
    with pytest.raises(ValueError, match="Learning rate"):
        ZeroMuon(model.parameters(), lr=-1.0)
    with pytest.raises(TypeError, match="betas"):
        ZeroMuon([model.blocks[0].qkv.weight], betas=(0.9, 0.95))
    return True


@pytest.mark.slow
def test_bad_input_fails_on_every_rank(tmp_path):
    assert run_on_ranks(2, _refused, str(tmp_path)) == [True, True]


def _compiled(rank, world, stage, root):
    """torch.compile(model) (backend "eager": dynamo's graphs, no codegen) trains bitwise as the eager model."""
    digests = []
    for compile_ in (False, True):
        model = model_for(torch.float32)
        opt = optimizer(model, stage, None, root, rank, f"compile{compile_}")
        run = torch.compile(model, backend="eager") if compile_ else model
        for step in range(3):
            loss_fn(run, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            digests.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*digests))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_model(tmp_path, stage):
    torch._dynamo.reset()
    assert run_on_ranks(2, _compiled, stage, str(tmp_path)) == [True, True]
