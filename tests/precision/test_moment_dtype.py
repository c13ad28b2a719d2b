"""``ZeroAdamW(moment_dtype=torch.bfloat16)`` training, against the plain-torch reference of
tests/helpers/moment_reference.py (one process, tests/helpers/stochastic_rounding.py keyed on the canonical element
index): after every step the parameters, this rank's master and its moments (state dict: bf16 widened to fp32) are
bitwise the reference's, at stages 1, 2 and 3, on 1, 2 and 3 gloo ranks, with offload None, "cpu" and "nvme", with
buckets that split parameters into fragments and buckets that hold them whole; so all those runs are bitwise equal to
each other. The runs go through two param groups (one amsgrad and maximize, with its own lr and no decay), a step
skipped for an inf gradient (no byte of the stored state changes) and add_param_group (a block unfrozen after two
updates). max_grad_norm is checked against the reference fed the engine's own norm; a run saved at 2 ranks resumes at 3
bitwise. The distance to torch.optim.AdamW with fp32 moments on the same gradients is bounded (the tolerance is stated
at ``FP32_TOLERANCE``; measured 0.012-0.024 lr after 5 updates)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs, state_shards
from moment_reference import SRReference
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SMALL, LARGE = 500, 10**6  # bucket sizes: the largest parameters (2232, 888 elements) in fragments, or none split
STEPS = 6
INF_STEP = 1  # rank 0's loss is inf: every rank skips the step
ADD_AT = 3  # block 0, frozen until then, is unfrozen and added as a third param group before this step
WINDOW = 3 * 14 * 2048  # small nvme windows: several chunks per shard
RESUME_AT = 3  # test_resume_at_another_world_size: steps before the checkpoint
# |master - torch.optim.AdamW's fp32-moment master| after STEPS steps on the same gradients, at most this share of
# the largest lr: a bf16 moment is within one bf16 ulp (2^-8 relative) of its fp32 value, so each update
# lr * m / sqrt(v) moves by about 2^-8 of itself at most, and the drift adds up over the steps.
FP32_TOLERANCE = STEPS * 2.0**-6


def _groups(model) -> list[dict]:
    """Matrices (decayed), vectors (amsgrad and maximize, their own lr, no decay); block 0 frozen (added later)."""
    model.blocks[0].requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [n for n, p in named if p.dim() > 1]},
        {"params": [n for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-2, "amsgrad": True,
         "maximize": True},
    ]  # fmt: skip


def _build(stage, offload, bucket, root, rank, tag, **kw):
    model = build(torch.bfloat16)
    by_name = dict(model.named_parameters())
    groups = [{**g, "params": [(n, by_name[n]) for n in g["params"]]} for g in _groups(model)]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=bucket, module=model, moment_dtype=torch.bfloat16,
                    **offload_kwargs(offload, root, rank, tag, WINDOW), **kw)  # fmt: skip
    return model, opt


def _stored_bytes(opt) -> list[torch.Tensor]:
    """Every stored kind as kept (bf16 moments as bf16), read through the seam, with the in-memory buffers' raw
    bytes; nvme's files are read through the placement (bf16 widens injectively: equal values, equal bytes)."""
    out = state_shards(opt)
    for group in opt.sharded_state.groups:
        for kind, t in group.tensors().items():
            if kind in group.rule.kind_names:
                out.append(t.detach().view(torch.uint8).clone())
    return out


def _add_block0(model, opt):
    model.blocks[0].requires_grad_(True)
    opt.add_param_group({"params": list(model.blocks[0].parameters()), "lr": 2e-3})


def _scenario(rank, world, configs, root):
    """Every (stage, offload, bucket) of ``configs`` side by side with one reference. Returns the distance to
    torch.optim.AdamW's fp32 moments."""
    ref_model = build(torch.bfloat16)
    ref = SRReference(ref_model, _groups(ref_model), loss_fn, HYPER)
    runs = [_build(s, o, b, root, rank, f"{s}-{o}-{b}") for s, o, b in configs]
    for step in range(STEPS):
        if step == ADD_AT:
            ref_model.blocks[0].requires_grad_(True)
            ref.add_group({"params": [f"blocks.0.{n}" for n, _ in ref_model.blocks[0].named_parameters()],
                           "lr": 2e-3})  # fmt: skip
            for model, opt in runs:
                _add_block0(model, opt)
        means = ref.mean_grads([batch(step, r) for r in range(world)])
        before = [_stored_bytes(opt) for _, opt in runs] if step == INF_STEP else None
        for model, opt in runs:
            loss = loss_fn(model, batch(step, rank))
            if step == INF_STEP and rank == 0:
                loss = loss * float("inf")
            loss.backward()
            opt.step()
            opt.zero_grad()
        if step == INF_STEP:
            for (_, opt), b in zip(runs, before):
                assert opt.skipped_steps == 1
                after = _stored_bytes(opt)
                assert all(torch.equal(x, y) for x, y in zip(b, after)), "a skipped step changed stored state"
        else:
            assert ref.step(means)
        for (model, opt), config in zip(runs, configs):
            ref.check(opt, model, f"world {world} (stage, offload, bucket) {config} step {step}")
    for _, opt in runs:
        opt.close()
    diff, lr = ref.distance_to_fp32()
    assert diff <= FP32_TOLERANCE * lr, (diff, lr)
    return diff / lr


def _configs(offloads):
    return [(stage, offload, bucket) for stage in (1, 2, 3) for offload in offloads for bucket in (SMALL, LARGE)]


def test_bitwise_the_reference_two_ranks(tmp_path):
    results = run_on_ranks(2, _scenario, _configs((None,)), str(tmp_path), timeout=300)
    print("max |master - fp32-moment AdamW| / lr:", results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_bitwise_the_reference_every_stage_offload_and_bucket(tmp_path, world):
    results = run_on_ranks(world, _scenario, _configs((None, "cpu", "nvme")), str(tmp_path), timeout=600)
    print(f"world {world}: max |master - fp32-moment AdamW| / lr:", results)


def _clipped(rank, world, root):
    """max_grad_norm: the reference scaled by the engine's own clip coefficient (the norm's fp32 sum order is the
    engine's), computed from ``opt.grad_norm`` with the engine's ops; the norm itself close to the reference's."""
    max_norm = 0.05
    ref_model = build(torch.bfloat16)
    ref = SRReference(ref_model, _groups(ref_model), loss_fn, HYPER)
    model, opt = _build(2, None, SMALL, root, rank, "clip", max_grad_norm=max_norm)
    clipped = 0
    for step in range(3):
        means = ref.mean_grads([batch(step, r) for r in range(world)])
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in means.values() if g is not None]))
        torch.testing.assert_close(opt.grad_norm, norm)
        coef = torch.add(opt.grad_norm, 1e-6)
        torch.div(max_norm, coef, out=coef)
        coef.clamp_(max=1.0)
        clipped += int(coef < 1)
        assert ref.step(means, grad_scale=coef)
        ref.check(opt, model, f"clipped, step {step}")
    opt.close()
    return clipped


def test_max_grad_norm(tmp_path):
    assert all(c >= 2 for c in run_on_ranks(2, _clipped, str(tmp_path)))  # the clipping is exercised


def _resume(rank, world, path, saved_world, root):
    """Saved after ``RESUME_AT`` steps at ``saved_world`` ranks (``path`` None: this call saves), resumed here: the
    reference replays the saved run's steps, then both go on at this world size."""
    ref_model = build(torch.bfloat16)
    ref = SRReference(ref_model, _groups(ref_model), loss_fn, HYPER)
    saving = saved_world == world
    model, opt = _build(2 if saving else 3, None if saving else "nvme", LARGE if saving else SMALL, root, rank,
                        f"resume-{world}")  # fmt: skip
    for step in range(RESUME_AT):
        assert ref.step(ref.mean_grads([batch(step, r) for r in range(saved_world)]))
        if saving:
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    if saving:
        checkpoint.save(path, opt)
    else:
        checkpoint.load(path, opt)
    ref.check(opt, model, f"world {world}, after {'saving' if saving else 'loading'}")
    for step in range(RESUME_AT, RESUME_AT + 2):
        assert ref.step(ref.mean_grads([batch(step, r) for r in range(world)]))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        ref.check(opt, model, f"world {world} (saved at {saved_world}), step {step}")
    opt.close()
    return True


def test_resume_at_another_world_size(tmp_path):
    """A checkpoint holds the bf16 moments widened exactly, so loading them into bf16 moments again is lossless: a
    run saved at 2 ranks (stage 2, in memory) and resumed at 3 (stage 3, nvme, buckets in fragments) stays bitwise
    the reference."""
    path = str(tmp_path / "ckpt")
    assert all(run_on_ranks(2, _resume, path, 2, str(tmp_path)))
    assert all(run_on_ranks(3, _resume, path, 2, str(tmp_path)))
