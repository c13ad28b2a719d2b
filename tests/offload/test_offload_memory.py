"""Resident memory with offload="nvme" on a 67.3M-parameter model: the process's peak RSS grows over the bare model's
training step by at most the fp32 grad shard, the gradients in flight and the bounded buffers (window, landing
ring, staging); the in-memory optimizer, measured the same way, adds its 16 B/param. Each run is a fresh process
(the peak is per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

DIM, LAYERS = 2900, 8  # 8 * 2900**2 = 67.3M parameters (> 64 * 2**20)

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from zero_ext import ZeroAdamW

    def peak():  # VmHWM: the most this process has had resident, in bytes
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    offload, directory, dim, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    offload = None if offload == "none" else offload
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(layers)])
    x = torch.randn(4, dim, dtype=torch.bfloat16)

    def train_step(opt=None):
        model(x).float().pow(2).mean().backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    train_step()  # the bare model's step: parameters, activations, every bf16 gradient at once
    bare = peak()
    kw = dict(offload_dir=directory) if offload == "nvme" else {}
    opt = ZeroAdamW(model.parameters(), stage=2, offload=offload, **kw)
    for _ in range(2):
        train_step(opt)
    report = opt.memory_report()
    largest = max(b.numel for g in opt.sharded_state.groups for b in g.layout.buckets)
    print(json.dumps(dict(
        params=sum(p.numel() for p in model.parameters()), bare=bare, with_optimizer=peak(),
        grad_shard=report.allocated["grad_shard"], offload_buffers=report.offload_buffers, staging=report.staging,
        bucket_grads=2 * largest, on_disk=sum(report.on_disk.values()),
    )))
    opt.close()
""")


def _measure(offload: str, directory: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, offload, directory, str(DIM), str(LAYERS)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_nvme_resident_memory_is_the_grad_shard_and_the_window(tmp_path):
    nvme = _measure("nvme", str(tmp_path))
    memory = _measure("none", str(tmp_path))
    psi = nvme["params"]
    assert psi >= 64 * 2**20
    grown = nvme["with_optimizer"] - nvme["bare"]
    # The grad shard (fp32), the window, landing ring and staging, the bf16 gradients of the buckets in flight,
    # and 32 MiB for what any first step allocates once (thread pools, the allocator's slack).
    allowed = nvme["grad_shard"] + nvme["offload_buffers"] + nvme["staging"] + 3 * nvme["bucket_grads"] + 32 * 2**20
    assert grown <= allowed, f"nvme: RSS grew {grown / 2**20:.0f} MiB, allowed {allowed / 2**20:.0f} MiB ({nvme})"
    assert nvme["on_disk"] >= 12 * psi  # the master, exp_avg and exp_avg_sq are on disk, not in memory
    # The same measurement sees the in-memory optimizer's 16 B/param (master, moments, fp32 grad shard), less
    # the bare step's 2 B/param of bf16 gradients, which stage 2 frees bucket by bucket.
    in_memory = memory["with_optimizer"] - memory["bare"]
    assert in_memory >= 13 * psi, f"in memory: RSS grew only {in_memory / psi:.1f} B/param ({memory})"
    # The window, landing ring and staging are bounded (the same at any model size): leave them out, and what grows
    # with the model (the 4 B/param grad shard) is well under half the in-memory optimizer's growth. With them in,
    # the 67.3M model sits right at half (CI measured 484 MiB against 967), a coincidence of this model's size.
    bounded = nvme["offload_buffers"] + nvme["staging"]
    assert grown - bounded < in_memory / 2, f"nvme grew {grown / psi:.1f} B/param, in memory {in_memory / psi:.1f}"
