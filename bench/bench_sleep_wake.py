"""RL colocation: ``opt.offload_states()`` and ``opt.reload_states()`` time and bytes per second, against a plain
device-to-host (and host-to-device) copy of the same bytes measured in the same run, interleaved, and the memory
before and after each call (the optimizer's device bytes from its live storages, the process's RSS; on CUDA the
allocator's ``memory_allocated`` / ``memory_reserved``).

One process, a bf16 model of ``--params`` parameters (``--dim`` x ``--dim`` layers), ``ZeroAdamW`` stage 2 after two
steps, every group offloaded (master, two moments, grad shard, the flat bf16 parameters: 18 B per parameter). Two
host-buffer policies, each a row: ``kept`` (CUDA's default: the host buffers are made at the first offload and reused,
so a cycle is two copies) and ``per cycle`` (the CPU-only default: the reload frees the host copies, so that CPU
training does not hold its state twice; each offload allocates them again). The baseline copies the same number of
bytes into a host buffer allocated once (the best a kept-buffer offload can do) and back.

    python bench/bench_sleep_wake.py                       # CPU, 20M parameters, 5 repetitions
    python bench/bench_sleep_wake.py --device cuda --params 1e9
    python bench/bench_sleep_wake.py --params 2e6 --reps 2 --out-dir /tmp/sw   # seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import RESULTS, markdown_table, meta, text_table, write_results  # noqa: E402


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _memory(opt, device) -> dict:
    out = {"optimizer_device_bytes": sum(opt._sleep.device_bytes().values()), "rss": _rss()}
    if device.type == "cuda":
        out.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run(params: float, dim: int, reps: int, device: torch.device) -> dict:
    from zero_ext import ZeroAdamW

    layers = max(1, round(params / (dim * dim)))

    def trained(keep: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
        model = model.to(device, torch.bfloat16)
        opt = ZeroAdamW(model.parameters(), lr=1e-4, stage=2, module=model)
        x = torch.randn(8, dim, device=device, dtype=torch.bfloat16)
        for _ in range(2):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt._sleep.lot.keeps_buffers = keep or device.type == "cuda"  # (CUDA always keeps its pinned buffers)
        return model, opt

    # one optimizer per host-buffer policy (a lot's policy decides what its previous reload left)
    policies = (
        {"kept": trained(True)} if device.type == "cuda" else {"kept": trained(True), "per_cycle": trained(False)}
    )
    _sync(device)
    nbytes = sum(policies["kept"][1]._sleep.device_bytes().values())
    # the baseline: the same bytes, device -> a host buffer made once -> device
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev.random_(0, 255)
    rows = {
        k: []
        for k in ("offload_kept", "reload_kept", "offload_per_cycle", "reload_per_cycle", "d2h", "h2d", "h2d_fresh")
    }
    memory = {}
    for rep in range(reps + 1):  # the first round warms up (and makes the kept buffers)
        for policy, (_, opt) in policies.items():
            before = _memory(opt, device)
            t_off = _timed(opt.offload_states, device)
            after_off = _memory(opt, device)
            t_on = _timed(opt.reload_states, device)
            after_on = _memory(opt, device)
            if rep:
                rows[f"offload_{policy}"].append(t_off)
                rows[f"reload_{policy}"].append(t_on)
            memory[policy] = dict(before=before, after_offload=after_off, after_reload=after_on)
        t_d2h = _timed(lambda: host.copy_(dev), device)
        t_h2d = _timed(lambda: dev.copy_(host), device)
        # the same copy into memory allocated just before (what a reload does: its pages are new)
        t_fresh = _timed(lambda: torch.empty(nbytes, dtype=torch.uint8, device=device).copy_(host), device)
        if rep:
            rows["d2h"].append(t_d2h)
            rows["h2d"].append(t_h2d)
            rows["h2d_fresh"].append(t_fresh)
    for _, opt in policies.values():
        opt.close()
    return dict(numel=layers * dim * dim, layers=layers, bytes=nbytes, times=rows, memory=memory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="result file stem (default: sleep_wake_<device type>)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args()
    device = torch.device(args.device)
    m = meta(device)
    res = run(args.params, args.dim, args.reps, device)
    nbytes, t = res["bytes"], res["times"]

    def cell(key):
        med = statistics.median(t[key])
        return f"{med * 1e3:.1f} ({min(t[key]) * 1e3:.1f}-{max(t[key]) * 1e3:.1f})", f"{nbytes / med / 1e9:.2f}", med

    table = []
    for policy in ("kept", "per_cycle"):
        if not t[f"offload_{policy}"]:
            continue
        mem = res["memory"][policy]
        for call, base in (("offload", "d2h"), ("reload", "h2d")):
            c, b = cell(f"{call}_{policy}"), cell(base)
            fresh = cell("h2d_fresh")[0] if call == "reload" else ""
            after = mem["after_offload"] if call == "offload" else mem["after_reload"]
            start = mem["before"] if call == "offload" else mem["after_offload"]
            row = [f"{call}_states ({policy.replace('_', ' ')})", f"{nbytes / 1e6:.1f}", c[0], c[1], base, b[0], b[1],
                   f"{c[2] / b[2]:.2f}", fresh,
                   f"{start['optimizer_device_bytes'] / 1e6:.1f} -> {after['optimizer_device_bytes'] / 1e6:.1f}",
                   f"{start['rss'] / 1e6:.0f} -> {after['rss'] / 1e6:.0f}"]  # fmt: skip
            if device.type == "cuda":
                row += [f"{start['allocated'] / 1e6:.1f} -> {after['allocated'] / 1e6:.1f}",
                        f"{start['reserved'] / 1e6:.1f} -> {after['reserved'] / 1e6:.1f}"]  # fmt: skip
            table.append(row)
    headers = ["call", "MB", "ms (min-max)", "GB/s", "baseline", "baseline ms (min-max)", "baseline GB/s",
               "call/baseline", "h2d into new memory ms", "optimizer device MB before -> after", "RSS MB before -> after"]  # fmt: skip
    if device.type == "cuda":
        headers += ["allocated MB", "reserved MB"]
    print(text_table(headers, table))
    body = (
        f"{res['numel'] / 1e6:.1f}M bf16 parameters ({res['layers']} x {args.dim}^2 layers), ZeroAdamW stage 2, one "
        f"process, every group offloaded: {nbytes / 1e6:.1f} MB (master, exp_avg, exp_avg_sq, grad shard fp32; "
        "params bf16). Median of "
        f"{args.reps} repetitions after one warm-up round, interleaved with the baseline (`d2h`: "
        "`host.copy_(device)` of the same bytes into a host buffer made once; `h2d`: back). `kept`: host buffers "
        "made once and reused (CUDA's policy); `per cycle`: freed by each reload and made again by the next offload "
        "(the CPU-only default). Memory: the optimizer's bytes on the device, summed over its live storages "
        "(`opt._sleep.device_bytes()`), and the process's RSS, before and after each call. On a CPU-only run the "
        "device is host memory: with kept buffers the host copies stay resident while training too, so the offload "
        "lowers the RSS by the bytes it frees and the reload raises it back; per cycle the copies exist only while "
        "offloaded, and the RSS stays (glibc may also keep freed pages). Offload = copy + free; reload = allocate + "
        "copy into new memory, the `h2d into new memory` column's baseline (the same copy into a tensor allocated "
        "just before: its pages are touched for the first time).\n\n" + markdown_table(headers, table)
    )
    out = args.out or f"sleep_wake_{device.type}"
    paths = write_results(out, m, {"result": res, "args": vars(args)}, body, args.out_dir)
    print("wrote", *[str(p) for p in paths])


if __name__ == "__main__":
    main()
