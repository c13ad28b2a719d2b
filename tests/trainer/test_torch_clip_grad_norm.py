"""torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) at every stage, as DDP + torch run it: it returns
the norm of the ranks' mean gradient on every rank and the clipping reaches the next step(), on its foreach and
per-tensor paths, with error_if_nonfinite; on 1, 2 and 3 gloo ranks against torch.optim.AdamW fed the mean
gradients. After a synchronised backward ``.grad`` is a placeholder of the sharded mean gradient
(zero_ext/grad_placeholders.py): its other uses raise, naming opt.clip_grad_norm_."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import (
    check_against_reference,
    full_params,
    mean_grads,
    params_digest,
    rank_grads,
    reference,
    state_shards,
)
from pairwise import pairwise_params
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WORLDS = [1, 2, 3]
MAX_NORM = 0.05  # the tiny model's gradient norm is ~2: clipping is active at every step


def _setup(stage, dtype, **kw):
    model = build(dtype)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, module=model, **kw)
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    return model, opt, ref_params, ref_opt


def _per_rank(model, opt, shadow, step, world):
    """Every rank's gradients at the model's current parameters (on a plain copy: stage 3's are shards)."""
    with opt.gathered_params():
        shadow.load_state_dict(model.state_dict())
    return rank_grads(shadow, list(shadow.parameters()), [batch(step, r) for r in range(world)], loss_fn)


def _check(opt, model, ref_params, rank):
    with opt.gathered_params():
        check_against_reference(opt, model, ref_params, rank)


def _parity(rank, world, stage, dtype_name, foreach):
    dtype = getattr(torch, dtype_name)
    model, opt, ref_params, ref_opt = _setup(stage, dtype)
    shadow = build(dtype)
    for step in range(3):
        for p, g in zip(ref_params, mean_grads(_per_rank(model, opt, shadow, step, world), ref_params)):
            p.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM, foreach=foreach)
        assert ref_norm > MAX_NORM, "the test wants clipping to be active"
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=foreach)
        # fp32 for bf16 parameters too: the engine's mean gradient is fp32 (DDP's would be bf16, its norm too)
        torch.testing.assert_close(norm, ref_norm, check_dtype=False)
        opt.step()
        opt.zero_grad()
        _check(opt, model, ref_params, rank)
    with opt.gathered_params():
        return norm.item(), params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_returns_the_mean_gradient_norm_and_the_step_clips(world, stage):
    results = run_on_ranks(world, _parity, stage, "bfloat16", None)
    assert len(set(results)) == 1, "every rank returns the same norm and holds the same parameters"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("foreach", [True, False])
def test_foreach_and_per_tensor_paths_in_fp32(stage, foreach):
    assert len(set(run_on_ranks(2, _parity, stage, "float32", foreach))) == 1


def _snapshot(model, opt):
    params = full_params(model, opt)
    return params + state_shards(opt) + [opt.sharded_state.step_count.clone()]


def _no_clipping_needed(rank, world, stage):
    """max_norm far above the norm: the coefficient is 1 and the run is bitwise the one that never clips."""
    runs = []
    for clip in (True, False):
        model, opt, _, _ = _setup(stage, torch.bfloat16)
        for step in range(3):
            loss_fn(model, batch(step, rank)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
        runs.append(_snapshot(model, opt))
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    return True


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_clipping_needed_is_bitwise_no_call(world, stage):
    assert all(run_on_ranks(world, _no_clipping_needed, stage))


def _nonfinite(rank, world, stage, foreach):
    """One rank's gradient is inf: error_if_nonfinite raises on every rank (the norm is global) and nothing
    changes; the step then skips, as it does for any non-finite gradient."""
    model, opt, _, _ = _setup(stage, torch.float32)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    before = _snapshot(model, opt)
    (loss_fn(model, batch(1, rank)) * (float("inf") if rank == world - 1 else 1.0)).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=True, foreach=foreach)
    for a, b in zip(before, _snapshot(model, opt)):
        assert torch.equal(a, b)
    opt.step()
    assert opt.skipped_steps == 1
    for a, b in zip(before, _snapshot(model, opt)):
        assert torch.equal(a, b)
    return True


# World size, stage and foreach act independently: every pair of their values (tests/helpers/pairwise.py).
@pytest.mark.parametrize(
    "world,stage,foreach", pairwise_params({"world": [1, 2], "stage": [1, 2, 3], "foreach": [None, True]})
)
def test_error_if_nonfinite_raises_on_every_rank(world, stage, foreach):
    assert all(run_on_ranks(world, _nonfinite, stage, foreach))


def _other_uses(rank, world, stage):
    """Reading a placeholder's values raises, naming opt.clip_grad_norm_, and leaves training as it was."""
    model, opt, ref_params, ref_opt = _setup(stage, torch.float32)
    shadow = build(torch.float32)
    for p, g in zip(ref_params, mean_grads(_per_rank(model, opt, shadow, 0, world), ref_params)):
        p.grad = g
    ref_opt.step()
    loss_fn(model, batch(0, rank)).backward()
    grad = model.head.weight.grad
    assert grad is not None and grad.shape == model.head.weight.shape and "placeholder" in repr(grad).lower()
    for use in (lambda: grad.sum(), lambda: grad * 2, lambda: grad.clone(), lambda: grad.add_(1.0),
                lambda: grad.cpu().numpy(), lambda: torch.linalg.vector_norm(grad, 1.0),
                lambda: grad.norm(dim=0)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"sharded.*opt\.clip_grad_norm_|opt\.clip_grad_norm_.*sharded"):
            use()
    opt.step()
    opt.zero_grad()
    _check(opt, model, ref_params, rank)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_other_uses_of_a_placeholder_raise(stage):
    assert all(run_on_ranks(2, _other_uses, stage))


def _per_param_norms(rank, world, stage):
    """Each placeholder's norm is its parameter's mean-gradient norm (logging per-layer norms works), and clipping
    some parameters only clips those."""
    model, opt, ref_params, ref_opt = _setup(stage, torch.float32)
    shadow = build(torch.float32)
    for p, g in zip(ref_params, mean_grads(_per_rank(model, opt, shadow, 0, world), ref_params)):
        p.grad = g
    loss_fn(model, batch(0, rank)).backward()
    for (name, p), ref in zip(model.named_parameters(), ref_params):
        torch.testing.assert_close(p.grad.norm(), ref.grad.norm(), msg=lambda m: f"{name}: {m}")
    some = [i for i, (name, _) in enumerate(model.named_parameters()) if "blocks.0" in name]
    params = list(model.parameters())
    ref_norm = torch.nn.utils.clip_grad_norm_([ref_params[i] for i in some], MAX_NORM)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_([params[i] for i in some], MAX_NORM), ref_norm)
    ref_opt.step()
    opt.step()
    opt.zero_grad()
    _check(opt, model, ref_params, rank)
    return True


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_parameter_norms_and_a_subset_clipped(world, stage):
    assert all(run_on_ranks(world, _per_param_norms, stage))


def _accumulation(rank, world, stage, clip_between):
    """Two backward passes before the step, clipped after both (torch clips the sum) or between them (torch clips
    the first, then adds the second), and the optimizer's or the model's zero_grad after the step."""
    model, opt, ref_params, ref_opt = _setup(stage, torch.float32)
    shadow = build(torch.float32)
    for step in range(3):
        micro = [_per_rank(model, opt, shadow, 2 * step + k, world) for k in range(2)]
        means = [mean_grads(m, ref_params) for m in micro]
        for p, g in zip(ref_params, means[0]):
            p.grad = g
        if clip_between:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
        for p, g in zip(ref_params, means[1]):
            p.grad += g
        if not clip_between:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, batch(2 * step, rank)).backward()
        if clip_between:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        loss_fn(model, batch(2 * step + 1, rank)).backward()
        if not clip_between:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        torch.testing.assert_close(norm, ref_norm)
        opt.step()
        if step % 2:
            model.zero_grad()
        else:
            opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        _check(opt, model, ref_params, rank)
    return True


# World size, stage and clip_between act independently: every pair of their values (tests/helpers/pairwise.py).
@pytest.mark.parametrize(
    "world,stage,clip_between", pairwise_params({"world": [1, 2, 3], "stage": [1, 2, 3], "clip_between": [False, True]})
)
def test_accumulation_then_clip_and_zero_grad(world, stage, clip_between):
    assert all(run_on_ranks(world, _accumulation, stage, clip_between))


def _with_engine_clipping(rank, world, stage):
    """torch's clip, then the engine's own (max_grad_norm=): the engine clips the already clipped gradients, as two
    clip_grad_norm_ calls would."""
    model, opt, ref_params, ref_opt = _setup(stage, torch.float32, max_grad_norm=0.02)
    shadow = build(torch.float32)
    for step in range(2):
        for p, g in zip(ref_params, mean_grads(_per_rank(model, opt, shadow, step, world), ref_params)):
            p.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
        torch.nn.utils.clip_grad_norm_(ref_params, 0.02)
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), ref_norm)
        opt.step()
        opt.zero_grad()
        _check(opt, model, ref_params, rank)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_then_the_engines_own_clipping(stage):
    assert all(run_on_ranks(2, _with_engine_clipping, stage))


def _no_zero_grad_between_steps(rank, world, grad_accum_dtype):
    """Stage 1 keeps gradients across step() as torch does (stages 2 and 3 consume them): without zero_grad the
    next backward adds to the clipped gradients, whichever way the step applied the clipping."""
    model, opt, ref_params, ref_opt = _setup(1, torch.float32, grad_accum_dtype=grad_accum_dtype)
    shadow = build(torch.float32)
    for step in range(3):
        for p, g in zip(ref_params, mean_grads(_per_rank(model, opt, shadow, step, world), ref_params)):
            p.grad = g if p.grad is None else p.grad + g
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), ref_norm)
        opt.step()
        _check(opt, model, ref_params, rank)
    return True


@pytest.mark.parametrize("grad_accum_dtype", [None, torch.float32])
def test_stage1_without_zero_grad_between_steps(grad_accum_dtype):
    assert all(run_on_ranks(2, _no_zero_grad_between_steps, grad_accum_dtype))
