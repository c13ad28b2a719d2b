"""zero_ext.ops.fused_adamw_ (bf16 grad -> fp32 master/m/v -> bf16 param) against the torch alternatives.

Contenders, all in one process and interleaved round-robin (so machine noise hits them alike):
  copy            dst.copy_(src) on fp32 tensors: the measured memory roofline (bytes = read + write)
  zero_ext        fused_adamw_(master, grad_bf16, m, v, param_out=param_bf16)
  torch_pipeline  what a user writes without zero_ext (buffers preallocated): grad32.copy_(grad_bf16);
                  torch.optim.AdamW(fused=True) step on the fp32 master; param_bf16.copy_(master)
  torch_fused     torch.optim.AdamW(fused=True) on fp32 params and fp32 grads
  torch_foreach   torch.optim.AdamW(foreach=True) on fp32 params and fp32 grads

Bytes per element. The mixed-precision update needs 28 B/element (master r/w 8, m r/w 8, v r/w 8,
bf16 grad r 2, bf16 param w 2): "effective GB/s" of zero_ext and torch_pipeline uses these 28 bytes.
The fp32 optimizers are credited with what they actually move: torch_fused 28 B (p, m, v r/w, fp32
grad r), torch_foreach 80 B (eight passes: p*=, lerp m, v*=, addcmul v, sqrt, /, +eps, addcdiv p).
torch_pipeline actually moves 40 B (28 + 6 for the grad upcast + 6 for the param downcast).

Usage: python bench/bench_fused_adamw.py [--numel 67108864] [--device cpu|cuda] [--reps 15]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import zero_ext
from zero_ext import ops

RESULTS = Path(__file__).resolve().parent / "results"
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
BYTES_PER_ELEMENT = {"copy": 8, "zero_ext": 28, "torch_pipeline": 28, "torch_fused": 28, "torch_foreach": 80}
TARGETS = {"cpu": (0.85, 1.30), "cuda": (0.90, 1.35)}  # (fraction of copy bandwidth, speedup vs pipeline)


def make_contenders(n: int, device: torch.device) -> dict:
    """name -> a callable doing one repetition; each contender owns its buffers."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(n, generator=gen).to(device)
    grad_bf16 = (torch.randn(n, generator=gen) * 1e-2).to(device=device, dtype=torch.bfloat16)
    contenders = {}

    src, dst = init.clone(), torch.empty_like(init)
    contenders["copy"] = lambda: dst.copy_(src)

    master, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    param = torch.empty(n, device=device, dtype=torch.bfloat16)
    step = [0]

    def zero_ext_step():
        step[0] += 1
        ops.fused_adamw_(master, grad_bf16, m, v, step=step[0], param_out=param, **HYPER)

    contenders["zero_ext"] = zero_ext_step

    def torch_optimizer(**kind):
        p = init.clone().requires_grad_()
        p.grad = torch.empty_like(init)
        opt = torch.optim.AdamW(
            [p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"], **kind,
        )  # fmt: skip
        return p, opt

    pipe_master, pipe_opt = torch_optimizer(fused=True)
    pipe_param = torch.empty(n, device=device, dtype=torch.bfloat16)

    def pipeline_step():
        with torch.no_grad():
            pipe_master.grad.copy_(grad_bf16)
            pipe_opt.step()
            pipe_param.copy_(pipe_master)

    contenders["torch_pipeline"] = pipeline_step
    for name, kind in (("torch_fused", dict(fused=True)), ("torch_foreach", dict(foreach=True))):
        p, opt = torch_optimizer(**kind)
        p.grad.copy_(grad_bf16)
        contenders[name] = opt.step
    return contenders


def measure(contenders: dict, device: torch.device, warmup: int, reps: int) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in contenders}
    for rep in range(warmup + reps):
        for name, fn in contenders.items():  # round-robin: every contender sees the same conditions
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def summarize(times: dict, n: int) -> list[dict]:
    copy_gbs = BYTES_PER_ELEMENT["copy"] * n / statistics.median(times["copy"]) / 1e9
    pipeline_ms = statistics.median(times["torch_pipeline"]) * 1e3
    rows = []
    for name, t in times.items():
        median = statistics.median(t)
        q = statistics.quantiles(t, n=4)
        gbs = BYTES_PER_ELEMENT[name] * n / median / 1e9
        rows.append(
            dict(
                contender=name,
                median_ms=median * 1e3,
                min_ms=min(t) * 1e3,
                iqr_ms=(q[2] - q[0]) * 1e3,
                gb_per_s=gbs,
                pct_of_copy=100 * gbs / copy_gbs,
                speedup_vs_pipeline=pipeline_ms / (median * 1e3),
            )
        )
    return rows


def git_commit() -> str:
    repo = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "zero_ext", "bench"], cwd=repo)
        return sha.stdout.strip() + ("-dirty" if dirty.returncode else "")
    except OSError:
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    return f"{model or platform.processor()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def write_results(device: torch.device, n: int, args, rows: list[dict], verdicts: list[str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=device_name(device),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_commit(),
        torch=torch.__version__,
        zero_ext=zero_ext.__version__,
        cpu_isa=ops.cpu_isa() if device.type == "cpu" else "",
        load_avg_1m=f"{os.getloadavg()[0]:.2f}",
        command=shlex.join(["python", "bench/bench_fused_adamw.py", *sys.argv[1:]]),
    )
    csv_path = RESULTS / "fused_adamw.csv"
    fields = list(meta) + ["numel", "reps"] + list(rows[0])
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**meta, "numel": n, "reps": args.reps, **{k: _fmt(v) for k, v in row.items()}})
    md_path = RESULTS / f"fused_adamw_{device.type}.md"
    lines = [f"# fused_adamw_ benchmark ({device.type})", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- numel: {n} (2^{n.bit_length() - 1})" if n & (n - 1) == 0 else f"- numel: {n}"]
    lines += [f"- repetitions: {args.reps} after {args.warmup} warmups, interleaved round-robin", ""]
    lines += ["| contender | median ms | min ms | IQR ms | GB/s | % of copy | speedup vs pipeline |"]
    lines += ["|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['iqr_ms']:.2f} | {r['gb_per_s']:.1f} "
            f"| {r['pct_of_copy']:.0f}% | {r['speedup_vs_pipeline']:.2f}x |"
        )
    lines += ["", "Bytes per element: " + ", ".join(f"{k} {v}" for k, v in BYTES_PER_ELEMENT.items()) + "."]
    lines += ["(zero_ext and torch_pipeline: the 28 useful bytes; torch_pipeline actually moves 40.)", ""]
    lines += ["```", *verdicts, "```", ""]
    md_path.write_text("\n".join(lines))
    return md_path


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; do not touch bench/results")
    args = parser.parse_args()
    if args.reps < 10:
        parser.error("--reps must be >= 10")
    device = torch.device(args.device)
    n = args.numel
    times = measure(make_contenders(n, device), device, args.warmup, args.reps)
    rows = summarize(times, n)
    print(f"fused_adamw_ benchmark: {device_name(device)}, numel {n}, {args.reps} reps (+{args.warmup} warmup)")
    print(f"{'contender':<16}{'median ms':>11}{'min ms':>9}{'IQR ms':>9}{'GB/s':>8}{'% copy':>8}{'vs pipeline':>13}")
    for r in rows:
        print(
            f"{r['contender']:<16}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{r['iqr_ms']:>9.2f}{r['gb_per_s']:>8.1f}"
            f"{r['pct_of_copy']:>7.0f}%{r['speedup_vs_pipeline']:>12.2f}x"
        )
    ours = next(r for r in rows if r["contender"] == "zero_ext")
    frac, speedup = TARGETS[device.type]
    verdicts = [
        f"{'PASS' if ours['pct_of_copy'] >= 100 * frac else 'FAIL'}: zero_ext at {ours['pct_of_copy']:.0f}% "
        f"of copy bandwidth (target >= {100 * frac:.0f}%)",
        f"{'PASS' if ours['speedup_vs_pipeline'] >= speedup else 'FAIL'}: zero_ext {ours['speedup_vs_pipeline']:.2f}x "
        f"the torch mixed-precision pipeline (target >= {speedup:.2f}x)",
    ]
    print("\n".join(verdicts))
    if not args.no_write:
        print(f"wrote {write_results(device, n, args, rows, verdicts)}")


if __name__ == "__main__":
    main()
