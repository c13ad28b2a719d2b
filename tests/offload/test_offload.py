"""offload="cpu" and offload="nvme": bitwise the in-memory optimizer (same kernel, same order) on 1, 2 and 3 gloo
ranks at stages 1, 2 and 3 with bf16 and fp32 params, through accumulation, param groups with a schedule, clipping,
skip-on-inf, a frozen parameter and a branch used on some steps; torch.optim.AdamW with averaged gradients;
checkpoints between offloaded and in-memory optimizers at other world sizes; the ledger; the state files' life
(created, deleted on close, collection and exit, refused on a full disk on every rank); bad options."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import (
    FusedReference,
    check_against_reference,
    full_params,
    offload_kwargs,
    rank_grads,
    reference,
    set_mean_grads,
    state_shards,
)
from safetensors.torch import load_file
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
STEPS = 5
WINDOW = 3 * 14 * 1024 * 2  # the smallest windows: chunks of 2048 elements, several per shard
HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # tests/helpers


def _offload_kw(offload, root, rank, tag):
    return offload_kwargs(offload, root, rank, tag, WINDOW)


def _build(stage, dtype, offload, root, rank, tag, accum=None):
    """The tiny GPT (tied head, a branch used on odd steps), one frozen LayerNorm, decay / no-decay groups."""
    model = build(dtype, unused_branch=True)
    model.blocks[0].ln1.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 1e-2},
    ]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=BUCKET, module=model, grad_accum_dtype=accum,
                    **_offload_kw(offload, root, rank, tag))  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, schedule


def _train_step(model, opt, schedule, step, rank):
    for micro in range(2):  # two micro-batches, the first without reduction (stage 1) / accumulated (2, 3)
        with opt.no_sync() if micro == 0 else torch.enable_grad():
            loss = loss_fn(model, batch(step, 10 * rank + micro), use_extra=step % 2 == 1)
            if step == 3 and rank == 0 and micro == 1:
                loss = loss * float("inf")  # a non-finite gradient: the step is skipped everywhere
            loss.backward()
    opt.clip_grad_norm_(0.5)
    opt.step()
    schedule.step()
    opt.zero_grad()


def _snapshot(model, opt):
    """Full parameters (gathered at stage 3), and this rank's state by kind, all on the host."""
    params = full_params(model, opt)
    state = state_shards(opt)
    counts = opt.sharded_state.step_counts
    return params, state, [s.clone() for s in counts.steps], opt.skipped_steps


def _assert_same(a, b, what):
    for name, x, y in zip(("params", "state"), a[:2], b[:2]):
        for i, (u, v) in enumerate(zip(x, y)):
            assert u.dtype == v.dtype and torch.equal(u, v), f"{what}: {name}[{i}] differs"
    assert all(torch.equal(u, v) for u, v in zip(a[2], b[2])) and a[3] == b[3], f"{what}: step counts differ"


def _same_as_in_memory(rank, world, offload, root):
    for dtype in (torch.bfloat16, torch.float32):
        for stage in (1, 2, 3):
            runs = [_build(stage, dtype, off, root, rank, f"{stage}-{dtype}") for off in (None, offload)]
            for step in range(STEPS):
                for model, opt, schedule in runs:
                    _train_step(model, opt, schedule, step, rank)
                _assert_same(*(_snapshot(m, o) for m, o, _ in runs), f"stage {stage} {dtype} step {step}")
            assert runs[1][1].skipped_steps == 1
            for _, opt, _ in runs:
                opt.close()
    return sorted(os.listdir(root)) if offload == "nvme" and rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_bitwise_the_in_memory_optimizer(tmp_path, world, offload):
    run_on_ranks(world, _same_as_in_memory, offload, str(tmp_path), timeout=300)
    assert not [f for _, _, files in os.walk(tmp_path) for f in files], "state files left behind after close()"


def _against_torch(rank, world, offload, root, dtype_name):
    """Stage 2 against torch.optim.AdamW fed the mean of the ranks' gradients, and bitwise against the unsharded
    fused kernel (the mean over gloo is exact)."""
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=BUCKET,
                    **_offload_kw(offload, root, rank, "torch"))  # fmt: skip
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    fused = FusedReference(build(dtype), **HYPER)
    for step in range(STEPS):
        per_rank = rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        means = set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        fused.step(means)
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
        fused.check(opt, model)
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("world", [1, 3])
def test_matches_torch_adamw(tmp_path, world, offload):
    run_on_ranks(world, _against_torch, offload, str(tmp_path), "bfloat16")


# ---------------------------------------------------------------- checkpoints across placements and world sizes
def _save(rank, world, offload, root, path, stage):
    model, opt, schedule = _build(stage, torch.bfloat16, offload, root, rank, "save")
    for step in range(3):
        _train_step(model, opt, schedule, step, rank)
    checkpoint.save(path, opt)
    opt.close()


def _load_and_continue(rank, world, root, path, placements):
    """Load ``path`` into one optimizer per (offload, stage); all must hold the same state, and train on
    identically (bitwise) from it (stage 1 accumulating in fp32, as stages 2 and 3 do)."""
    runs = []
    for offload, stage in placements:
        tag = f"load-{offload}-{stage}"
        model, opt, schedule = _build(
            stage, torch.bfloat16, offload, root, rank, tag, torch.float32 if stage == 1 else None
        )
        checkpoint.load(path, opt)
        schedule.last_epoch = 3  # the schedule is the trainer's: resume it as a trainer would
        runs.append((model, opt, schedule))
    snaps = [_snapshot(m, o) for m, o, _ in runs]
    for s in snaps[1:]:
        _assert_same(snaps[0], s, f"loaded at world {world}")
    for step in range(3, 5):
        for model, opt, schedule in runs:
            _train_step(model, opt, schedule, step, rank)
    snaps = [_snapshot(m, o) for m, o, _ in runs]
    for s in snaps[1:]:
        _assert_same(snaps[0], s, f"continued at world {world}")
    for _, opt, _ in runs:
        opt.close()
    return snaps[0][0]  # the parameters


@pytest.mark.slow
def test_checkpoints_between_offloaded_and_in_memory(tmp_path):
    root = str(tmp_path / "state")
    os.makedirs(root)
    saved = {}
    for offload in (None, "cpu", "nvme"):  # the same training, saved from each placement at 2 ranks, stage 2
        saved[offload] = str(tmp_path / f"ckpt-{offload}")
        run_on_ranks(2, _save, offload, root, saved[offload], 2)
    for offload, path in saved.items():
        checkpoint.consolidate(path, str(tmp_path / f"full-{offload}"))
    files = {off: load_file(str(tmp_path / f"full-{off}" / "optimizer.safetensors")) for off in saved}
    for off in ("cpu", "nvme"):
        assert files[off].keys() == files[None].keys()
        for key, value in files[None].items():
            assert torch.equal(files[off][key], value), f"the checkpoint saved with offload={off!r} differs at {key}"
    # Saved with nvme at 2 ranks: load at 1 and 3 ranks into in-memory, cpu and nvme optimizers, stages crossed.
    # (Stage 1 reduces the sum of the micro-batches, stages 2 and 3 sum the micro-batches' means: bitwise equal
    # continuations within each.)
    for world in (1, 3):
        run_on_ranks(world, _load_and_continue, root, saved["nvme"], [(None, 1), ("cpu", 1), ("nvme", 1)])
    finals = run_on_ranks(3, _load_and_continue, root, saved["nvme"], [(None, 2), ("cpu", 2), ("nvme", 2), ("nvme", 3)])
    # Saved in memory, loaded with offload: the same continuation as the nvme-saved one.
    again = run_on_ranks(3, _load_and_continue, root, saved[None], [("nvme", 3), (None, 3)])
    assert all(torch.equal(a, b) for a, b in zip(again[0], finals[0]))
    assert not [f for _, _, fs in os.walk(root) for f in fs]


def _copy_params(src, dst):
    """dst's model := src's parameters (gathered and written back at stage 3)."""
    with src[1].gathered_params():
        values = [p.detach().clone() for p in src[0].parameters()]
    with dst[1].gathered_params(modifier_rank=0), torch.no_grad():
        for p, v in zip(dst[0].parameters(), values):
            p.copy_(v)


def _state_dicts_across_placements(rank, world, root, stage):
    """The model's and the optimizer's state dicts saved from one placement load into every other: the state
    dicts are equal, and the continuations bitwise equal."""
    placements = (None, "cpu", "nvme")
    for dtype in (torch.float32, torch.bfloat16):
        sources = {off: _build(stage, dtype, off, root, rank, f"sd-src-{off}-{dtype}") for off in placements}
        for step in range(2):
            for run in sources.values():
                _train_step(*run, step, rank)
        saved = {off: copy.deepcopy(run[1].state_dict()) for off, run in sources.items()}
        for off, sd in saved.items():
            assert sd["state"].keys() == saved[None]["state"].keys()
            for index, entry in saved[None]["state"].items():
                assert entry.keys() == sd["state"][index].keys(), f"{dtype} offload={off!r}: the entries differ"
                for key, value in entry.items():
                    other = sd["state"][index][key]
                    same = torch.equal(value, other) if torch.is_tensor(value) else value == other
                    assert same, f"{dtype} offload={off!r}: state[{index}][{key!r}] differs"
        for src in placements:
            for dst in placements:
                run = _build(stage, dtype, dst, root, rank, f"sd-dst-{src}-{dst}-{dtype}")
                _copy_params(sources[src], run)
                run[1].load_state_dict(saved[src])
                run[2].load_state_dict(sources[src][2].state_dict())
                _train_step(*run, 2, rank)
                got = _snapshot(*run[:2])
                run[1].close()
                if (src, dst) == (None, None):
                    expected = got
                else:
                    _assert_same(got, expected, f"stage {stage} {dtype}: saved with offload={src!r}, loaded with "
                                 f"offload={dst!r}")  # fmt: skip
        if dtype == torch.float32:
            # An fp32 state dict with a master (offloaded optimizers' before fp32 masters were left to the model):
            # loaded, and the parameters follow it, with no model state dict loaded.
            legacy = copy.deepcopy(saved[None])
            src = sources[None]
            with src[1].gathered_params():
                flat = [p.detach().reshape(-1).clone() for g in src[1].param_groups for p in g["params"]]
            for index, entry in legacy["state"].items():
                ranges = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]  # split params
                entry["master"] = torch.cat([flat[index][slice(*r)] for r in ranges]).clone()
            for dst in placements:
                run = _build(stage, dtype, dst, root, rank, f"sd-legacy-{dst}")
                run[1].load_state_dict(legacy)
                run[2].load_state_dict(src[2].state_dict())
                _train_step(*run, 2, rank)
                got = _snapshot(*run[:2])
                run[1].close()
                _assert_same(got, expected, f"stage {stage}: an fp32 master loaded with offload={dst!r}")
        for run in sources.values():
            run[1].close()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dicts_load_across_placements(tmp_path, stage):
    run_on_ranks(2, _state_dicts_across_placements, str(tmp_path), stage)


def _steps_by_param(opt, rank) -> torch.Tensor:
    """The step counts of the parameters this rank owns a piece of (the only ones its updates and its state dict
    use; another rank's parameter keeps whatever count this rank last had for it)."""
    counts, owned = opt.sharded_state.step_counts, set()
    for g in opt.sharded_state.groups:
        owned |= {g.param_indices[piece.index] for piece in g.layout.owned_pieces(rank) if piece.numel}
    return torch.stack([counts.step_of(i) for i in counts.indices if i in owned]).cpu()


def _load_into_a_stepped_optimizer(rank, world, root):
    """An nvme optimizer that has stepped has the next step's first chunks read ahead; loading another run's state
    into it (and its parameters, through gathered_params) must make the next step use the loaded state."""
    for stage in (1, 2, 3):
        a = _build(stage, torch.bfloat16, "nvme", root, rank, f"ahead-a-{stage}")
        b = _build(stage, torch.bfloat16, "nvme", root, rank, f"ahead-b-{stage}")
        for step in range(2):
            _train_step(*a, step, rank)
            _train_step(*b, step + 5, rank)  # other batches: another state
        _copy_params(b, a)
        a[1].load_state_dict(b[1].state_dict())
        a[2].load_state_dict(b[2].state_dict())
        for step in (2, 3):
            for run in (a, b):
                _train_step(*run, step, rank)
        got, expected = _snapshot(*a[:2]), _snapshot(*b[:2])
        # Step counts by owned parameter (the counters' slots beyond those in use keep old values: not compared).
        got[2][:], expected[2][:] = [_steps_by_param(a[1], rank)], [_steps_by_param(b[1], rank)]
        _assert_same(got, expected, f"stage {stage}: loaded into a stepped optimizer")
        for run in (a, b):
            run[1].close()
    return True


@pytest.mark.slow
def test_state_loaded_after_a_step_replaces_what_was_read_ahead(tmp_path):
    assert all(run_on_ranks(2, _load_into_a_stepped_optimizer, str(tmp_path)))


# ---------------------------------------------------------------- the ledger
def _ledger(rank, world, offload, root, stage):
    model, opt, schedule = _build(stage, torch.bfloat16, offload, root, rank, f"ledger-{stage}")
    _train_step(model, opt, schedule, 0, rank)
    report = opt.memory_report()
    disk = sum(report.on_disk.values())
    assert report.total + disk == (
        report.formula + report.padding + report.staging + report.grad_shard_fp32 + report.offload_buffers
    ), str(report)
    assert report.param_shard_not_kept == 0  # offloaded: the master is not on the device, the shard is kept
    shard = sum(g.layout.shard_numel for g in opt.sharded_state.groups)
    if offload == "nvme":
        assert {report.where[k] for k in ("master", "exp_avg", "exp_avg_sq")} == {"disk"}
        assert disk >= 12 * shard and disk - 12 * shard < 3 * 4096 * len(opt.sharded_state.groups)
        assert "master" not in report.allocated or report.allocated["master"] == 0
        assert report.offload_buffers <= WINDOW + 6 * 4 * 4 * BUCKET  # window, landing ring (4 slots), twins
    else:
        assert {report.where[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad_shard")} == {"host"}
        assert disk == 0
    assert report.where["grad_shard"] == "host"
    assert report.bytes_on("disk") == disk
    assert report.bytes_on("host") + report.bytes_on("device") == report.total
    text = str(report)
    assert "(disk)" in text if offload == "nvme" else "(host)" in text
    assert "offload buffers" in text
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_memory_report_says_where_every_byte_lives(tmp_path, world, offload):
    for stage in (1, 2, 3):
        run_on_ranks(world, _ledger, offload, str(tmp_path), stage)


# ---------------------------------------------------------------- the state files' life
def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_state_files_live_as_long_as_the_optimizer(tmp_path):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), stage=2, offload="nvme", offload_dir=str(tmp_path))
    files = _files(tmp_path)
    assert len(files) == 3 and all(f.endswith((".master.f32", ".exp_avg.f32", ".exp_avg_sq.f32")) for f in files)
    opt.close()
    opt.close()  # twice: nothing more to do
    assert _files(tmp_path) == [] and os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "exception"])
def test_state_files_removed_at_exit_without_close(tmp_path, ending):
    """A script that never calls close(), ending normally or with an uncaught exception: the interpreter's exit
    removes the files (only a process killed outright, e.g. SIGKILL, leaves them)."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {HELPERS!r})
        from tiny_transformer import batch, build, loss_fn
        from zero_ext import ZeroAdamW
        model = build(torch.bfloat16)
        opt = ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir={str(tmp_path)!r})
        loss_fn(model, batch(0, 0)).backward()
        opt.step()
        assert sum(len(f) for _, _, f in os.walk({str(tmp_path)!r})) == 3
        if {ending!r} == "exception":
            raise RuntimeError("the training loop crashed")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == (0 if ending == "return" else 1), out.stderr
    assert _files(tmp_path) == [] and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_state_files_of_a_killed_process_are_reported_by_the_next_optimizer(tmp_path):
    """A process killed outright (SIGKILL) cannot delete its state files: the next optimizer with the same
    offload_dir on this host warns about them, with their size, and deletes nothing."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {HELPERS!r})
        from tiny_transformer import build
        from zero_ext import ZeroAdamW
        opt = ZeroAdamW(build(torch.bfloat16).named_parameters(), offload="nvme", offload_dir={str(tmp_path)!r})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    (left,) = os.listdir(tmp_path)
    assert len(_files(tmp_path)) == 3
    model = build(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"GiB of optimizer state files left by process\(es\) \[\d+\] of this host"):
        opt = ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir=str(tmp_path))
    assert len(_files(tmp_path)) == 6, "nothing is deleted: the files are the user's"
    opt.close()
    shutil.rmtree(tmp_path / left)
    with warnings.catch_warnings():
        # a live optimizer's directory is not reported, nor is a clean directory (the report alone is an error here:
        # other warnings, e.g. the intra-op threads one under pytest-xdist's one thread per worker, are not this test's)
        warnings.filterwarnings("error", message=r".*optimizer state files left by")
        other = ZeroAdamW(build(torch.bfloat16).named_parameters(), offload="nvme", offload_dir=str(tmp_path))
        again = ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir=str(tmp_path))
    other.close()
    again.close()
    assert os.listdir(tmp_path) == []


def _full_disk(rank, world, root, failing_rank):
    from zero_ext.placement import offload as offload_module

    model = build(torch.bfloat16)
    before = [p.data_ptr() for p in model.parameters()]
    real = offload_module.shutil.disk_usage
    if rank == failing_rank:
        offload_module.shutil.disk_usage = lambda path: real(path)._replace(free=1000)
    try:
        with pytest.raises(ValueError) as info:
            ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir=root)
    finally:
        offload_module.shutil.disk_usage = real
    assert [p.data_ptr() for p in model.parameters()] == before, "a refused construction left the model re-pointed"
    return str(info.value)


def test_a_full_disk_is_refused_on_every_rank_before_anything_is_built(tmp_path):
    errors = run_on_ranks(2, _full_disk, str(tmp_path), 1)
    assert "offload='nvme' failed on rank(s) [1]" in errors[0], errors[0]
    assert "needs" in errors[1] and "GiB free" in errors[1] and "12 bytes per parameter" in errors[1], errors[1]
    assert _files(tmp_path) == [] and os.listdir(tmp_path) == []


def _offload_dir(rank, world, root):
    model = build(torch.bfloat16)
    before = [p.data_ptr() for p in model.parameters()]
    try:
        opt = ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir=root)
    except ValueError as e:
        assert [p.data_ptr() for p in model.parameters()] == before, "a refused construction re-pointed the model"
        return str(e)
    made = os.path.isdir(root)
    opt.close()
    return made


def test_a_missing_offload_dir_is_created_and_a_file_in_the_way_fails_every_rank(tmp_path):
    """offload_dir is created with its parents on every rank (they race to create it: no rank may fail for it);
    a path that is a file fails every rank, naming it."""
    missing = tmp_path / "not" / "yet"
    assert run_on_ranks(2, _offload_dir, str(missing)) == [True, True]
    assert os.listdir(missing) == []  # the ranks' own directories went with close()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    for error in run_on_ranks(2, _offload_dir, str(blocked / "sub")):
        assert "cannot use `offload_dir`" in error and str(blocked) in error, error


def test_bad_options_name_the_option(tmp_path):
    model = build(torch.bfloat16)
    named = list(model.named_parameters())
    cases = [
        (dict(offload="gpu"), "`offload` must be None, 'cpu' or 'nvme'"),
        (dict(offload=True), "`offload` must be None, 'cpu' or 'nvme'"),
        (dict(offload="nvme"), "offload='nvme' needs `offload_dir`"),
        (dict(offload_dir=str(tmp_path)), "`offload_dir` is for offload='nvme'"),
        (dict(offload="cpu", offload_window=2**26), "`offload_window` is for offload='nvme'"),
        (dict(offload="nvme", offload_dir=str(tmp_path), offload_window=10), "`offload_window` must be an int >="),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as info:
            ZeroAdamW(named, **kwargs)
        assert needle in str(info.value), (kwargs, str(info.value))
    assert os.listdir(tmp_path) == []


def test_offload_warns_when_the_cpu_update_gets_one_thread(monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.warns(UserWarning, match="OMP_NUM_THREADS"):
            ZeroAdamW(build(torch.bfloat16).named_parameters(), offload="cpu")
    finally:
        torch.set_num_threads(threads)


def _no_thread_warning_when_ranks_take_the_cores(rank, world):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the ranks already use every core: nothing to advise
            ZeroAdamW(build(torch.bfloat16).named_parameters(), offload="cpu").close()
    finally:
        torch.set_num_threads(threads)
    return True


def test_no_thread_warning_when_the_ranks_already_use_every_core(monkeypatch):
    """Launched without torchrun (no LOCAL_WORLD_SIZE), ranks sharing the host's cores get no advice to take more."""
    world = len(os.sched_getaffinity(0))
    if world > 3:
        pytest.skip("the gloo pool runs at most 3 ranks")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert all(run_on_ranks(world, _no_thread_warning_when_ranks_take_the_cores))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_dropped_optimizer_lets_go_of_its_state_files_and_the_model(tmp_path, stage):
    """`del opt` without close() while the model lives on (a notebook cell re-run, a sweep): the model's hooks held
    the optimizer weakly, so it is collected, its state files are deleted, and the model's backward is torch's."""
    import gc
    import weakref

    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), stage=stage, offload="nvme", offload_dir=str(tmp_path))
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    opt.zero_grad()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None, "something still holds the optimizer"
    assert _files(tmp_path) == [] and os.listdir(tmp_path) == []
    loss_fn(model, batch(1, 0)).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _spawned_child_without_close(rank, directory):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), offload="nvme", offload_dir=directory)
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    assert _files(directory), "no state files while training"
    _keep_alive.append(opt)  # alive until the process exits, which multiprocessing does through os._exit


_keep_alive = []


@pytest.mark.slow
def test_state_files_removed_when_a_spawned_process_exits_without_close(tmp_path):
    """torch.multiprocessing.spawn children end with os._exit (no atexit): the files go anyway."""
    import torch.multiprocessing as mp

    mp.spawn(_spawned_child_without_close, args=(str(tmp_path),), nprocs=1, join=True)
    assert _files(tmp_path) == [] and os.listdir(tmp_path) == []
