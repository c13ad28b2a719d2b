"""``ZeroAdamW(param_remainders=True)``: the fp32 master kept as the bf16 parameter plus an int16 remainder.

Against the default fp32 master, run side by side on the same data at stages 1, 2 and 3, on 1, 2 and 3 gloo ranks,
with offload None, "cpu" and "nvme", through accumulation, two param groups (one amsgrad) with a schedule,
clipping, skip-on-inf, a frozen parameter and a branch used on odd steps: after every step the master (joined) and
the moments are bitwise the fp32 run's, and so are the parameters except where a master is a tie with an even
truncation (low 16 bits 0x8000, bit 16 clear), whose parameter is one ulp larger in magnitude (zero_ext.master_split:
no 16-bit remainder of a round-to-nearest-even parameter is exact there). A tie changes the next forward, so the runs
part from there: the comparison stops at the first one and the tests say how many steps were compared.

Also: checkpoints and state dicts between the two settings at other world sizes, consolidation (the fp32 master),
refusals (fp16/fp32 parameters, a non-bool), and the memory saved, measured on the live storages."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from engine_reference import live_storage_bytes, offload_kwargs, state_shards
from safetensors.torch import load_file
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.layout import Range

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
STEPS = 4
WINDOW = 3 * 14 * 1024 * 2  # small nvme windows: several chunks per shard


def _build(stage, offload, root, rank, tag, remainders, accum=None):
    model = build(torch.bfloat16, unused_branch=True)
    model.blocks[0].ln1.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-2, "amsgrad": True},
    ]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=BUCKET, module=model, grad_accum_dtype=accum,
                    param_remainders=remainders, **offload_kwargs(offload, root, rank, tag, WINDOW))  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, schedule


def _train_step(model, opt, schedule, step, rank):
    for micro in range(2):
        with opt.no_sync() if micro == 0 else torch.enable_grad():
            loss = loss_fn(model, batch(step, 10 * rank + micro), use_extra=step % 2 == 1)
            if step == 2 and rank == 0 and micro == 1:
                loss = loss * float("inf")  # skipped on every rank: no byte of either state may change
            loss.backward()
    opt.clip_grad_norm_(0.5)
    opt.step()
    schedule.step()
    opt.zero_grad()


def _snapshot(model, opt):
    """Full parameters (gathered at stage 3) and this rank's saved state (fp32 master, moments), on the host."""
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return params, state_shards(opt), opt.skipped_steps


def _ties(opt) -> int:
    """Masters that are ties with an even truncation, on every rank (a tie in one rank's shard shows in every
    rank's gathered parameters)."""
    masters = [g.state.read("master", Range(0, g.layout.shard_numel)) for g in opt.sharded_state.groups]
    count = torch.tensor([sum(int(((m.view(torch.int32) & 0x1FFFF) == 0x8000).sum()) for m in masters)])
    dist.all_reduce(count)
    return int(count)


def _assert_same(a, b, what) -> None:
    assert a[2] == b[2], f"{what}: skipped steps differ"
    for name, x, y in zip(("param", "state"), (a[0], a[1]), (b[0], b[1])):
        for i, (u, v) in enumerate(zip(x, y)):
            assert u.dtype == v.dtype and torch.equal(u, v), f"{what}: {name} {i} differs in {int((u != v).sum())}"


def _against_fp32(fp32, rem, names, fp32_opt, what) -> bool:
    """The remainder run's snapshot against the fp32 run's: state bitwise; params bitwise but at ties, one ulp
    away from zero there. Returns whether some master on some rank is a tie (the runs part from the next step)."""
    _assert_same((fp32[0][:0], fp32[1], fp32[2]), (rem[0][:0], rem[1], rem[2]), what)
    ties, differing = _ties(fp32_opt), 0
    for name, p, q in zip(names, fp32[0], rem[0]):
        diff = p.view(torch.int16) != q.view(torch.int16)
        if diff.any():
            assert ties, f"{what}: {name} differs in {int(diff.sum())} elements and no master is a tie"
            assert torch.equal(q.view(torch.int16)[diff], p.view(torch.int16)[diff] + 1), f"{what}: {name}"
            differing += int(diff.sum())
    assert differing == ties, f"{what}: {differing} parameters differ, {ties} masters are ties"  # one each
    return ties > 0


def _side_by_side(rank, world, offloads, root, stages):
    """Per stage: the fp32-master run and one remainder run per offload, on the same data. The remainder runs agree
    bitwise with each other at every step; against the fp32 run up to the first tie. Returns [(stage, steps
    compared with the fp32 run)]."""
    out = []
    for stage in stages:
        runs = [_build(stage, None, root, rank, f"{stage}-fp32", False)]
        runs += [_build(stage, off, root, rank, f"{stage}-{off}", True) for off in offloads]
        names = [n for n, _ in runs[0][0].named_parameters()]
        compared, parted = 0, False
        for step in range(STEPS):
            for model, opt, schedule in runs:
                _train_step(model, opt, schedule, step, rank)
            snaps = [_snapshot(m, o) for m, o, _ in runs]
            what = f"stage {stage} world {world} step {step}"
            for off, snap in zip(offloads[1:], snaps[2:]):
                _assert_same(snaps[1], snap, f"{what}: remainders, offload {offloads[0]} vs {off}")
            if not parted:
                parted = _against_fp32(snaps[0], snaps[1], names, runs[0][1], what)
                compared += 1
        assert all(opt.skipped_steps == 1 for _, opt, _ in runs)
        for _, opt, _ in runs:
            opt.close()
        out.append((stage, compared))
    return out


def test_bitwise_the_fp32_master_two_ranks(tmp_path):
    results = run_on_ranks(2, _side_by_side, (None,), str(tmp_path), (1, 2, 3))
    assert results[0] == results[1]
    print("steps compared with the fp32 master (stage, steps):", results[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_bitwise_the_fp32_master_and_every_offload(tmp_path, world):
    results = run_on_ranks(world, _side_by_side, (None, "cpu", "nvme"), str(tmp_path), (1, 2, 3), timeout=400)
    print(f"world {world}: steps compared with the fp32 master (stage, steps):", results[0])
    assert not [f for _, _, files in os.walk(tmp_path) for f in files], "state files left behind after close()"


# ---------------------------------------------------------------- checkpoints and state dicts across the setting
def _save(rank, world, root, path, remainders, offload):
    model, opt, schedule = _build(2, offload, root, rank, f"save-{remainders}", remainders)
    for step in range(2):
        _train_step(model, opt, schedule, step, rank)
    checkpoint.save(path, opt)
    opt.close()


def _load_each(rank, world, root, paths, placements):
    """Load every checkpoint into an optimizer of each (remainders, offload, stage): all hold the same state."""
    snaps = []
    for path in paths:
        for remainders, offload, stage in placements:
            model, opt, _ = _build(stage, offload, root, rank, f"load-{remainders}-{offload}-{stage}", remainders,
                                   torch.float32 if stage == 1 else None)  # fmt: skip
            checkpoint.load(path, opt)
            snaps.append(_snapshot(model, opt))
            opt.close()
    for s in snaps[1:]:
        for x, y in zip(snaps[0][0] + snaps[0][1], s[0] + s[1]):
            assert torch.equal(x, y)
    return snaps[0][0]


@pytest.mark.slow
def test_checkpoints_cross_the_setting_and_world_sizes(tmp_path):
    root = str(tmp_path / "state")
    os.makedirs(root)
    paths = {}
    for remainders, offload in ((False, None), (True, None), (True, "nvme")):
        paths[remainders, offload] = str(tmp_path / f"ckpt-{remainders}-{offload}")
        run_on_ranks(2, _save, root, paths[remainders, offload], remainders, offload)
    files = {}
    for key, path in paths.items():
        checkpoint.consolidate(path, str(tmp_path / f"full-{key}"))
        files[key] = load_file(str(tmp_path / f"full-{key}" / "optimizer.safetensors"))
    for key in paths:  # the consolidated fp32 master and moments: the same bits whatever was kept
        assert files[key].keys() == files[False, None].keys()
        for name, value in files[False, None].items():
            assert value.dtype != torch.int16 and torch.equal(files[key][name], value), (key, name)
    placements = [(False, None, 2), (True, None, 2), (True, "cpu", 1), (True, "nvme", 3), (False, "nvme", 3)]
    for world in (1, 3):
        run_on_ranks(world, _load_each, root, list(paths.values()), placements)


def _state_dict_round_trip(rank, world):
    runs = [_build(3, None, None, rank, "sd", r) for r in (False, True)]
    for step in range(2):
        for model, opt, schedule in runs:
            _train_step(model, opt, schedule, step, rank)
    sds = [opt.state_dict() for _, opt, _ in runs]
    for key, entry in sds[0]["state"].items():
        assert entry.keys() == sds[1]["state"][key].keys() and "remainder" not in entry
        for name, value in entry.items():
            other = sds[1]["state"][key][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (key, name)
    # crossed: each optimizer loads the other's state dict, and holds what it held
    before = [_snapshot(m, o) for m, o, _ in runs]
    runs[0][1].load_state_dict(sds[1])
    runs[1][1].load_state_dict(sds[0])
    after = [_snapshot(m, o) for m, o, _ in runs]
    for b, a in zip(before, after):
        for x, y in zip(b[0] + b[1], a[0] + a[1]):
            assert torch.equal(x, y)
    for _, opt, _ in runs:
        opt.close()
    return True


def test_state_dicts_cross_the_setting():
    assert all(run_on_ranks(2, _state_dict_round_trip))


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_refused_for_other_dtypes(dtype):
    model = build(dtype)
    with pytest.raises(ValueError, match=rf"`param_remainders=True`.*bfloat16 parameters.*{dtype}"):
        ZeroAdamW(model.parameters(), param_remainders=True)


def test_refused_unless_bool():
    with pytest.raises(ValueError, match="`param_remainders` must be True or False"):
        ZeroAdamW(build(torch.bfloat16).parameters(), param_remainders=1)


# ---------------------------------------------------------------- memory, measured on what is alive
def _memory(rank, world, stage, offload, root):
    grown, reports = {}, {}
    for remainders in (False, True):
        model = build(torch.bfloat16)
        base = live_storage_bytes()
        opt = ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=BUCKET, param_remainders=remainders,
                        module=model if stage == 3 else None,
                        **offload_kwargs(offload, root, rank, f"mem-{remainders}", WINDOW))  # fmt: skip
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        grown[remainders], reports[remainders] = live_storage_bytes() - base, opt.memory_report()
        shard = sum(g.layout.shard_numel for g in opt.sharded_state.groups)
        opt.close()
        del opt
    r = reports[True]
    identity = r.formula + r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers - r.param_shard_not_kept
    assert r.total + sum(r.on_disk.values()) == identity, str(r)
    assert r.where["remainder"] == ("device" if offload is None else "host"), r.where
    assert r.widths["optimizer_state_bytes"] == 10 and r.allocated.get("master", 0) == 0, r.widths
    if offload != "nvme":
        assert r.allocated["remainder"] == 2 * shard, r.allocated
    disk = [sum(reports[x].on_disk.values()) for x in (False, True)]
    return grown[False] - grown[True], reports[False].total - reports[True].total, shard, disk, reports[False].on_disk


@pytest.mark.parametrize(
    "stage,offload,saved_per_element",
    [(1, None, 2), (2, None, 2), (3, None, 0), (3, "cpu", 2)],
    ids=["stage1", "stage2", "stage3", "stage3-cpu"],
)
def test_memory_saved(tmp_path, stage, offload, saved_per_element):
    """2 bytes per element of the shard where the fp32 master was stored apart (stages 1 and 2 in memory, the host
    memory of offload="cpu"), none at stage 3 in memory (the kept bf16 shard + the remainder are the 4 bytes of the
    master, which stage 3 otherwise casts at each gather instead of keeping a shard). Measured on the live storages
    (the garbage collector's tensors), and the ledger agrees."""
    live, ledger, shard, _, _ = run_on_ranks(2, _memory, stage, offload, str(tmp_path))[0]
    assert live == ledger == saved_per_element * shard, (live, ledger, shard)


def test_memory_nvme(tmp_path):
    """offload="nvme": the master's file is gone (the remainder is in host memory instead, 2 B per element, and
    the window's chunks hold one fp32 kind fewer); the live storages change as the ledger says."""
    live, ledger, shard, disk, fp32_files = run_on_ranks(2, _memory, 2, "nvme", str(tmp_path))[0]
    assert disk[0] - disk[1] == fp32_files["master"] > 0, (disk, fp32_files)
    assert live == ledger, (live, ledger)


# ---------------------------------------------------------------- the rule and the formulas
def test_rule_stores_a_remainder_and_saves_the_master():
    from zero_ext.memory import estimate
    from zero_ext.update_rule import MASTER, REMAINDER, AdamW

    rule = AdamW(torch.bfloat16, amsgrad=True, param_remainders=True)
    assert rule.kind_names == (REMAINDER, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert rule.kinds[0].dtype == torch.int16 and rule.bytes_per_element() == 14
    assert rule.saved_kind_names == (MASTER, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert rule.state_dict_names() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", MASTER)
    assert "param_remainders=True" in rule.describe()  # ranks must agree on it
    assert estimate(1000, 4, 2, param_remainders=True) == 1000 * 2 + 1000 * (2 + 10) / 4
    with pytest.raises(ValueError, match=r"`param_remainders=True`.*torch.float16"):
        AdamW(torch.float16, param_remainders=True)
