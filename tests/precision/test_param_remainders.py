"""``ZeroAdamW(param_remainders=True)``: the fp32 master kept as the bf16 parameter (rounded to nearest even), an
int16 remainder and a tie bit in the sign bit of exp_avg_sq (zero_ext.update.master_split).

Against the default fp32 master, run side by side on the same data at stages 1, 2 and 3, on 1, 2 and 3 gloo ranks,
with offload None, "cpu" and "nvme", through accumulation, two param groups (one amsgrad) with a schedule,
clipping, skip-on-inf, a frozen parameter and a branch used on odd steps: after every step the parameters, the
master (joined) and the moments are bitwise the fp32 run's, and a skipped step changes no stored byte (remainder
and tie bits included). Ties (a master whose low 16 bits are 0x8000: no 16-bit remainder of a round-to-nearest-even
parameter can tell the two roundings apart without the tie bit) are rare in training (about one element in 2^16 per
step), so a second test makes half the masters ties through a state dict, steps at lr 0 (the masters stay ties
through the kernel), skips, steps on, and checkpoints the tie state across the setting and world sizes.

Also: checkpoints and state dicts between the two settings at other world sizes, consolidation (the fp32 master),
refusals (fp16/fp32 parameters, a non-bool), and the memory saved, measured on the live storages."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from engine_reference import LiveStorages, full_params, offload_kwargs, state_shards
from safetensors.torch import load_file
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.layout import Range
from zero_ext.update import master_split
from zero_ext.update.adamw import AdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
STEPS = 4
WINDOW = 3 * 14 * 1024 * 2  # small nvme windows: several chunks per shard


def _build(stage, offload, root, rank, tag, remainders, accum=None, **options):
    model = build(torch.bfloat16, unused_branch=True)
    model.blocks[0].ln1.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-2, "amsgrad": True},
    ]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=BUCKET, module=model, grad_accum_dtype=accum,
                    param_remainders=remainders, **offload_kwargs(offload, root, rank, tag, WINDOW),
                    **options)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, schedule


def _backward(model, opt, step, rank, skip=False):
    for micro in range(2):
        with opt.no_sync() if micro == 0 else torch.enable_grad():
            loss = loss_fn(model, batch(step, 10 * rank + micro), use_extra=step % 2 == 1)
            if skip and rank == 0 and micro == 1:
                loss = loss * float("inf")  # skipped on every rank: no byte of either state may change
            loss.backward()


def _train_step(model, opt, schedule, step, rank):
    _backward(model, opt, step, rank, skip=step == 2)
    opt.clip_grad_norm_(0.5)
    opt.step()
    schedule.step()
    opt.zero_grad()


def _snapshot(model, opt):
    """Full parameters (gathered at stage 3) and this rank's saved state (fp32 master, moments), on the host."""
    params = full_params(model, opt)
    return params, state_shards(opt), opt.skipped_steps


def _stored(model, opt) -> list[torch.Tensor]:
    """Every byte the optimizer keeps for the model: the parameters (with remainders the masters' high halves) and
    this rank's shard of each stored kind as kept (the remainder, the moments with exp_avg_sq's tie bits)."""
    params = full_params(model, opt)
    kinds = [g.state.stored(k, Range(0, g.layout.shard_numel)).cpu().clone() for g in opt.sharded_state.groups
             for k in g.rule.kind_names]  # fmt: skip
    return [_bytes(t) for t in params + kinds]


def _tie_counts(opt) -> tuple[int, int]:
    """Masters on every rank that are ties (low 16 bits 0x8000), (rounded down by RNE: even truncation, rounded up)."""
    masters = [g.state.read("master", Range(0, g.layout.shard_numel)) for g in opt.sharded_state.groups]
    bits = [m.view(torch.int32) for m in masters]
    down = sum(int(((b & 0x1FFFF) == 0x8000).sum()) for b in bits)
    up = sum(int(((b & 0x1FFFF) == 0x18000).sum()) for b in bits)
    count = torch.tensor([down, up])
    dist.all_reduce(count)
    return int(count[0]), int(count[1])


def _tie_bits(opt) -> int:
    """exp_avg_sq's stored sign bits on every rank (param_remainders: the ties that RNE rounded down)."""
    count = torch.tensor([0])
    for g in opt.sharded_state.groups:
        count += int(master_split.tie_of(g.state.stored("exp_avg_sq", Range(0, g.layout.shard_numel))).sum())
    dist.all_reduce(count)
    return int(count)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_same(a, b, what) -> None:
    assert a[2] == b[2], f"{what}: skipped steps differ"
    for name, x, y in zip(("param", "state"), (a[0], a[1]), (b[0], b[1])):
        for i, (u, v) in enumerate(zip(x, y)):
            assert u.dtype == v.dtype and torch.equal(_bytes(u), _bytes(v)), (
                f"{what}: {name} {i} differs in {int((_bytes(u) != _bytes(v)).sum())} bytes"
            )


def _assert_unchanged(before, after, what) -> None:
    for i, (u, v) in enumerate(zip(before, after)):
        assert torch.equal(u, v), f"{what}: stored tensor {i} changed in {int((u != v).sum())} bytes"


def _side_by_side(rank, world, offloads, root, stages):
    """Per stage: the fp32-master run and one remainder run per offload, on the same data: bitwise the same
    parameters and saved state after every step; the skipped step (step 2) changes no stored byte of any run.
    Returns [(stage, ties seen in the fp32 run's masters)]."""
    out = []
    for stage in stages:
        runs = [_build(stage, None, root, rank, f"{stage}-fp32", False)]
        runs += [_build(stage, off, root, rank, f"{stage}-{off}", True) for off in offloads]
        ties = 0
        for step in range(STEPS):
            before = [_stored(m, o) for m, o, _ in runs] if step == 2 else None
            for model, opt, schedule in runs:
                _train_step(model, opt, schedule, step, rank)
            if before is not None:
                for b, (m, o, _) in zip(before, runs):
                    _assert_unchanged(b, _stored(m, o), f"stage {stage} world {world}: the skipped step")
            snaps = [_snapshot(m, o) for m, o, _ in runs]
            for off, snap in zip(offloads, snaps[1:]):
                _assert_same(snaps[0], snap, f"stage {stage} world {world} step {step}: fp32 vs remainders {off}")
            ties += sum(_tie_counts(runs[0][1]))
        assert all(opt.skipped_steps == 1 for _, opt, _ in runs)
        for _, opt, _ in runs:
            opt.close()
        out.append((stage, ties))
    return out


def test_bitwise_the_fp32_master_two_ranks(tmp_path):
    results = run_on_ranks(2, _side_by_side, (None,), str(tmp_path), (1, 2, 3))
    assert results[0] == results[1]
    print("ties met in training (stage, masters):", results[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_bitwise_the_fp32_master_and_every_offload(tmp_path, world):
    results = run_on_ranks(world, _side_by_side, (None, "cpu", "nvme"), str(tmp_path), (1, 2, 3), timeout=400)
    print(f"world {world}: ties met in training (stage, masters):", results[0])
    assert not [f for _, _, files in os.walk(tmp_path) for f in files], "state files left behind after close()"


# ---------------------------------------------------------------- ties, made on purpose
TIE_EVERY = 3  # masters made ties: two elements in three (both roundings of a tie occur: even and odd truncations)


def _make_ties(sd) -> int:
    """``sd`` (a local state dict) with two masters in three made ties: low 16 bits := 0x8000 (the value halfway
    between its truncation and the next bf16 value). Returns how many."""
    made = 0
    for entry in sd["state"].values():
        bits = entry["master"].clone().view(torch.int32)
        pick = torch.arange(bits.numel()).reshape(bits.shape) % TIE_EVERY != TIE_EVERY - 1
        bits[pick] = (bits[pick] & ~0xFFFF) | 0x8000
        entry["master"] = bits.view(torch.float32)
        made += int(pick.sum())
    return made


def _set_lr(runs, scale: float) -> None:
    for _, opt, _ in runs:
        for group, lr in zip(opt.param_groups, (HYPER["lr"], 1e-2)):
            group["lr"] = lr * scale


def _compare(runs, rank, what) -> None:
    snaps = [_snapshot(m, o) for m, o, _ in runs]
    for i, snap in enumerate(snaps[1:], 1):
        _assert_same(snaps[0], snap, f"{what}: run 0 vs run {i}")


def _ties_side_by_side(rank, world, offloads, root, stages, ckpt_root, options):
    """Per stage: the fp32-master run and one remainder run per offload (``max_grad_norm``) load one state dict
    whose masters are two thirds ties; each is bitwise the fp32 run's after the load, after a step at lr 0 (the
    masters stay ties through the kernel), after a skipped step (no stored byte changes) and after steps at the
    usual lr. The tie state is saved as a checkpoint from every run (loaded at other world sizes by the caller).
    Returns [(stage, ties rounded down, ties rounded up)] seen after the load."""
    out = []
    for stage in stages:
        runs = [_build(stage, None, root, rank, f"t{stage}-fp32", False, max_grad_norm=0.5, **options)]
        runs += [_build(stage, off, root, rank, f"t{stage}-{off}", True, max_grad_norm=0.5, **options)
                 for off in offloads]  # fmt: skip
        what = f"stage {stage} world {world}"
        for model, opt, _ in runs:  # moments to carry: one step
            _backward(model, opt, 0, rank)
            opt.step()
            opt.zero_grad()
        sd = runs[0][1].state_dict()
        made = torch.tensor([_make_ties(sd)])
        dist.all_reduce(made)
        for _, opt, _ in runs:
            opt.load_state_dict(sd)
        _compare(runs, rank, f"{what}: the tie state loaded")
        down, up = _tie_counts(runs[0][1])
        assert down > 0 and up > 0 and down + up >= int(made), (down, up, int(made))  # (and natural ties)
        for _, opt, _ in runs[1:]:  # the tie bit of a master RNE rounded down: exp_avg_sq's sign
            assert _tie_bits(opt) == down, (what, _tie_bits(opt), down)
        _set_lr(runs, 0.0)  # the masters do not move: ties through the kernel
        for model, opt, _ in runs:
            _backward(model, opt, 1, rank)
            opt.step()
            opt.zero_grad()
        _compare(runs, rank, f"{what}: a step at lr 0")
        assert _tie_counts(runs[0][1]) == (down, up)
        for i, (_, opt, _) in enumerate(runs):
            checkpoint.save(os.path.join(ckpt_root, f"stage{stage}-run{i}"), opt)
        before = [_stored(m, o) for m, o, _ in runs]
        for model, opt, _ in runs:
            _backward(model, opt, 2, rank, skip=True)
            opt.step()
            opt.zero_grad()
        for b, (m, o, _) in zip(before, runs):
            _assert_unchanged(b, _stored(m, o), f"{what}: the skipped step")
        _set_lr(runs, 1.0)
        for step in (3, 4):
            for model, opt, _ in runs:
                _backward(model, opt, step, rank)
                opt.step()
                opt.zero_grad()
            _compare(runs, rank, f"{what}: step {step} after the ties")
        for _, opt, _ in runs:
            opt.close()
        out.append((stage, down, up))
    return out


def _load_tie_checkpoints(rank, world, root, ckpt_root, offloads, stages, options):
    """Every tie checkpoint into the fp32-master run and a remainder run, at this world size: both hold the saved
    state bitwise, ties included. The remainder run's offload turns with the checkpoint and the world size, as the
    stage loaded into does (issue 47: every placement loads checkpoints of several stages and runs, not every
    checkpoint loads into every placement)."""
    for saved_stage in stages:
        for i in range(1 + len(offloads)):
            path = os.path.join(ckpt_root, f"stage{saved_stage}-run{i}")
            stage = stages[(saved_stage + i) % len(stages)]  # another stage than saved, where there is one
            off = offloads[(saved_stage + i + world) % len(offloads)]
            runs = [_build(stage, None, root, rank, f"l{saved_stage}{i}-fp32", False, **options)]
            runs += [_build(stage, off, root, rank, f"l{saved_stage}{i}-{off}", True, **options)]
            for _, opt, _ in runs:
                checkpoint.load(path, opt)
            _compare(runs, rank, f"{path} loaded at world {world} stage {stage}")
            down, up = _tie_counts(runs[0][1])
            assert down > 0 and up > 0, (path, down, up)
            for _, opt, _ in runs[1:]:
                assert _tie_bits(opt) == down
            for model, opt, _ in runs:
                _backward(model, opt, 5, rank)
                opt.step()
                opt.zero_grad()
            _compare(runs, rank, f"{path} loaded at world {world} stage {stage}, one step")
            for _, opt, _ in runs:
                opt.close()
    return True


def _ties(tmp_path, world, load_worlds, offloads, stages, **options):
    root, ckpt_root = str(tmp_path / "state"), str(tmp_path / "ckpt")
    os.makedirs(root)
    results = run_on_ranks(world, _ties_side_by_side, offloads, root, stages, ckpt_root, options, timeout=400)
    print(f"world {world}: ties after the load (stage, rounded down, rounded up):", results[0])
    for stage in stages:  # the checkpoints' contents: the same fp32 masters and moments from every run
        full = []
        for i in range(1 + len(offloads)):
            out = str(tmp_path / f"full-{stage}-{i}")
            checkpoint.consolidate(os.path.join(ckpt_root, f"stage{stage}-run{i}"), out)
            full.append(load_file(os.path.join(out, "optimizer.safetensors")))
        for i, other in enumerate(full[1:], 1):
            assert other.keys() == full[0].keys(), (stage, i)
            for name, value in full[0].items():
                assert torch.equal(_bytes(other[name]), _bytes(value)), (stage, i, name)
    for w in load_worlds:
        assert all(run_on_ranks(w, _load_tie_checkpoints, root, ckpt_root, offloads, stages, options, timeout=400))


def test_ties_bitwise_the_fp32_master_two_ranks(tmp_path):
    _ties(tmp_path, 2, (3,), (None, "nvme"), (1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ties_bitwise_every_stage_offload_and_world(tmp_path, world):
    _ties(tmp_path, world, [w for w in (1, 2, 3) if w != world], (None, "cpu", "nvme"), (1, 2, 3))


@pytest.mark.skipif(not hasattr(AdamW(torch.bfloat16), "moment_dtype"), reason="moment_dtype is not in this build")
def test_ties_with_bf16_moments(tmp_path):
    """The tie bit in bit 15 of a bf16 exp_avg_sq (moment_dtype=torch.bfloat16 on both sides): the same checks."""
    _ties(tmp_path, 2, (3,), (None, "cpu", "nvme"), (1, 3), moment_dtype=torch.bfloat16)


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
        before = LiveStorages()
        opt = ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=BUCKET, param_remainders=remainders,
                        module=model if stage == 3 else None,
                        **offload_kwargs(offload, root, rank, f"mem-{remainders}", WINDOW))  # fmt: skip
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        grown[remainders], reports[remainders] = before.born_bytes(), opt.memory_report()
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
    from zero_ext.update.adamw import MASTER, REMAINDER, AdamW

    rule = AdamW(torch.bfloat16, amsgrad=True, param_remainders=True)
    assert rule.kind_names == (REMAINDER, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert rule.kinds[0].dtype == torch.int16 and rule.bytes_per_element() == 14
    assert rule.saved_kind_names == (MASTER, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert rule.state_dict_names() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", MASTER)
    assert "param_remainders=True" in rule.describe()  # ranks must agree on it
    assert estimate(1000, 4, 2, param_remainders=True) == 1000 * 2 + 1000 * (2 + 10) / 4
    with pytest.raises(ValueError, match=r"`param_remainders=True`.*torch.float16"):
        AdamW(torch.float16, param_remainders=True)
