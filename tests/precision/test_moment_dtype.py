"""Training with low-precision moments, ``ZeroAdamW(moment_dtype=torch.bfloat16)`` and ``moment_dtype=torch.int8``,
each against its plain-torch reference (one process; tests/helpers/moment_dtypes.py says which): bf16 moments stored
with tests/helpers/stochastic_rounding.py keyed on the canonical element index (tests/helpers/moment_reference.py),
int8 moments quantized per parameter in 64-element blocks (tests/helpers/int8_reference.py). After every step the
parameters, this rank's master and its moments (state dict: bf16 widened, int8 dequantized to fp32) are bitwise the
reference's, at stages 1, 2 and 3, on 1, 2 and 3 gloo ranks, with offload None, "cpu" and "nvme", with buckets that
split parameters into fragments and buckets that hold them whole (int8: the whole ones with ``param_remainders``, the
tie bit in bit 7 of exp_avg_sq's codes); so all those runs are bitwise equal to each other. The runs go through two
param groups (one amsgrad, int8's max_exp_avg_sq int8 too, and maximize, with its own lr and no decay), a step
skipped for an inf gradient (no byte of the stored state changes: moments, int8's codes, scales and remainders) and
add_param_group (a block unfrozen after two updates). max_grad_norm is checked against the reference fed the
engine's own norm; a run saved at 2 ranks resumes at 3 bitwise (a checkpoint holds bf16 moments widened exactly, int8
moments dequantized; loading them gives back the same bf16 values, or the same codes and scales). The distance to
torch.optim.AdamW with fp32 moments on the same gradients is bounded (``MomentDtype.drift_per_step``)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs, state_shards
from moment_dtypes import INT8, MOMENT_DTYPES
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.layout import Range

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SMALL, LARGE = 500, 10**6  # bucket sizes: the largest parameters (2232, 888 elements) in fragments, or none split
STEPS = 6
INF_STEP = 1  # rank 0's loss is inf: every rank skips the step
ADD_AT = 3  # block 0, frozen until then, is unfrozen and added as a third param group before this step
RESUME_AT = 3  # test_resume_at_another_world_size: steps before the checkpoint
DTYPES = list(MOMENT_DTYPES)


def _groups(model) -> list[dict]:
    """Matrices (decayed), vectors (amsgrad and maximize, their own lr, no decay); block 0 frozen (added later)."""
    model.blocks[0].requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [n for n, p in named if p.dim() > 1]},
        {"params": [n for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-2, "amsgrad": True,
         "maximize": True},
    ]  # fmt: skip


def _build(md, stage, offload, bucket, remainders, root, rank, tag, **kw):
    model = build(torch.bfloat16)
    by_name = dict(model.named_parameters())
    groups = [{**g, "params": [(n, by_name[n]) for n in g["params"]]} for g in _groups(model)]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=bucket, module=model, moment_dtype=md.dtype,
                    param_remainders=remainders, **offload_kwargs(offload, root, rank, tag, md.window),
                    **kw)  # fmt: skip
    return model, opt


def _bf16_stored_bytes(opt) -> list[torch.Tensor]:
    """Every stored kind as kept (bf16 moments as bf16), read through the seam, with the in-memory buffers' raw
    bytes; nvme's files are read through the placement (bf16 widens injectively: equal values, equal bytes)."""
    out = state_shards(opt)
    for group in opt.sharded_state.groups:
        for kind, t in group.tensors().items():
            if kind in group.rule.kind_names:
                out.append(t.detach().view(torch.uint8).clone())
    return out


def _int8_stored_bytes(opt) -> list[torch.Tensor]:
    """Every stored kind's bits as kept (codes with the tie bit, scales, remainders; nvme files read through the
    placement), through the placements' documented ``stored``."""
    return [
        g.state.stored(k, Range(0, g.layout.shard_numel)).detach().cpu().view(torch.uint8).clone()
        for g in opt.sharded_state.groups
        for k in g.rule.kind_names
        if k != "master" or g.state.master_copy
    ]


STORED_BYTES = {"bf16": _bf16_stored_bytes, "int8": _int8_stored_bytes}


def _add_block0(model, opt):
    model.blocks[0].requires_grad_(True)
    opt.add_param_group({"params": list(model.blocks[0].parameters()), "lr": 2e-3})


def _scenario(rank, world, name, configs, root):
    """Every (stage, offload, bucket, remainders) of ``configs`` side by side with one reference. Returns the
    distance to torch.optim.AdamW's fp32 moments, in units of the largest lr."""
    md, stored_bytes = MOMENT_DTYPES[name], STORED_BYTES[name]
    ref_model = build(torch.bfloat16)
    ref = md.reference(ref_model, _groups(ref_model), loss_fn, HYPER)
    runs = [_build(md, *c, root, rank, "-".join(map(str, c))) for c in configs]
    for step in range(STEPS):
        if step == ADD_AT:
            ref_model.blocks[0].requires_grad_(True)
            ref.add_group({"params": [f"blocks.0.{n}" for n, _ in ref_model.blocks[0].named_parameters()],
                           "lr": 2e-3})  # fmt: skip
            for model, opt in runs:
                _add_block0(model, opt)
        means = ref.mean_grads([batch(step, r) for r in range(world)])
        before = [stored_bytes(opt) for _, opt in runs] if step == INF_STEP else None
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
                after = stored_bytes(opt)
                assert all(torch.equal(x, y) for x, y in zip(b, after)), "a skipped step changed stored state"
        else:
            assert ref.step(means)
        for (model, opt), config in zip(runs, configs):
            ref.check(opt, model, f"{name}: world {world} (stage, offload, bucket, remainders) {config} step {step}")
    for _, opt in runs:
        opt.close()
    diff, lr = ref.distance_to_fp32()
    assert diff <= STEPS * md.drift_per_step * lr, (diff, lr)
    return diff / lr


def _configs(name, offloads):
    """Buckets that split parameters into fragments, or buckets that hold them whole (int8: with remainders). With
    one offload, both for every stage; with several, every pair of the three axes (issue 47: pairwise, not the full
    product: the bucket goes by the parity of stage + offload, so each stage and each offload meets both)."""
    whole_remainders = MOMENT_DTYPES[name].remainders
    buckets = ((SMALL, False), (LARGE, whole_remainders))
    if len(offloads) == 1:
        return [(stage, offloads[0], *bucket) for stage in (1, 2, 3) for bucket in buckets]
    return [
        (stage, offload, *buckets[(i + j) % 2])
        for i, stage in enumerate((1, 2, 3))
        for j, offload in enumerate(offloads)
    ]


@pytest.mark.parametrize("name", DTYPES)
def test_bitwise_the_reference_two_ranks(tmp_path, name):
    results = run_on_ranks(2, _scenario, name, _configs(name, (None,)), str(tmp_path), timeout=300)
    print(f"{name}: max |master - fp32-moment AdamW| / lr:", results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", DTYPES)
def test_bitwise_the_reference_every_stage_offload_and_bucket(tmp_path, name, world):
    results = run_on_ranks(world, _scenario, name, _configs(name, (None, "cpu", "nvme")), str(tmp_path), timeout=600)
    print(f"{name}, world {world}: max |master - fp32-moment AdamW| / lr:", results)


def _clipped(rank, world, name, root):
    """max_grad_norm: the reference scaled by the engine's own clip coefficient (the norm's fp32 sum order is the
    engine's), computed from ``opt.grad_norm`` with the engine's ops; the norm itself close to the reference's."""
    md = MOMENT_DTYPES[name]
    max_norm = 0.05
    ref_model = build(torch.bfloat16)
    ref = md.reference(ref_model, _groups(ref_model), loss_fn, HYPER)
    model, opt = _build(md, 2, None, SMALL, False, root, rank, "clip", max_grad_norm=max_norm)
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
        ref.check(opt, model, f"{name}: clipped, step {step}")
    opt.close()
    return clipped


@pytest.mark.parametrize("name", DTYPES)
def test_max_grad_norm(tmp_path, name):
    assert all(c >= 2 for c in run_on_ranks(2, _clipped, name, str(tmp_path)))  # the clipping is exercised


def _resume(rank, world, name, path, saved_world, root):
    """Saved after ``RESUME_AT`` steps at ``saved_world`` ranks (stage 2, in memory, whole buckets; ``path`` written
    here when this is that world), resumed at stage 3 on nvme with fragments (int8: and param_remainders): the
    reference replays the saved run's steps, then both go on at this world size."""
    md = MOMENT_DTYPES[name]
    ref_model = build(torch.bfloat16)
    ref = md.reference(ref_model, _groups(ref_model), loss_fn, HYPER)
    saving = saved_world == world
    config = (2, None, LARGE, False) if saving else (3, "nvme", SMALL, md.remainders)
    model, opt = _build(md, *config, root, rank, f"resume-{world}")
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
    ref.check(opt, model, f"{name}: world {world}, after {'saving' if saving else 'loading'}")
    for step in range(RESUME_AT, RESUME_AT + 2):
        assert ref.step(ref.mean_grads([batch(step, r) for r in range(world)]))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        ref.check(opt, model, f"{name}: world {world} (saved at {saved_world}), step {step}")
    shards = state_shards(opt)
    opt.close()
    return all(bool(torch.isfinite(s).all()) for s in shards)


@pytest.mark.parametrize("name", DTYPES)
def test_resume_at_another_world_size(tmp_path, name):
    """A checkpoint holds the moments in fp32 (bf16 widened exactly, int8 dequantized), and loading them into the
    same moment dtype gives back the same bits: a run saved at 2 ranks (stage 2, in memory) and resumed at 3 (stage
    3, nvme, buckets in fragments) stays bitwise the reference."""
    path = str(tmp_path / "ckpt")
    assert all(run_on_ranks(2, _resume, name, path, 2, str(tmp_path)))
    assert all(run_on_ranks(3, _resume, name, path, 2, str(tmp_path)))


def _int8_fp32_params(rank, world, root):
    """fp32 parameters are their own master: the int8 moments beside them, every stage and offload, the parameters
    bitwise the reference's after every step."""
    ref_model = build(torch.float32)
    ref = INT8.reference(ref_model, _groups(ref_model), loss_fn, HYPER)
    runs = []
    for stage, offload in ((1, None), (2, "cpu"), (3, None), (3, "nvme")):
        model = build(torch.float32)
        by_name = dict(model.named_parameters())
        groups = [{**g, "params": [(n, by_name[n]) for n in g["params"]]} for g in _groups(model)]
        opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=SMALL, module=model, moment_dtype=INT8.dtype,
                        **offload_kwargs(offload, root, rank, f"fp32-{stage}-{offload}", INT8.window))  # fmt: skip
        runs.append((model, opt))
    for step in range(3):
        means = ref.mean_grads([batch(step, r) for r in range(world)])
        for model, opt in runs:
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        assert ref.step(means)
        for model, opt in runs:
            with opt.gathered_params():
                for n, p in model.named_parameters():
                    if n in ref.params:
                        assert torch.equal(p.detach(), ref.params[n].master.view(p.shape)), (n, step)
    for _, opt in runs:
        opt.close()
    return True


def test_fp32_params_with_int8_moments(tmp_path):
    assert all(run_on_ranks(2, _int8_fp32_params, str(tmp_path)))
