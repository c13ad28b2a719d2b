"""A trainer's habits: torchrun without init_process_group, a model wrapped in DDP, fp16 loss scaling with torch's
GradScaler, a parameter unfrozen after the optimizer was built, clipping, an optimizer built
twice, a checkpoint of the whole model (frozen parameters, buffers, tied weights) with the scheduler beside it,
resumed at another world size and consolidated into a state dict that loads strictly."""

import warnings

import pytest
import torch
import torch.nn as nn
from distributed import run_on_ranks
from engine_reference import (
    check_against_reference,
    full_params,
    params_digest,
    rank_grads,
    reference,
    set_mean_grads,
    step_with_reference,
)
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WORLDS = [1, 2, 3]


def test_torchrun_without_init_process_group_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .*init_process_group\(\)"):
        ZeroAdamW(build().parameters())


def _ddp_is_refused(rank, world, stage):
    model = build(torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        ZeroAdamW(model.parameters(), module=ddp)
    opt = ZeroAdamW(model.parameters(), module=model, stage=stage, bucket_size=BUCKET)
    with pytest.raises(RuntimeError, match="running inside DistributedDataParallel"):
        loss_fn(ddp, batch(0, rank))
    opt.close()
    # Without module=, stage 2 still notices DDP: it writes .grad at the end of backward, where stage 2 keeps only
    # the placeholders of its sharded gradients (grad_placeholders.py), which refuse the write.
    if stage == 2:
        opt = ZeroAdamW(model.parameters(), stage=2, bucket_size=BUCKET)
        with pytest.raises(RuntimeError, match=r"something else writes \.grad: a model wrapped in Distributed"):
            loss_fn(ddp, batch(0, rank)).backward()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_in_ddp_is_refused(stage):
    assert all(run_on_ranks(2, _ddp_is_refused, stage))


def _full_params(model, opt) -> list:
    """Copies of the model's full parameters (gathered at stage 3)."""
    return full_params(model, opt)


def _refused(model, opt, call, match: str) -> None:
    """``call()`` raises a ValueError matching ``match`` and changes nothing: the full parameters and the step count
    are as they were."""
    before, count = _full_params(model, opt), opt.step_count
    with pytest.raises(ValueError, match=match):
        call()
    assert all(torch.equal(a, b) for a, b in zip(before, _full_params(model, opt)))
    assert opt.step_count == count


def _grad_scaler_is_refused(rank, world, stage):
    """fp16 loss scaling: torch's GradScaler hands itself to step() on every rank, which refuses it clearly, on
    every rank, changing nothing (not the scaler's "No inf checks were recorded", nor, at stage 1, a rank that
    found an inf skipping step() while the others wait in its collectives)."""
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, module=model)
    scaler = torch.amp.GradScaler("cpu")
    loss = loss_fn(model, batch(0, rank))
    if rank == 0:
        loss = loss * float("inf")  # this rank alone finds an inf
    scaler.scale(loss).backward()

    with pytest.warns(FutureWarning):
        _refused(model, opt, lambda: scaler.step(opt), "GradScaler .*not supported.*bf16")
    assert opt.step_count == 0 and opt.skipped_steps == 0
    opt.zero_grad()
    loss_fn(model, batch(1, rank)).backward()  # without the scaler, training goes on
    opt.step()
    assert opt.step_count == 1
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_grad_scaler_is_refused_on_every_rank(stage):
    assert all(run_on_ranks(2, _grad_scaler_is_refused, stage))


def _unfrozen_after_construction(rank, world, stage):
    """Gradual unfreezing: a parameter frozen when the optimizer was built has nothing in it (no shard, no hook), so
    once trainable it would never be updated (torch's AdamW, given it, would). The next step refuses, on every
    rank, naming it, and changes nothing; frozen again, training goes on."""
    model = build(torch.bfloat16)
    model.blocks[0].fc.requires_grad_(False)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, module=model)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()

    model.blocks[0].fc.requires_grad_(True)
    loss_fn(model, batch(1, rank)).backward()
    _refused(model, opt, opt.step, r"'blocks\.0\.fc\.(weight|bias)' had requires_grad=False when the optimizer")
    assert opt.step_count == 1
    model.blocks[0].fc.requires_grad_(False)
    model.zero_grad()
    loss_fn(model, batch(1, rank)).backward()
    opt.step()
    assert opt.step_count == 2
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_unfrozen_after_construction_is_refused(stage):
    assert all(run_on_ranks(2, _unfrozen_after_construction, stage))


def _grad_changed_after_backward(rank, world):
    """Stage 1 reduces during backward: after it ``.grad`` is a placeholder of the sharded mean gradient, whose
    norm and in-place scaling torch.nn.utils.clip_grad_norm_ uses (tests/trainer/test_torch_clip_grad_norm.py); any
    other change (clip_grad_value_) raises at once, on every rank, and changes nothing. A gradient changed in place
    through a reference kept from before (here: from inside no_sync()) would be silently ignored by the step, so the
    step refuses, on every rank, and changes nothing. Gradients changed by a hook before the reduction,
    model.zero_grad() and opt.clip_grad_norm_ are fine."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=1, bucket_size=BUCKET, module=model)
    loss_fn(model, batch(0, rank)).backward()
    before = _full_params(model, opt)
    with pytest.raises(RuntimeError, match=r"sharded over the ranks.*opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(before, _full_params(model, opt)))
    opt.zero_grad()
    with opt.no_sync():
        loss_fn(model, batch(0, rank)).backward()
    kept = model.head.weight.grad  # this rank's accumulated gradient, a view of the flat buffer
    loss_fn(model, batch(0, rank)).backward()
    kept.mul_(0.5)
    _refused(model, opt, opt.step, r"changed in place after backward.*opt\.clip_grad_norm_")
    assert opt.step_count == 0
    model.zero_grad()
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    # A gradient changed by a hook before its reduction: the reference's autograd.grad runs the same hook.
    model.ln_f.bias.register_hook(lambda g: g + 1.0)
    for step in range(1, 3):
        per_rank = rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        set_mean_grads(ref_params, per_rank)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.05)
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        torch.testing.assert_close(opt.clip_grad_norm_(0.05), ref_norm)
        opt.step()
        model.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_a_gradient_changed_after_backward_is_refused_at_stage_1(world):
    assert all(run_on_ranks(world, _grad_changed_after_backward))


def _clip_like_torch(rank, world, stage):
    """opt.clip_grad_norm_ returns torch's global norm (of the mean gradients) and the step applies the clip."""
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    for step in range(4):
        per_rank = rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        set_mean_grads(ref_params, per_rank)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.05)
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        norm = opt.clip_grad_norm_(0.05)
        assert norm.dim() == 0
        torch.testing.assert_close(norm, ref_norm)
        assert opt.clip_grad_norm(0.05) is norm  # twice, or by the other name: the same norm
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_like_torch(world, stage):
    assert len(set(run_on_ranks(world, _clip_like_torch, stage))) == 1


def _built_twice(rank, world, stage):
    """Re-running the cell that builds the optimizer: the first one is closed, the second trains correctly."""
    model = build(torch.float32)
    first = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    loss_fn(model, batch(0, rank)).backward()
    first.step()
    first.zero_grad()
    with pytest.warns(UserWarning, match="belonged to an earlier ZeroAdamW, which is now closed"):
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    with pytest.raises(RuntimeError, match="this optimizer was closed"):
        first.step()
    ref_params, ref_opt = reference(model, **HYPER)
    for step in range(1, 4):
        step_with_reference(model, opt, ref_params, ref_opt, [batch(step, r) for r in range(world)], rank, loss_fn)
        opt.zero_grad()  # twice: harmless
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_building_the_optimizer_twice(world, stage):
    assert len(set(run_on_ranks(world, _built_twice, stage))) == 1


class WithBuffers(nn.Module):
    """The tiny GPT (tied head) with a frozen parameter and a buffer, as a real model has."""

    def __init__(self):
        super().__init__()
        self.gpt = build(torch.float32)
        self.gpt.pos.requires_grad_(False)
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, tokens):
        return self.gpt(tokens) / self.temperature


def _whole_model(rank, world, path, out):
    """Save with module= and the scheduler (every rank), at `world` ranks."""
    torch.manual_seed(0)
    model = WithBuffers()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    opt = ZeroAdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, module=model, stage=2,
                    bucket_size=BUCKET)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in range(3):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    model.temperature.fill_(2.0)  # a buffer changed by training
    checkpoint.save(path, opt, extra={"scheduler": sched.state_dict(), "step": 3, "note": ("ok", 1)})
    if rank == 0:
        checkpoint.consolidate(path, out)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.param_groups[0]["lr"]


def _resume(rank, world, path):
    torch.manual_seed(1)
    model = WithBuffers()  # different weights and buffer: everything must come from the checkpoint
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    opt = ZeroAdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, module=model, stage=1,
                    bucket_size=BUCKET)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    extra = checkpoint.load(path, opt)
    sched.load_state_dict(extra["scheduler"])
    assert extra["step"] == 3 and extra["note"] == ("ok", 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.param_groups[0]["lr"], sched.last_epoch


@pytest.mark.parametrize("resume_world", [1, 3])
def test_a_checkpoint_of_the_whole_model_resumes_anywhere_and_loads_strictly(tmp_path, resume_world):
    path, out = str(tmp_path / "ck"), str(tmp_path / "out")
    saved, lr = run_on_ranks(2, _whole_model, path, out)[0]
    for state, resumed_lr, epoch in run_on_ranks(resume_world, _resume, path):
        assert state.keys() == saved.keys()
        assert all(torch.equal(state[k], saved[k]) for k in saved), "the resumed model differs"
        assert resumed_lr == lr and epoch == 3
    from safetensors.torch import load_file

    consolidated = load_file(f"{out}/model.safetensors")
    model = WithBuffers()
    model.load_state_dict(consolidated, strict=True)  # frozen, buffer, tied head: every key
    assert set(consolidated) == set(saved) and "gpt.head.weight" in consolidated
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


def test_extra_state_must_be_plain_data(tmp_path):
    model = build()
    opt = ZeroAdamW(model.named_parameters())
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    with pytest.raises(TypeError, match="`extra` holds a builtin_function_or_method"):
        checkpoint.save(tmp_path / "ck", opt, extra={"fn": print})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save(tmp_path / "ck", opt, extra={1: torch.arange(3), "t": (None, 2.5)})
    extra = checkpoint.load(tmp_path / "ck", opt)
    assert torch.equal(extra[1], torch.arange(3)) and extra["t"] == (None, 2.5)


def _moved_after_construction(rank, world, stage, how):
    """Moving or casting the model after the optimizer exists would leave the optimizer updating buffers the model
    no longer reads: step() refuses, on every rank (the last rank alone moves its model)."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, module=model)
    loss_fn(model, batch(0, rank)).backward()

    def move():
        if how == "cast":
            model.double()
        else:
            with torch.no_grad():
                model.blocks[0].fc.weight.data = model.blocks[0].fc.weight.detach().clone()

    if stage == 3:  # the parameters are sharded: the move itself cannot read them, and nothing changes
        if rank == world - 1:
            with pytest.raises(RuntimeError, match="is sharded here"):
                move()
        opt.step()
        return True
    model.zero_grad()  # (after backward .grad is a placeholder of the sharded gradient, which a cast refuses)
    if rank == world - 1:
        move()
    match = "no longer lives in the optimizer's flat buffer" if rank == world - 1 else r"failed on 1 other rank"
    with pytest.raises((RuntimeError, ValueError), match=match):
        opt.step()
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["cast", "new_tensor"])
def test_a_model_moved_after_construction_is_refused(stage, how):
    assert all(run_on_ranks(2, _moved_after_construction, stage, how))
