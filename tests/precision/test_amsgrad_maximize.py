"""ZeroAdamW(amsgrad=..., maximize=...) against torch.optim.AdamW(amsgrad=..., maximize=...) with averaged gradients
and against the unsharded fused kernel (tests/helpers/amsgrad_reference.py says what is bitwise what): every stage at 1,
2 and 3 gloo ranks, bf16 and fp32 params, two param groups with the flags overridden per group; gradients that shrink
so that amsgrad's running max holds an older value; maximize changed between steps (honored), amsgrad changed
(refused on every rank, nothing changed); offload to host memory and disk bitwise the in-memory run; the state
dict's ``max_exp_avg_sq``; the memory ledger's."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
import torch
from amsgrad_reference import (
    FLAG_IDS,
    FLAGS,
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
from engine_reference import LiveStorages, offload_kwargs
from tiny_transformer import batch, build

from zero_ext import ZeroAdamW
from zero_ext.memory import estimate_breakdown

BUCKET = 1500
STEPS = 6
# Chunks of about 2048 elements with four fp32 kinds and fp32 params: several per shard.
WINDOW = 3 * 20 * 2048


def _train_step(model, opt, step, rank):
    scaled_loss(model, batch(step, rank), SCALES[step]).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------- parity
def _parity(rank, world, stage, amsgrad, maximize):
    owned = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = build(dtype)
        opt = build_optimizer(model, amsgrad, maximize, stage, BUCKET)
        flags = [(g["amsgrad"], g["maximize"]) for g in opt.param_groups]
        assert flags == [(amsgrad, maximize), (not amsgrad, not maximize)], flags
        ref = Reference(dtype, amsgrad, maximize)
        for step in range(STEPS):
            ref.step(ref.mean_grads(step, world))
            _train_step(model, opt, step, rank)
            owned[dtype] = ref.check(opt, model, f"stage {stage} {dtype} world {world} step {step}")
        ref.assert_max_is_exercised()
    return owned, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flags", range(len(FLAGS)), ids=FLAG_IDS)
def test_the_references_agree(flags):
    """The harness, which needs no ZeroAdamW: torch's moments bitwise the fused kernel's, its master within the
    slack, and the gradients shrink enough for amsgrad's max to hold older values."""
    with one_thread():
        for dtype in (torch.bfloat16, torch.float32):
            ref = Reference(dtype, *FLAGS[flags])
            ref.train(range(STEPS), 2)
            ref.check_torch_against_fused()
            ref.assert_max_is_exercised()


# A call costs well under a second once the ranks' pool is up (spawning it: 5 to 25 s, once per world size): the
# whole product.
@pytest.mark.parametrize("flags", range(len(FLAGS)), ids=FLAG_IDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_torch_adamw(world, stage, flags):
    results = run_on_ranks(world, _parity, stage, *FLAGS[flags])
    for dtype in (torch.bfloat16, torch.float32):
        owned = sum(r[0][dtype] for r in results)
        assert owned == results[0][1], f"{dtype}: the ranks' state dicts must hold every element exactly once"


# ---------------------------------------------------------------------------------------------- changed flags
def _maximize_changed(rank, world, stage):
    """maximize flipped in one group between steps, as torch honors it at the next step."""
    model = build(torch.bfloat16)
    opt = build_optimizer(model, True, False, stage, BUCKET)
    ref = Reference(torch.bfloat16, True, False)
    for step in range(STEPS):
        if step in (2, 4):
            for group in (0, 1):
                flipped = not opt.param_groups[group]["maximize"]
                opt.param_groups[group]["maximize"] = flipped
                ref.set_flag(group, "maximize", flipped)
        ref.step(ref.mean_grads(step, world))
        _train_step(model, opt, step, rank)
        ref.check(opt, model, f"stage {stage} step {step}")
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_maximize_changed_between_steps_is_honored(stage):
    assert all(run_on_ranks(2, _maximize_changed, stage))


def _amsgrad_changed(rank, world, who):
    """amsgrad changed after construction (which sized the state): the next step raises on every rank, naming
    `amsgrad` where it was changed, and changes nothing (parameters, state, gradients: put back, the step is
    bitwise a twin's that was never refused)."""
    runs = [build(torch.bfloat16) for _ in range(2)]
    runs = [(m, build_optimizer(m, True, False, 2, BUCKET)) for m in runs]
    for step in range(2):
        for model, opt in runs:
            _train_step(model, opt, step, rank)
    (model, opt), (twin_model, twin) = runs
    for group, value in ((1, True), (0, False)):  # a plain group made amsgrad, an amsgrad group made plain
        for m, o in runs:
            scaled_loss(m, batch(2, rank), SCALES[2]).backward()
        before = full_params(opt, model), local_state(opt), opt.step_count
        changes = who == "every" or rank == world - 1
        if changes:
            opt.param_groups[group]["amsgrad"] = value
        with pytest.raises(ValueError) as info:
            opt.step()
        message = str(info.value)
        if changes:
            assert "amsgrad" in message, message
        assert opt.step_count == before[2] == twin.step_count, (opt.step_count, before[2], twin.step_count)
        assert_same_params(before[0], full_params(opt, model), "after the refused step")
        assert_same_state(before[1], local_state(opt), "after the refused step")
        opt.param_groups[group]["amsgrad"] = not value
        for o in (opt, twin):
            o.step()
            o.zero_grad()
        assert_same_params(full_params(twin, twin_model), full_params(opt, model), "the step after")
        assert_same_state(local_state(twin), local_state(opt), "the step after")
    return True


@pytest.mark.parametrize("who", ["every", "one"], ids=["on_every_rank", "on_one_rank"])
def test_amsgrad_changed_after_construction_fails_every_rank_and_changes_nothing(who):
    assert all(run_on_ranks(2, _amsgrad_changed, who, timeout=90))


def _amsgrad_differs_between_ranks(rank, world):
    model = build(torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="differ between ranks|amsgrad"):
        build_optimizer(model, rank == 0, False, 2, BUCKET)
    return True


def test_amsgrad_differing_between_ranks_fails_construction_on_every_rank():
    """The state each rank keeps would differ: refused at construction like any other setting that differs."""
    assert all(run_on_ranks(2, _amsgrad_differs_between_ranks, timeout=60))


# ---------------------------------------------------------------------------------------------- offload
def _offload_kw(offload, root, rank, tag):
    return offload_kwargs(offload, root, rank, tag, WINDOW)


def _offload_same(rank, world, root, stage):
    for dtype in (torch.bfloat16, torch.float32):
        runs = []
        for offload in (None, "cpu", "nvme"):
            model = build(dtype)
            kw = _offload_kw(offload, root, rank, f"{stage}-{dtype}")
            runs.append((model, build_optimizer(model, True, True, stage, BUCKET, **kw)))
        ref = Reference(dtype, True, True)
        for step in range(STEPS):
            for model, opt in runs:
                _train_step(model, opt, step, rank)
            params = [full_params(o, m) for m, o in runs]
            states = [local_state(o) for _, o in runs]
            for offload, p, s in zip(("cpu", "nvme"), params[1:], states[1:]):
                what = f"stage {stage} {dtype} offload={offload} step {step}"
                assert_same_params(params[0], p, what)
                assert_same_state(states[0], s, what)
        ref.train(range(STEPS), world)
        ref.check(runs[0][1], runs[0][0], f"stage {stage} {dtype} in memory")  # the in-memory run is torch's
        for (_, opt), medium in zip(runs[1:], ("host", "disk")):  # the ledger says where the max lives
            r = opt.memory_report()
            disk = sum(r.on_disk.values())
            assert r.where["max_exp_avg_sq"] == medium, r.where
            assert (r.on_disk.get("max_exp_avg_sq", 0) > 0) == (medium == "disk"), r.on_disk
            assert r.total + disk == (r.formula + r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers
                                      - r.param_shard_not_kept), str(r)  # fmt: skip
        for _, opt in runs:
            opt.close()
    return True


@pytest.mark.slow  # with today's engine's plain flags: 15 s at 2 ranks, 30 s at 3 (three optimizers, two dtypes)
@pytest.mark.parametrize("world,stage", [(2, 2), (3, 3)])
def test_offload_is_bitwise_the_in_memory_optimizer(tmp_path, world, stage):
    assert all(run_on_ranks(world, _offload_same, str(tmp_path), stage, timeout=300))
    assert not [f for _, _, files in os.walk(tmp_path) for f in files], "state files left behind after close()"


# ---------------------------------------------------------------------------------------------- state dict
def _state_dict_round_trip(rank, world, stage):
    """A state dict with max_exp_avg_sq, loaded into an optimizer that trained on other data: it continues
    bitwise as the one that saved it."""
    a_model, b_model = build(torch.bfloat16), build(torch.bfloat16)
    a = build_optimizer(a_model, True, True, stage, BUCKET)
    b = build_optimizer(b_model, True, True, stage, BUCKET)
    for step in range(3):
        _train_step(a_model, a, step, rank)
        _train_step(b_model, b, step + 3, rank)  # other batches: another state, another max
    saved = a.state_dict()
    amsgrad_params = {i for gi, g in enumerate(a.param_groups) if g["amsgrad"]
                      for i in range(sum(len(x["params"]) for x in a.param_groups[:gi]),
                                     sum(len(x["params"]) for x in a.param_groups[: gi + 1]))}  # fmt: skip
    assert saved["state"], "this rank owns nothing: the test wants every rank to hold state"
    for index, entry in saved["state"].items():
        assert ("max_exp_avg_sq" in entry) == (index in amsgrad_params), f"parameter {index}: {sorted(entry)}"
        if index in amsgrad_params:
            runs = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]  # split parameters
            numel = sum(e - s for s, e in runs)
            assert entry["max_exp_avg_sq"].dtype == torch.float32 and entry["max_exp_avg_sq"].shape == (numel,)
            assert not torch.equal(entry["max_exp_avg_sq"], entry["exp_avg_sq"])
    # Without max_exp_avg_sq (a state dict saved without amsgrad): refused on every rank, nothing changed.
    partial = {**saved, "state": {i: {k: v for k, v in e.items() if k != "max_exp_avg_sq"}
                                  for i, e in saved["state"].items()}}  # fmt: skip
    before = local_state(b)
    with pytest.raises(ValueError, match="max_exp_avg_sq|amsgrad"):
        b.load_state_dict(partial)
    assert_same_state(before, local_state(b), f"stage {stage}: after the refused load")
    b.load_state_dict(saved)
    assert_same_state(local_state(a), local_state(b), f"stage {stage}: loaded")
    for step in range(3, 5):
        _train_step(a_model, a, step, rank)
        _train_step(b_model, b, step, rank)
    assert_same_params(full_params(a, a_model), full_params(b, b_model), f"stage {stage}: continued")
    assert_same_state(local_state(a), local_state(b), f"stage {stage}: continued")
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_carries_max_exp_avg_sq(stage):
    assert all(run_on_ranks(2, _state_dict_round_trip, stage))


# ---------------------------------------------------------------------------------------------- the ledger
def _ledger(rank, world, stage, dtype_name):
    dtype = getattr(torch, dtype_name)
    reports, grown = {}, {}
    for amsgrad in (False, True):
        model = build(dtype)
        named = list(model.named_parameters())
        before = LiveStorages()
        opt = ZeroAdamW(named, amsgrad=amsgrad, maximize=True, stage=stage, bucket_size=BUCKET,
                        module=model if stage == 3 else None)  # fmt: skip
        _train_step(model, opt, 0, rank)
        reports[amsgrad] = r = opt.memory_report()
        grown[amsgrad] = before.born_bytes()
        shard = sum(g.layout.shard_numel for g in opt.sharded_state.groups)
        # tests/engine/test_memory.py's identity
        assert r.total == r.formula + r.padding + r.staging + r.grad_shard_fp32 - r.param_shard_not_kept, str(r)
        state_bytes = (8 if dtype == torch.float32 else 12) + (4 if amsgrad else 0)
        assert r.widths["optimizer_state_bytes"] == state_bytes, r.widths
        if amsgrad:
            assert r.allocated["max_exp_avg_sq"] == r.allocated["exp_avg"] == 4 * shard, r.allocated
            assert "max_exp_avg_sq" in str(r)
        else:
            assert not r.allocated.get("max_exp_avg_sq"), r.allocated
        opt.close()
        del opt
    plain, ams = reports[False], reports[True]
    assert ams.total - plain.total == 4 * shard
    assert ams.formula - plain.formula == 4 * ams.owned_numel
    assert ams.padding - plain.padding == 4 * (shard - ams.owned_numel)
    assert grown[True] - grown[False] == 4 * shard, (grown, shard)  # what is really alive, not the ledger
    return ams.formula, ams.owned_numel, ams.num_params, ams.widths


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_memory_report_counts_max_exp_avg_sq(stage, dtype):
    """max_exp_avg_sq: 4 bytes per shard element, in the ZeRO formula's optimizer states (its owned elements) and
    the padding (the rest); the identity tests/engine/test_memory.py checks holds, and what is alive grew by as much."""
    results = run_on_ranks(2, _ledger, stage, dtype)
    formulas, owned, psis, widths = zip(*results)
    assert sum(owned) == psis[0]
    assert Fraction(sum(formulas), 2) == sum(estimate_breakdown(psis[0], 2, stage, **widths[0]).values())
