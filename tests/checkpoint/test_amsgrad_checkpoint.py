"""amsgrad's ``max_exp_avg_sq`` through zero_ext.checkpoint: saved at 2 gloo ranks (in memory and offloaded to disk),
loaded at 1 and 3 ranks at other stages and placements, bitwise the state saved and, continued on the new world
size's mean gradient, bitwise an uninterrupted unsharded run (tests/helpers/amsgrad_reference.py); a checkpoint whose
param groups differ in amsgrad is refused on every rank with nothing changed; consolidation writes
``max_exp_avg_sq/<name>`` and ``adamw_state_dict`` gives torch.optim.AdamW what it needs to continue."""

from __future__ import annotations

import os

import pytest
import torch
from amsgrad_reference import (
    HYPER,
    SCALES,
    Reference,
    assert_same_params,
    assert_same_state,
    build_optimizer,
    full_params,
    local_state,
    one_thread,
    scaled_loss,
)
from distributed import run_on_ranks
from engine_reference import offload_kwargs
from safetensors.torch import load_file
from tiny_transformer import batch, build

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.checkpoint import CheckpointError

BUCKET = 1500
SAVE_AT, CONTINUE = 3, 3
SAVED_WORLD = 2
AMSGRAD, MAXIMIZE = True, True  # the first group amsgrad and maximizing, the second neither
WINDOW = 3 * 20 * 2048


def _optimizer(model, rank, root, tag, stage, offload):
    kw = offload_kwargs(offload, root, rank, tag, WINDOW)
    return build_optimizer(model, AMSGRAD, MAXIMIZE, stage, BUCKET, **kw)


def _step(model, opt, step, rank):
    scaled_loss(model, batch(step, rank), SCALES[step]).backward()
    opt.step()
    opt.zero_grad()


def _save(rank, world, root, path, dtype_name, stage, offload):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    opt = _optimizer(model, rank, root, "save", stage, offload)
    ref = Reference(dtype, AMSGRAD, MAXIMIZE)
    for step in range(SAVE_AT):
        ref.step(ref.mean_grads(step, world))
        _step(model, opt, step, rank)
    ref.check(opt, model, "before saving")
    checkpoint.save(path, opt)
    opt.close()
    return True


def _load_and_continue(rank, world, root, path, dtype_name, stage, offload):
    dtype = getattr(torch, dtype_name)
    model = build(dtype, seed=1)  # other weights: the load must replace them
    opt = _optimizer(model, rank, root, f"load-{stage}-{offload}", stage, offload)
    checkpoint.load(path, opt)
    # The uninterrupted run: the saved world size's mean gradient up to the checkpoint, this one's after it.
    ref = Reference(dtype, AMSGRAD, MAXIMIZE)
    ref.train(range(SAVE_AT), SAVED_WORLD)
    where = f"saved at {SAVED_WORLD} ranks, loaded at {world} (stage {stage}, offload={offload})"
    ref.check(opt, model, where)
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        ref.step(ref.mean_grads(step, world))
        _step(model, opt, step, rank)
        ref.check(opt, model, f"{where}, step {step}")
    ref.assert_max_is_exercised()
    opt.close()
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """amsgrad checkpoints saved at 2 ranks: bf16 at stage 3 with the state on disk, fp32 at stage 2 in memory."""
    root = tmp_path_factory.mktemp("amsgrad-ckpt")
    out = {}
    for dtype, stage, offload in (("bfloat16", 3, "nvme"), ("float32", 2, None)):
        out[dtype] = str(root / f"{dtype}-s{stage}-{offload}")
        assert all(run_on_ranks(SAVED_WORLD, _save, str(root), out[dtype], dtype, stage, offload))
    return out


LOADS = [("bfloat16", 1, 1, None), ("bfloat16", 3, 2, "cpu"), ("bfloat16", 3, 3, "nvme"), ("float32", 1, 3, None),
         ("float32", 3, 1, "nvme")]  # fmt: skip


@pytest.mark.parametrize("dtype,world,stage,offload", LOADS, ids=[f"{d}-world{w}-stage{s}-{o}" for d, w, s, o in LOADS])
def test_loads_at_another_world_size_and_continues_bitwise(saved, tmp_path, dtype, world, stage, offload):
    assert all(run_on_ranks(world, _load_and_continue, str(tmp_path), saved[dtype], dtype, stage, offload))
    assert not [f for _, _, files in os.walk(tmp_path) for f in files], "state files left behind after close()"


def _groups(model, amsgrad0: bool, amsgrad1: bool) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if p.dim() > 1], "amsgrad": amsgrad0, "maximize": MAXIMIZE},
            {"params": [(n, p) for n, p in named if p.dim() <= 1], "amsgrad": amsgrad1, "maximize": not MAXIMIZE,
             "weight_decay": 0.0}]  # fmt: skip


def _refused(rank, world, path):
    """Saved with amsgrad in the first group only; loaded where the first group is plain, then where the second is
    amsgrad: refused on every rank, naming amsgrad, the optimizer as it was."""
    for flags in ((False, False), (True, True)):
        model = build(torch.bfloat16, seed=1)
        opt = ZeroAdamW(_groups(model, *flags), **HYPER, stage=2, bucket_size=BUCKET)
        _step(model, opt, 0, rank)
        before = full_params(opt, model), local_state(opt), [dict(g, params=None) for g in opt.param_groups]
        with pytest.raises(CheckpointError, match="amsgrad"):
            checkpoint.load(path, opt)
        assert_same_params(before[0], full_params(opt, model), f"{flags}: after the refused load")
        assert_same_state(before[1], local_state(opt), f"{flags}: after the refused load")
        assert [dict(g, params=None) for g in opt.param_groups] == before[2], "the param groups changed"
        assert opt.step_count == 1
    return True


def test_amsgrad_mismatch_is_refused_on_every_rank(saved):
    assert all(run_on_ranks(3, _refused, saved["bfloat16"], timeout=60))


@pytest.mark.parametrize("cli", [True, False], ids=["command_line", "function"])
def test_consolidated_state_continues_in_torch_adamw(saved, tmp_path, cli):
    """consolidate writes max_exp_avg_sq/<name> for the amsgrad group's parameters (only), bitwise the unsharded
    run's; adamw_state_dict loads into a torch.optim.AdamW built without the flags, which takes them from the
    groups and continues with moments bitwise the uninterrupted run's."""
    with one_thread():
        _consolidated_state_continues_in_torch_adamw(saved, tmp_path, cli)


def _consolidated_state_continues_in_torch_adamw(saved, tmp_path, cli):
    import subprocess
    import sys

    path = saved["bfloat16"]
    if cli:
        cmd = [sys.executable, "-m", "zero_ext.checkpoint", "consolidate", path, str(tmp_path)]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    else:
        checkpoint.consolidate(path, tmp_path)
    state = load_file(tmp_path / "optimizer.safetensors")
    ref = Reference(torch.bfloat16, AMSGRAD, MAXIMIZE)
    ref.train(range(SAVE_AT), SAVED_WORLD)
    for name in ref.names:
        assert torch.equal(state[f"param/{name}"].reshape(-1), ref.master[name]), name
        assert (f"max_exp_avg_sq/{name}" in state) == ref.amsgrad(name), name
        for kind, full in ref.fused_kinds(name).items():
            assert torch.equal(state[f"{kind}/{name}"].reshape(-1), full), f"{kind}/{name}"
    assert any(ref.amsgrad(n) for n in ref.names) and not all(ref.amsgrad(n) for n in ref.names)

    params = {n: state[f"param/{n}"].clone().requires_grad_() for n in ref.names}
    groups = [{"params": [params[n] for n in ref.names if ref.group_of[n] == gi]} for gi in range(2)]
    adamw = torch.optim.AdamW(groups)  # no flags: they come with the state dict's groups
    adamw.load_state_dict(checkpoint.adamw_state_dict(tmp_path))
    for mine, theirs in zip(adamw.param_groups, ref.torch.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert mine[key] == theirs[key], (key, mine[key], theirs[key])
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        means = ref.mean_grads(step, SAVED_WORLD)
        ref.step(means)
        for n, p in params.items():
            p.grad = means[n].clone()
        adamw.step()
    for n, p in params.items():
        for kind, full in ref.fused_kinds(n).items():
            assert torch.equal(adamw.state[p][kind].reshape(-1), full), f"{n}: {kind}"
        torch.testing.assert_close(p.detach().reshape(-1), ref.master[n])
