"""zero_ext.checkpoint: save at 2 gloo ranks, load at 1, 2 and 3 ranks and either stage, consolidate offline,
survive interrupted saves, reject damaged checkpoints with errors naming the file or parameter, and stay
within one shard plus one bucket of extra memory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

import pytest
import torch
import torch.nn as nn
from distributed import run_on_ranks
from safetensors.torch import load_file

import zero_ext
from zero_ext import checkpoint
from zero_ext.checkpoint import CheckpointError
from zero_ext.checkpoint import saving as save_module

GLOBAL_BATCH, IN, HID, OUT = 6, 13, 37, 7
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
SAVE_AT, CONTINUE = 3, 5


class Net(nn.Module):
    def __init__(self, dtype, hidden=HID, layers=2):
        super().__init__()
        self.inp = nn.Linear(IN, hidden)
        self.mid = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, OUT)
        self.to(dtype)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for m in self.mid:
            x = x + torch.tanh(m(x))
        return self.out(self.norm(x))


def _build(dtype_name, stage, seed=0, lr=HYPER["lr"], hidden=HID, bucket_size=1500):
    torch.manual_seed(seed)
    model = Net(getattr(torch, dtype_name), hidden)
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    hyper = dict(HYPER, lr=lr)
    module = model if stage == 3 else None  # stage 3 needs the model for its hooks
    return model, zero_ext.ZeroAdamW(groups, **hyper, stage=stage, bucket_size=bucket_size, module=module)


def _step(model, opt, step, rank, world):
    """One step on the global batch of ``step``: samples depend only on their global index; rank r takes an
    equal contiguous share, loss = mean over its samples, so the ranks' mean grad is the global-batch grad."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    share = GLOBAL_BATCH // world
    dtype = next(model.parameters()).dtype
    xs, ys = x[rank * share : (rank + 1) * share].to(dtype), y[rank * share : (rank + 1) * share]
    loss = ((model(xs).float() - ys) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(opt, rank):
    """This rank's owned pieces by name: {name: [(start, end, master, exp_avg, exp_avg_sq)]} (copies)."""
    out = {}
    for ref in opt.sharded_state.pieces():
        kinds = [
            ref.group.state.read(k, ref.piece.shard_range).float().clone() for k in ("master", "exp_avg", "exp_avg_sq")
        ]
        out.setdefault(ref.name, []).append((ref.piece.start, ref.piece.end, *kinds))
    return out


def _gather(per_rank, model_params):
    """Assemble every rank's pieces into full fp32 tensors {name: (master, exp_avg, exp_avg_sq)} by hand."""
    full = {n: [torch.full((p.numel(),), float("nan")) for _ in range(3)] for n, p in model_params.items()}
    for state in per_rank:
        for name, pieces in state.items():
            for start, end, *values in pieces:
                for dst, v in zip(full[name], values):
                    dst[start:end] = v
    for name, ts in full.items():
        assert not any(t.isnan().any() for t in ts), f"{name}: elements owned by no rank"
    return {n: tuple(t.view(model_params[n].shape) for t in ts) for n, ts in full.items()}


def _params(model, opt=None):
    """Full copies of the parameters (stage 3 shards them: read inside gathered_params)."""
    with opt.gathered_params() if opt is not None else contextlib.nullcontext():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_and_continue(rank, world, dtype, stage, path):
    model, opt = _build(dtype, stage)
    for s in range(SAVE_AT):
        _step(model, opt, s, rank, world)
    checkpoint.save(path, opt)
    saved = (_params(model, opt), _state(opt, rank), opt.step_count)
    for s in range(SAVE_AT, SAVE_AT + CONTINUE):
        _step(model, opt, s, rank, world)
    return saved, (_params(model, opt), _state(opt, rank))


def _load_and_continue(rank, world, dtype, stage, path):
    model, opt = _build(dtype, stage, seed=1, lr=1.0)  # other weights and lr: load must overwrite them
    checkpoint.load(path, opt)
    loaded = (
        _params(model, opt),
        _state(opt, rank),
        opt.step_count,
        [(g["lr"], g["weight_decay"]) for g in opt.param_groups],
    )
    for s in range(SAVE_AT, SAVE_AT + CONTINUE):
        _step(model, opt, s, rank, world)
    return loaded, (_params(model, opt), _state(opt, rank))


def _assert_equal(a, b, what):
    for name in a:
        for x, y in zip(
            a[name] if isinstance(a[name], tuple) else (a[name],), b[name] if isinstance(b[name], tuple) else (b[name],)
        ):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {name} differs"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints saved at 2 ranks for each (dtype, stage), with the uninterrupted continuation."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for dtype in ("bfloat16", "float32"):
        for stage in (1, 2, 3):
            path = str(root / f"{dtype}-s{stage}")
            results = run_on_ranks(2, _save_and_continue, dtype, stage, path)
            shapes = results[0][0][0]
            out[dtype, stage] = dict(
                path=path,
                params=shapes,
                state=_gather([r[0][1] for r in results], shapes),
                step=results[0][0][2],
                final_params=results[0][1][0],
                final_state=_gather([r[1][1] for r in results], shapes),
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_at_any_world_size_and_stage(saved, dtype, world):
    for save_stage, load_stage in ((1, 2), (2, 1), (3, 1), (2, 3), (3, 3)):  # stages crossed
        ref = saved[dtype, save_stage]
        results = run_on_ranks(world, _load_and_continue, dtype, load_stage, ref["path"])
        where = f"saved stage {save_stage} at 2 ranks, loaded stage {load_stage} at {world}"
        # Right after load: bitwise the saved master, moments, step, params and hyperparameters.
        for (params, _, step, groups), _ in results:
            _assert_equal(ref["params"], params, where)
            assert step == ref["step"] == SAVE_AT
            assert groups == [(HYPER["lr"], 0.1), (HYPER["lr"], 0.0)]
        _assert_equal(ref["state"], _gather([r[0][1] for r in results], ref["params"]), where)
        final = _gather([r[1][1] for r in results], ref["params"])
        if world == 2:  # same world size: bitwise the uninterrupted run (stages 1, 2 and 3 do the same math)
            _assert_equal(ref["final_state"], final, where + ", continued")
            _assert_equal(ref["final_params"], results[0][1][0], where + ", continued")
            continue
        # Another world size splits the same global batch differently, so its gradient differs by rounding: fp32
        # sums in another order and, for a bf16 model, bf16 matmuls summing 6 samples instead of 3 (~2^-8 relative).
        # Adam's m / sqrt(v) amplifies that on elements with small gradients, so bf16 gets a looser bound; the
        # checkpoint itself was shown bitwise exact above.
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-2, atol=3e-4)
        for name, (master, m, v) in final.items():
            rm, rmm, rv = ref["final_state"][name]
            msg = lambda s, name=name: f"{where} {name}: {s}"  # noqa: E731
            torch.testing.assert_close(master, rm, **tol, msg=msg)
            torch.testing.assert_close(m, rmm, rtol=tol["rtol"] * 10, atol=tol["atol"], msg=msg)
            torch.testing.assert_close(v, rv, rtol=tol["rtol"] * 10, atol=tol["atol"] ** 2, msg=msg)
        for name, p in results[0][1][0].items():
            ptol = dict(rtol=2**-6, atol=3e-4) if dtype == "bfloat16" else tol
            torch.testing.assert_close(p.float(), ref["final_params"][name].float(), **ptol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("stage", [2, 3])
def test_consolidate_matches_live_state(saved, tmp_path, dtype, stage):
    ref = saved[dtype, stage]
    if dtype == "bfloat16":  # the command line, as a user runs it: no process group, no GPU
        cmd = [sys.executable, "-m", "zero_ext.checkpoint", "consolidate", ref["path"], str(tmp_path)]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    else:
        checkpoint.consolidate(ref["path"], tmp_path)
    state = load_file(tmp_path / "optimizer.safetensors")
    for name, (master, m, v) in ref["state"].items():
        for key, live in (("param", master), ("exp_avg", m), ("exp_avg_sq", v)):
            assert torch.equal(state[f"{key}/{name}"], live), f"{key}/{name}"
        assert state[f"step/{name}"].item() == SAVE_AT
    model = Net(getattr(torch, dtype))
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    _assert_equal(ref["params"], _params(model), "consolidated model weights")
    # The full-precision state is a torch.optim.AdamW state dict away.
    adamw = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() > 1]},
                               {"params": [p for p in model.parameters() if p.dim() <= 1]}])  # fmt: skip
    adamw.load_state_dict(checkpoint.adamw_state_dict(tmp_path))
    assert adamw.param_groups[0]["weight_decay"] == 0.1 and adamw.param_groups[1]["lr"] == HYPER["lr"]


# ---------------------------------------------------------------------------------------------- failures
def _interrupted_save(rank, world, path, fail_at):
    model, opt = _build("bfloat16", 2)
    _step(model, opt, 0, rank, world)
    checkpoint.save(path, opt)  # a good checkpoint at step 1
    _step(model, opt, 1, rank, world)
    # Fault injection: the save module's steps are replaced by ones that crash part way.
    original = getattr(save_module, "_" + fail_at)

    def dying(*args):  # a crash after some files are on disk: rank 1's shard, or every shard but the marker
        if fail_at == "write_marker":
            raise KeyboardInterrupt("simulated crash before the marker")
        result = original(*args)
        if rank == 1:
            raise KeyboardInterrupt("simulated crash after writing rank 1's shard")
        return result

    setattr(save_module, "_" + fail_at, dying)
    try:
        with pytest.raises((KeyboardInterrupt, CheckpointError), match="simulated crash|failed"):
            checkpoint.save(path, opt)
    finally:
        setattr(save_module, "_" + fail_at, original)
    leftovers = [d for d in os.listdir(os.path.dirname(path)) if ".tmp-" in d]
    fresh_model, fresh = _build("bfloat16", 2, seed=5)
    checkpoint.load(path, fresh)  # the previous checkpoint is intact
    with pytest.raises(CheckpointError, match="no completion marker"):
        checkpoint.Checkpoint(os.path.join(os.path.dirname(path), leftovers[0]))
    return fresh.step_count, len(leftovers)


@pytest.mark.parametrize("fail_at", ["write_rank", "write_marker"])
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, fail_at):
    results = run_on_ranks(2, _interrupted_save, str(tmp_path / "ck"), fail_at)
    assert results == [(1, 1), (1, 1)]
    # The next successful save replaces the old checkpoint and clears the leftovers.
    run_on_ranks(2, _save_and_continue, "bfloat16", 2, str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.fixture
def damaged(saved, tmp_path):
    """A fresh copy of a 2-rank bf16 checkpoint to damage, and a 1-rank (no process group) optimizer to load it."""
    path = tmp_path / "ck"
    shutil.copytree(saved["bfloat16", 1]["path"], path)
    return path, _build("bfloat16", 1)[1]


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_truncated_corrupted_and_missing_files(damaged):
    path, opt = damaged
    bin1 = path / "rank00001.bin"
    data = bin1.read_bytes()
    bin1.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"rank00001\.bin: truncated"):
        checkpoint.load(path, opt)
    bin1.write_bytes(data)
    _flip_byte(path / "rank00000.bin", 4 * 5)  # master section, element 5 (a real parameter element)
    with pytest.raises(CheckpointError, match=r"rank00000\.bin: corrupted: checksum mismatch in block 0"):
        checkpoint.load(path, opt)
    with pytest.raises(CheckpointError, match=r"rank00000\.bin: corrupted"):
        checkpoint.consolidate(path, path.parent / "out")
    _flip_byte(path / "rank00000.bin", 4 * 5)
    checkpoint.load(path, opt)  # repaired: loads
    # A damaged block late in the last file (read after every other block) fails the load before anything
    # is written: the optimizer keeps the state it had.
    sections = json.loads((path / "rank00001.json").read_text())["groups"][0]["sections"]
    _flip_byte(path / "rank00001.bin", sections["exp_avg_sq"]["offset"] + 8)
    groups = opt.sharded_state.groups
    for group in groups:
        for t in group.tensors().values():
            t.add_(1.0)  # state that differs from the checkpoint's everywhere
    before = [t.clone() for group in groups for t in group.tensors().values()]
    with pytest.raises(CheckpointError, match=r"rank00001\.bin: corrupted"):
        checkpoint.load(path, opt)
    after = [t for group in groups for t in group.tensors().values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a failed load changed the optimizer"
    _flip_byte(path / "rank00001.bin", sections["exp_avg_sq"]["offset"] + 8)
    _flip_byte(path / "rank00001.json", 30)
    with pytest.raises(CheckpointError, match=r"rank00001\.json: checksum mismatch"):
        checkpoint.load(path, opt)
    _flip_byte(path / "rank00001.json", 30)
    json1 = (path / "rank00001.json").read_bytes()
    os.remove(path / "rank00001.json")
    with pytest.raises(CheckpointError, match=r"missing file .*rank00001\.json"):
        checkpoint.load(path, opt)
    (path / "rank00001.json").write_bytes(json1)
    os.remove(path / "rank00000.bin")
    with pytest.raises(CheckpointError, match=r"missing file .*rank00000\.bin"):
        checkpoint.consolidate(path, path.parent / "out")


def test_marker_and_version(damaged):
    path, opt = damaged
    marker = json.loads((path / "COMPLETE").read_text())
    (path / "COMPLETE").write_text(json.dumps(dict(marker, version=99)))
    with pytest.raises(
        CheckpointError, match=r"COMPLETE: format version 99, but this zero_ext reads versions \[1, 2\]"
    ):
        checkpoint.load(path, opt)
    os.remove(path / "COMPLETE")
    with pytest.raises(CheckpointError, match=r"no completion marker COMPLETE"):
        checkpoint.load(path, opt)
    with pytest.raises(CheckpointError, match=r"missing checkpoint directory .*nowhere"):
        checkpoint.load(path.parent / "nowhere", opt)


def test_model_mismatch_names_the_parameter(damaged):
    path, _ = damaged
    model, opt = _build("bfloat16", 1, hidden=HID + 1)
    with pytest.raises(CheckpointError, match=r"parameter 'inp.weight': shape \[37, 13\] in .*, but \[38, 13\]"):
        checkpoint.load(path, opt)
    model = Net(torch.bfloat16)
    named = [("renamed." + n if n == "out.bias" else n, p) for n, p in model.named_parameters()]
    opt = zero_ext.ZeroAdamW([{"params": [x for x in named if x[1].dim() > 1], "weight_decay": 0.1},
                              {"params": [x for x in named if x[1].dim() <= 1], "weight_decay": 0.0}])  # fmt: skip
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['renamed.out.bias'\]; .*\['out.bias'\]"):
        checkpoint.load(path, opt)
    _, opt = _build("float32", 1)
    with pytest.raises(CheckpointError, match=r"parameter 'inp.weight': dtype bfloat16 in .*, but float32"):
        checkpoint.load(path, opt)


# ---------------------------------------------------------------------------------------------- memory
def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _measured(fn):
    """Peak extra memory of ``fn()``: Python/numpy allocations (tracemalloc) and the process's peak RSS
    (reset through /proc/self/clear_refs), so torch CPU tensors are counted too."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _peak_rss_kib()
    tracemalloc.start()
    fn()
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return max((_peak_rss_kib() - base) * 1024, py_peak)


def _memory(rank, world, path):
    bucket_size = 2**16
    model, opt = _build("bfloat16", 2, hidden=1200, bucket_size=bucket_size)
    _step(model, opt, 0, rank, world)
    shard = sum(g.layout.shard_numel for g in opt.sharded_state.groups) * 14  # fp32 master, m, v + bf16 params
    checkpoint.save(path, opt)  # warm-up: imports, first-touch of code paths
    checkpoint.load(path, opt)
    save_peak = _measured(lambda: checkpoint.save(path, opt))
    load_peak = _measured(lambda: checkpoint.load(path, opt))
    return save_peak, load_peak, shard, bucket_size * 16


@pytest.fixture
def memory_dir(tmp_path):
    """Where the memory test writes: RAM (tmpfs) where there is one. It measures memory, not the disk, and its
    fsyncs on this VM's disk, after benchmarks had written tens of GB, once took over 400 s (a few seconds
    normally). Files written to tmpfs and not mapped are not in the process's RSS, so the measure is the same."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(prefix="zero_ext-memory-", dir="/dev/shm")
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield str(tmp_path)


def test_peak_memory_within_shard_plus_bucket(memory_dir):
    for save_peak, load_peak, shard, bucket in run_on_ranks(2, _memory, os.path.join(memory_dir, "ck"), timeout=400):
        # A gather to one rank would need the whole state (2 x shard); the bound is one bucket plus the
        # shard reader's few 1 MiB checksum blocks.
        bound = bucket + 8 * 2**20
        assert shard > 2 * bound, "model too small to tell a gather from streaming"
        assert save_peak < bound, f"save peak {save_peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
        assert load_peak < bound, f"load peak {load_peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------- collective calls
def _load_fails_on_one_rank(rank, world, path):
    """The last rank is given a path that does not exist: every rank raises within seconds, nothing changes."""
    import time

    model, opt = _build("bfloat16", 2)
    _step(model, opt, 0, rank, world)
    checkpoint.save(path, opt)
    _step(model, opt, 1, rank, world)
    before = [t.clone() for g in opt.sharded_state.groups for t in g.tensors().values()]
    t0 = time.monotonic()
    mine = path + "-missing" if rank == world - 1 else path
    match = (
        "missing checkpoint directory" if rank == world - 1 else rf"loading {path} failed on rank\(s\) \[{world - 1}\]"
    )
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(mine, opt)
    assert time.monotonic() - t0 < 10
    after = [t for g in opt.sharded_state.groups for t in g.tensors().values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a failed load changed the optimizer"
    checkpoint.load(path, opt)  # the group is fine: a good load still works
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_load_failing_on_one_rank_fails_on_every_rank(tmp_path, world):
    assert all(run_on_ranks(world, _load_fails_on_one_rank, str(tmp_path / "ck"), timeout=60))


def _save_on_rank_zero_only(rank, world, path, given):
    """The torch habit of saving on rank 0 only: the calling rank gets a clear error after the timeout instead of
    hanging until the process group's own timeout (30 min). ``given``: save's ``timeout=``; else the optimizer's
    ``collective_timeout`` is the deadline (300 s by default would outlast this test's 60)."""
    torch.manual_seed(0)
    model = Net(torch.bfloat16, HID)
    opt = zero_ext.ZeroAdamW(model.parameters(), **HYPER, stage=2, collective_timeout=None if given else 2.0)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(CheckpointError, match="collective: call them on every rank"):
            checkpoint.save(path, opt, timeout=1.0 if given else None)
        return time.monotonic() - start
    return 0.0


@pytest.mark.parametrize("given", [True, False], ids=["timeout", "collective_timeout"])
def test_save_called_on_one_rank_only_fails_instead_of_hanging(tmp_path, given):
    from distributed import discard_pool

    try:
        waited = run_on_ranks(2, _save_on_rank_zero_only, str(tmp_path / "ck"), given, timeout=60)[0]
        assert waited < 30, waited
    finally:
        discard_pool(2)  # the abandoned collective leaves this group unusable
