"""ZeroMuon against the unsharded run (tests/helpers/muon_reference.py: torch.optim.Muon on the Muon groups, the
fused AdamW kernel on the others, fp32 masters, the mean of every rank's gradients): bitwise, at stages 1, 2 and 3,
offload None / cpu / nvme, 1, 2 and 3 gloo ranks (gloo's mean is the reference's mean to the bit, so Newton-Schulz
sees the same matrix), with tied weights, a frozen matrix and a frozen bias, two Muon groups with different lr."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import mean_grads, offload_kwargs, params_digest, rank_grads
from muon_reference import MUON, MuonReference, freeze, zero_muon_groups
from pairwise import marked_slow, pairwise
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroMuon

WINDOW = 3 * 12 * 4096  # nvme: a few chunks per shard


def model_for(dtype):
    model = build(dtype)
    freeze(model)
    return model


def means_at(ref: MuonReference, step: int, world: int, dtype) -> dict:
    """The mean gradients of ``world`` ranks at ``step`` for a model holding the reference's parameters."""
    model = model_for(dtype)
    ref.load_into(model)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    means = mean_grads(rank_grads(model, params, [batch(step, r) for r in range(world)], loss_fn), params)
    return {name: g for (name, _), g in zip(named, means)}


def optimizer(model, stage, offload, root, rank, tag, **kw):
    return ZeroMuon(zero_muon_groups(model), **{**MUON, **kw}, stage=stage, module=model, bucket_size=1500,
                    **offload_kwargs(offload, root, rank, tag, WINDOW))  # fmt: skip


def train(rank, world, stage, offload, dtype_name, root, steps=3, muon=None):
    muon = muon or {}
    dtype = getattr(torch, dtype_name)
    model = model_for(dtype)
    opt = optimizer(model, stage, offload, root, rank, f"s{stage}", **muon)
    ref = MuonReference(model_for(dtype), **muon)
    for step in range(steps):
        ref.step(means_at(ref, step, world, dtype))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            ref.check(opt, model, f"stage {stage} offload {offload} step {step}")
    with opt.gathered_params():
        digest = params_digest(model)
    owners = opt.owners()
    opt.close()
    return digest, owners


# World size, offload and stage act independently: every one-rank combination (the quick loop's), then every pair of
# values with 2 and 3 ranks (tests/helpers/pairwise.py): 15 runs instead of 27.
AXES = {"world": [1, 2, 3], "offload": [None, "cpu", "nvme"], "stage": [1, 2, 3]}
ONE_RANK = [(1, o, s) for o in AXES["offload"] for s in AXES["stage"]]
CASES = ONE_RANK + pairwise(AXES, covered=ONE_RANK)


@pytest.mark.parametrize("world,offload,stage", marked_slow(CASES, lambda row: row[0] > 1))
def test_zero_muon_is_torch_muon(tmp_path, stage, offload, world):
    out = run_on_ranks(world, train, stage, offload, "float32", str(tmp_path))
    assert len({digest for digest, _ in out}) == 1, "params differ between ranks"
    assert all(owners == out[0][1] for _, owners in out), "ranks chose different owners"
    assert {o["owner"] for o in out[0][1]} == set(range(world)), "some rank owns no matrix"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_parameters_keep_an_fp32_master(tmp_path, stage):
    run_on_ranks(2, train, stage, None, "bfloat16", str(tmp_path))


def _stages_agree(rank, world, root):
    digests = []
    for stage in (1, 2, 3):
        model = model_for(torch.float32)
        opt = optimizer(model, stage, None, root, rank, f"agree{stage}")
        for step in range(3):
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            digests.append(params_digest(model))
        opt.close()
    return digests


@pytest.mark.slow
def test_stages_give_the_same_bits(tmp_path):
    out = run_on_ranks(3, _stages_agree, str(tmp_path))
    assert len(set(out[0])) == 1, "stages 1, 2, 3 differ"


@pytest.mark.slow
@pytest.mark.parametrize(
    "muon",
    [dict(adjust_lr_fn="match_rms_adamw"), dict(adjust_lr_fn="original", nesterov=False),
     dict(ns_steps=3, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-5, momentum=0.9)],
)  # fmt: skip
def test_torch_muons_options(tmp_path, muon):
    run_on_ranks(2, train, 2, None, "float32", str(tmp_path), 3, muon)
