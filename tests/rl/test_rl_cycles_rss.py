"""100 offload / reload cycles do not grow the process's resident memory (VmRSS, read from /proc, in a fresh process):
the host buffers are made once and reused (as on CUDA, ``keeps_buffers``), or freed by each reload (the CPU default).
Under 4 MiB in all, and over the last 50 (with glibc's mmap threshold fixed: see the test). The model is large enough (2.1M bf16 parameters, 38 MB parked per cycle) that one
leaked buffer per cycle would be 100x visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from zero_ext import ZeroAdamW

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    keep = sys.argv[1] == "keep"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, dtype=torch.bfloat16) for _ in range(8)])
    opt = ZeroAdamW(model.parameters(), stage=2)
    opt._sleep.lot.keeps_buffers = keep
    x = torch.randn(4, 512, dtype=torch.bfloat16)

    def cycle():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.offload_states()
        opt.reload_states()

    for _ in range(3):
        cycle()
    parked = opt._sleep.lot.parked_bytes() or sum(s.nbytes for s in opt._sleep.lot.slots.values())
    before = rss()
    for _ in range(50):
        cycle()
    middle = rss()
    for _ in range(50):
        cycle()
    after = rss()
    print(json.dumps(dict(before=before, middle=middle, after=after, parked=parked)))
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.parametrize("buffers", ["keep", "free"])
def test_hundred_cycles_do_not_grow_rss(buffers):
    # glibc's dynamic mmap threshold moves up after each large free, and later buffers of that size come from a heap
    # whose freed pages it keeps or not by its own rules (measured without this: 6-40 MiB of drift over 100 cycles,
    # either way up). A fixed threshold keeps every large buffer an mmap of its own, freed when freed: the RSS then
    # shows what this code allocates and frees, not the heap's bookkeeping.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, buffers], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["parked"] > 30 * 2**20
    growth, late = m["after"] - m["before"], m["after"] - m["middle"]
    assert growth < 4 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 100 cycles ({m})"  # a leak: 38 MB a cycle
    assert late < 4 * 2**20, f"RSS grew by {late / 2**20:.1f} MiB over the last 50 cycles ({m})"
