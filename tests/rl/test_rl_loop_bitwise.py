"""Training is unchanged by the RL detour: a loop of (steps, ``offload_states()``, weights streamed to a copy of the
model with ``named_full_params()``, "generation" with the copy, ``reload_states()``, steps) ends bitwise where the
same loop without the detour ends: parameters, every byte of the optimizer's state (``state_dict()``), the counters,
and a checkpoint saved at the end (file by file, byte by byte). Stages 1-3, offload None / cpu / nvme, the precision
settings (bf16 and int8 moments, bf16 parameter + remainder as the master, amsgrad), ZeroMuon, 1-3 gloo ranks; the
slow grids run every pair of their axes' values, not every combination."""

from __future__ import annotations

import filecmp
import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs
from pairwise import missing_pairs, pairwise
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, ZeroMuon, checkpoint

STEPS, DETOURS = 5, (1, 3)  # the detour after these steps
PRECISIONS = {
    "fp32_moments": {},
    "bf16_moments": {"moment_dtype": torch.bfloat16},
    "int8_moments": {"moment_dtype": torch.int8},
    "remainders": {"param_remainders": True},
    "amsgrad": {"amsgrad": True},
}


def _generate(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """The inference engine's work, on its own copy of the weights: a few greedy tokens."""
    tokens = batch(100 + step, rank)[:, :4]
    with torch.no_grad():
        for _ in range(3):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def _run(rank, stage, offload, precision, root, tag, detour, include, ckpt):
    model = build(torch.bfloat16)
    where = offload_kwargs(offload, root, rank, tag, 1 << 16)
    if precision == "muon":  # ZeroMuon: its matrices whole on owner ranks, the rest AdamW
        from muon_reference import MUON, zero_muon_groups

        opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=stage, module=model, bucket_size=1500, **where)
    else:
        opt = ZeroAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, stage=stage, module=model, bucket_size=1500,
                        **PRECISIONS[precision], **where)  # fmt: skip
    generated = []
    for step in range(STEPS):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        if detour and step in DETOURS:
            opt.offload_states(include=include)
            engine = build(torch.bfloat16, seed=7)  # the inference engine's model: other weights until loaded
            engine.load_state_dict(dict(opt.named_full_params()), strict=True)
            generated.append(_generate(engine, step, rank))
            opt.reload_states()
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = opt.state_dict()
    state = {f"{i}.{k}": v.clone() for i, s in sd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    counters = (opt.step_count, opt.skipped_steps)
    checkpoint.save(ckpt, opt, extra={"step": STEPS})
    opt.close()
    return params, state, counters, generated


def _compare(rank, world, stage, offload, precision, root, include):
    plain = _run(rank, stage, offload, precision, root, "plain", False, include, os.path.join(root, "ck-plain"))
    detoured = _run(rank, stage, offload, precision, root, "detour", True, include, os.path.join(root, "ck-detour"))
    for what, a, b in (("params", plain[0], detoured[0]), ("state", plain[1], detoured[1])):
        assert a.keys() == b.keys(), what
        for k in a:
            assert torch.equal(a[k], b[k]), (
                f"{what} {k} differs after the detour (stage {stage}, {offload}, {precision})"
            )
    assert plain[2] == detoured[2]
    assert len(detoured[3]) == len(DETOURS)
    if rank == 0:  # every file of the checkpoint, byte for byte
        a, b = os.path.join(root, "ck-plain"), os.path.join(root, "ck-detour")
        names = sorted(os.listdir(a))
        assert names == sorted(os.listdir(b))
        _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
        assert not mismatch and not errors, (mismatch, errors)
    return [t.tolist() for t in detoured[3]]


def _check(world, stage, offload, precision, tmp_path, include=None):
    generated = run_on_ranks(world, _compare, stage, offload, precision, str(tmp_path), include, timeout=300)
    if world > 1:  # every rank's engine got the same weights (ranks differ only in their prompts)
        assert all(len(g) == len(DETOURS) for g in generated)


TWO_RANKS_STAGES = [1, 2, 3]
OFFLOADS_ONE_RANK = ["cpu", "nvme"]


@pytest.mark.parametrize("stage", TWO_RANKS_STAGES)
def test_detour_is_invisible_two_ranks(stage, tmp_path):
    _check(2, stage, None, "fp32_moments", tmp_path)


@pytest.mark.parametrize("offload", OFFLOADS_ONE_RANK)
def test_detour_with_offload(offload, tmp_path):
    _check(1, 2, offload, "fp32_moments", tmp_path)


@pytest.mark.parametrize("precision", ["bf16_moments", "int8_moments", "remainders"])
def test_detour_precisions_stage3(precision, tmp_path):
    _check(1, 3, None, precision, tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_detour_zero_muon(stage, tmp_path):
    _check(2, stage, None, "muon", tmp_path)


@pytest.mark.parametrize("include", [["optim_states"], ["grads", "params"], "params"])
def test_detour_partial_include(include, tmp_path):
    _check(2, 1, None, "fp32_moments", tmp_path, include=include)


# World size, offload and stage act independently on the detour: the slow grid runs every pair of their values (with
# the rows the quick tests above run), not all 27 combinations (tests/helpers/pairwise.py).
MATRIX_AXES = {"world": [1, 2, 3], "offload": [None, "cpu", "nvme"], "stage": [1, 2, 3]}
MATRIX_QUICK = [(2, None, s) for s in TWO_RANKS_STAGES] + [(1, o, 2) for o in OFFLOADS_ONE_RANK]
MATRIX = pairwise(MATRIX_AXES, covered=MATRIX_QUICK)
# Precision, offload and stage likewise, on 2 ranks: every pair of the 5 x 2 x 3 grid (15 rows of 30).
PRECISION_AXES = {"precision": list(PRECISIONS), "offload": [None, "cpu"], "stage": [1, 2, 3]}
PRECISION_MATRIX = pairwise(PRECISION_AXES)


def test_the_grids_run_every_pair():
    assert not missing_pairs(MATRIX_AXES, MATRIX + MATRIX_QUICK)
    assert not missing_pairs(PRECISION_AXES, PRECISION_MATRIX)


@pytest.mark.slow
@pytest.mark.parametrize("world,offload,stage", MATRIX)
def test_detour_matrix(world, offload, stage, tmp_path):
    _check(world, stage, offload, "fp32_moments", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("precision,offload,stage", PRECISION_MATRIX)
def test_detour_precision_matrix(precision, offload, stage, tmp_path):
    _check(2, stage, offload, precision, tmp_path)
