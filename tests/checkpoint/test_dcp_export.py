"""DCP checkpoints to safetensors without a gather: ``python -m zero_ext.checkpoint consolidate`` on a DCP directory
(zero_ext's at stage 3 on 3 ranks, FSDP2's on 2 ranks) writes model.safetensors that ``model.load_state_dict(strict=
True)`` takes, bitwise the saved weights, and optimizer.safetensors with every state tensor; and the export's peak
memory, measured in a fresh process, stays within one rank's shard plus one bucket for a 64 MB model saved by 3
ranks (a gather would hold the whole model)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dcp_runs import fsdp_model, fsdp_save, fsdp_steps, model_for, read_whole, zero_optimizer, zero_save, zero_steps
from distributed import run_on_ranks
from safetensors.torch import load_file

import zero_ext


def _zero(rank, world, path):
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3)
    zero_steps(model, opt, 0, 2)
    zero_save(model, opt, path)


def _fsdp(rank, world, path):
    model, opt = fsdp_model()
    fsdp_steps(model, opt, 0, 2)
    fsdp_save(model, opt, path)


def _consolidate(path, out):
    subprocess.run([sys.executable, "-m", "zero_ext.checkpoint", "consolidate", path, out], check=True)


@pytest.mark.slow
def test_consolidate_reads_dcp_checkpoints(tmp_path):
    for name, world, fn in (("zero", 3, _zero), ("fsdp", 2, _fsdp)):
        path, out = str(tmp_path / name), str(tmp_path / f"{name}-out")
        run_on_ranks(world, fn, path)
        _consolidate(path, out)
        whole = read_whole(path)
        weights, state = load_file(f"{out}/model.safetensors"), load_file(f"{out}/optimizer.safetensors")
        model = model_for(torch.float32)
        model.load_state_dict(weights, strict=True)
        assert set(weights) == set(model.state_dict())
        for key, value in weights.items():
            assert torch.equal(value, whole[f"model.{key}"]), (name, key)
        for key, value in whole.items():
            if key.startswith("optim.state."):
                fqn, _, kind = key[len("optim.state.") :].rpartition(".")
                assert torch.equal(state[f"{kind}/{fqn}"], value), (name, key)


DIM, LAYERS, BUCKET = 2048, 4, 1 << 20


def _large(rank, world, path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])
    opt = zero_ext.ZeroAdamW(model.parameters(), lr=1e-3, stage=2, module=model, bucket_size=BUCKET)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    zero_save(model, opt, path)


_MEASURE = textwrap.dedent(
    """
    import os, sys, threading, time
    from zero_ext.checkpoint.dcp_export import export_dcp
    page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
    base, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)
    t = threading.Thread(target=sample)
    t.start()
    export_dcp(sys.argv[1], sys.argv[2])
    done.set()
    t.join()
    print(max(peak[0], rss()) - base)
    """
)


@pytest.mark.slow
def test_export_peak_memory_is_one_shard_plus_one_bucket(tmp_path):
    path, out = str(tmp_path / "large"), str(tmp_path / "large-out")
    world = 3
    run_on_ranks(world, _large, path)
    result = subprocess.run([sys.executable, "-c", _MEASURE, path, out], check=True, capture_output=True, text=True)
    peak = int(result.stdout.strip().splitlines()[-1])
    model_bytes = LAYERS * DIM * DIM * 4
    bound = model_bytes // world + BUCKET * 4  # one rank's shard of the weights + one bucket (fp32)
    print(f"export peak RSS above the start: {peak / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB; "
          f"the whole model {model_bytes / 2**20:.1f} MiB")  # fmt: skip
    assert peak <= bound, (peak, bound)
    assert os.path.getsize(f"{out}/model.safetensors") > model_bytes
