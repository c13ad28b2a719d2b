"""Parameters changed in place between steps at stages 1 and 2 (``model.load_state_dict`` after the optimizer was
built, ``p.mul_`` under no_grad, an edit inside ``gathered_params(modifier_rank=...)``): the next step updates the
changed values, as torch.optim.AdamW does, in memory and with both offloads, bf16 and fp32 params, on 1, 2 and 3
gloo ranks; every element the edit left alone keeps its fp32 master bits. A change on some ranks only fails on
every rank and changes nothing; a state dict saved right after a change holds it."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, reference, state_shards, step_with_reference
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WINDOW = 3 * 14 * 1024 * 2  # offload="nvme": chunks of 2048 elements, several per shard
PLACEMENTS = (None, "cpu", "nvme")


def _optimizer(model, stage, offload, root, rank, tag):
    kw = {}
    if offload == "nvme":
        directory = os.path.join(root, f"{tag}-rank{rank}")
        os.makedirs(directory, exist_ok=True)
        kw = dict(offload_dir=directory, offload_window=WINDOW)
    return ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, offload=offload, **kw)


def _train(model, opt, ref_params, ref_opt, step, world, rank):
    step_with_reference(model, opt, ref_params, ref_opt, [batch(step, r) for r in range(world)], rank, loss_fn)


def _follow(ref, new):
    """The reference master follows an edit as the optimizer promises: the elements whose value in the parameter's
    dtype changed take the new value; the others keep their fp32 master bits."""
    changed = new != ref.detach().to(new.dtype)
    ref.data[changed] = new[changed].float()


def _edits_are_kept(rank, world, root):
    for dtype in (torch.bfloat16, torch.float32):
        for stage in (1, 2):
            for offload in PLACEMENTS:
                tag = f"{stage}-{offload}-{dtype}"
                model = build(dtype)
                opt = _optimizer(model, stage, offload, root, rank, tag)
                ref_params, ref_opt = reference(build(dtype), **HYPER)
                for step in range(4):
                    if step == 1:  # model.load_state_dict after the optimizer was built: half the weights replaced
                        new = {n: torch.full_like(p, 0.25) for n, p in list(model.named_parameters())[::2]}
                        model.load_state_dict(new, strict=False)
                    if step == 2:  # an in-place edit under no_grad, and one through gathered_params
                        with torch.no_grad():
                            model.blocks[0].fc.weight.mul_(0.5)
                        with opt.gathered_params(modifier_rank=world - 1), torch.no_grad():
                            if rank == world - 1:
                                model.ln_f.bias.add_(1.0)
                    if step in (1, 2):
                        for p, ref in zip(model.parameters(), ref_params):
                            _follow(ref, p.detach())
                    _train(model, opt, ref_params, ref_opt, step, world, rank)
                    check_against_reference(opt, model, ref_params, rank)
                opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_parameters_changed_between_steps_are_what_the_next_step_updates(tmp_path, world):
    run_on_ranks(world, _edits_are_kept, str(tmp_path))


def _changed_on_one_rank(rank, world, root, stage):
    model = build(torch.bfloat16)
    opt = _optimizer(model, stage, None, root, rank, f"one-{stage}")
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    _train(model, opt, ref_params, ref_opt, 0, world, rank)
    before = state_shards(opt)
    if rank == 0:  # a checkpoint's weights loaded on rank 0 only
        model.load_state_dict({"ln_f.weight": torch.full_like(model.ln_f.weight, 2.0)}, strict=False)
    loss_fn(model, batch(1, rank)).backward()
    with pytest.raises(ValueError, match=r"changed in place on 1 of 2 ranks.*gathered_params\(modifier_rank=r\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, state_shards(opt))), "the failed step changed the state"
    # The way out the message names: rank 0's parameters become every rank's, and training goes on from them.
    with opt.gathered_params(modifier_rank=0):
        pass
    for p, ref in zip(model.parameters(), ref_params):
        _follow(ref, p.detach())
    opt.zero_grad()
    _train(model, opt, ref_params, ref_opt, 1, world, rank)
    check_against_reference(opt, model, ref_params, rank)


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_changed_on_some_ranks_only_fail_on_every_rank(tmp_path, stage):
    run_on_ranks(2, _changed_on_one_rank, str(tmp_path), stage)


def _saved_right_after_a_change(rank, world, root, offload):
    model = build(torch.bfloat16)
    opt = _optimizer(model, 2, offload, root, rank, f"saved-{offload}")
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    _train(model, opt, ref_params, ref_opt, 0, world, rank)
    model.load_state_dict({n: torch.full_like(p, -0.5) for n, p in model.named_parameters()}, strict=False)
    flat = [p.detach().reshape(-1) for p in model.parameters()]  # one group: the optimizer's order is the model's
    for index, entry in opt.state_dict()["state"].items():
        runs = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]  # split parameters
        assert torch.equal(entry["master"], torch.cat([flat[index][s:e] for s, e in runs]).float())
    opt.close()


@pytest.mark.parametrize("offload", PLACEMENTS)
def test_a_state_dict_taken_right_after_a_change_holds_it(tmp_path, offload):
    run_on_ranks(2, _saved_right_after_a_change, str(tmp_path), offload)
