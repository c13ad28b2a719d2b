"""zero_ext.ops.fused_adamw_ (bf16 grad -> fp32 master/m/v -> bf16 param) against the torch alternatives.

Contenders, all in one process and interleaved round-robin (so machine noise hits them alike):
  copy            dst.copy_(src) on fp32 tensors (bytes = read + write = 8/element)
  scale_inplace   a.mul_(0.999) on fp32: an in-place read-modify-write stream (8 B/element)
  add_inplace     a.add_(b) on fp32: two read streams, one written in place (12 B/element)
  zero_ext        fused_adamw_(master, grad_bf16, m, v, param_out=param_bf16)
  torch_pipeline  what a user writes without zero_ext (buffers preallocated): grad32.copy_(grad_bf16);
                  torch.optim.AdamW(fused=True) step on the fp32 master; param_bf16.copy_(master)
  torch_fused     torch.optim.AdamW(fused=True) on fp32 params and fp32 grads
  torch_foreach   torch.optim.AdamW(foreach=True) on fp32 params and fp32 grads

Roofline. copy writes to lines it has not read, and a CPU reads a line before writing it (write-allocate):
it moves 12 bytes/element while it is credited with 8, so it understates the bandwidth. AdamW's streams are
mostly in place (master, m, v are read and written back), which pays no such penalty; scale_inplace and
add_inplace are streams of that shape. The roofline is the best GB/s of copy, scale_inplace and add_inplace
measured in the same run (the report names which); "% of copy" is kept for comparison with older rows.

Bytes per element. The mixed-precision update needs 28 B/element (master r/w 8, m r/w 8, v r/w 8,
bf16 grad r 2, bf16 param w 2): "effective GB/s" of zero_ext and torch_pipeline uses these 28 bytes.
The fp32 optimizers are credited with what they actually move: torch_fused 28 B (p, m, v r/w, fp32
grad r), torch_foreach 80 B (eight passes: p*=, lerp m, v*=, addcmul v, sqrt, /, +eps, addcdiv p).
torch_pipeline actually moves 40 B (28 + 6 for the grad upcast + 6 for the param downcast).

Usage: python bench/bench_fused_adamw.py [--numel 67108864] [--device cpu|cuda] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402

import zero_ext  # noqa: E402
from zero_ext import ops  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
BYTES_PER_ELEMENT = {
    "copy": 8,
    "scale_inplace": 8,
    "add_inplace": 12,
    "zero_ext": 28,
    "torch_pipeline": 28,
    "torch_fused": 28,
    "torch_foreach": 80,
}
ROOFLINES = ("copy", "scale_inplace", "add_inplace")
TARGETS = {"cpu": (0.85, 1.30), "cuda": (0.90, 1.35)}  # (fraction of the roofline, speedup vs pipeline)


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


def make_rooflines(n: int, device: torch.device) -> dict:
    """The in-place streams (no write-allocate penalty), to set beside make_contenders' copy."""
    a = torch.ones(n, device=device)
    b = torch.full((n,), 1e-6, device=device)
    c = torch.ones(n, device=device)
    # 0.999 ** (a few hundred reps) stays far from denormals; the in-place add only drifts by 1e-6 per rep.
    return {"scale_inplace": lambda: a.mul_(0.999), "add_inplace": lambda: c.add_(b)}


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


def summarize(times: dict, n: int) -> tuple[list[dict], str]:
    """Rows per contender, and the name of the roofline (the best-measured of ROOFLINES)."""
    gbs_of = {name: BYTES_PER_ELEMENT[name] * n / statistics.median(t) / 1e9 for name, t in times.items()}
    roofline = max((r for r in ROOFLINES if r in times), key=gbs_of.get)
    pipeline_ms = statistics.median(times["torch_pipeline"]) * 1e3
    rows = []
    for name, t in times.items():
        median = statistics.median(t)
        q = statistics.quantiles(t, n=4)
        rows.append(
            dict(
                contender=name,
                median_ms=median * 1e3,
                min_ms=min(t) * 1e3,
                iqr_ms=(q[2] - q[0]) * 1e3,
                gb_per_s=gbs_of[name],
                pct_of_roofline=100 * gbs_of[name] / gbs_of[roofline],
                pct_of_copy=100 * gbs_of[name] / gbs_of["copy"],
                speedup_vs_pipeline=pipeline_ms / (median * 1e3),
            )
        )
    return rows, roofline


def write_results(meta: dict, n: int, args, rows: list[dict], roofline: str, verdicts: list[str]) -> list:
    """results/fused_adamw_<device>.{json,md} (common.write_results) and rows appended to results/fused_adamw.csv."""
    device = args.device
    csv_meta = {k: meta[k] for k in ("device", "date", "commit", "torch")}
    csv_meta.update(zero_ext=zero_ext.__version__, cpu_isa=meta["zero_ext_cpu_isa"], load_avg_1m=meta["load_avg_1m"])
    csv_meta.update(command=meta["command"], numel=n, reps=args.reps, torch_threads=meta["torch_threads"])
    csv_rows = [{**csv_meta, **{k: _fmt(v) for k, v in r.items()}, "roofline": roofline} for r in rows]
    csv_path = common.append_csv(common.RESULTS / "fused_adamw.csv", csv_rows)
    size = f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)
    table = common.markdown_table(
        ["contender", "median ms", "min ms", "IQR ms", "GB/s", f"% of roofline ({roofline})", "% of copy",
         "speedup vs pipeline"],
        [[r["contender"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['iqr_ms']:.2f}", f"{r['gb_per_s']:.1f}",
          f"{r['pct_of_roofline']:.0f}%", f"{r['pct_of_copy']:.0f}%", f"{r['speedup_vs_pipeline']:.2f}x"] for r in rows],
    )  # fmt: skip
    body = "\n".join(
        [
            f"- numel: {n} ({size}); {args.reps} repetitions after {args.warmup} warmups, interleaved round-robin; "
            f"{meta['torch_threads']} torch threads; zero_ext {zero_ext.__version__}",
            f"- roofline: the best-measured of {', '.join(ROOFLINES)} in this run: **{roofline}**",
            "",
            table,
            "",
            "Bytes per element: " + ", ".join(f"{k} {v}" for k, v in BYTES_PER_ELEMENT.items()) + ".",
            "(zero_ext and torch_pipeline: the 28 useful bytes; torch_pipeline actually moves 40.)",
            "",
            "```",
            *verdicts,
            "```",
        ]
    )
    payload = {"numel": n, "reps": args.reps, "warmup": args.warmup, "roofline": roofline, "rows": rows}
    payload["verdicts"] = verdicts
    return common.write_results(f"fused_adamw_{device}", meta, payload, body) + [csv_path]


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
    meta = common.meta(device)  # at the start: the commit and load the run started with
    meta["torch_threads"] = torch.get_num_threads()
    base = make_contenders(n, device)
    contenders = {"copy": base.pop("copy"), **make_rooflines(n, device), **base}
    times = measure(contenders, device, args.warmup, args.reps)
    rows, roofline = summarize(times, n)
    print(f"fused_adamw_ benchmark: {meta['device']}, numel {n}, {args.reps} reps (+{args.warmup} warmup)")
    print(
        f"{'contender':<16}{'median ms':>11}{'min ms':>9}{'IQR ms':>9}{'GB/s':>8}{'% roof':>8}{'% copy':>8}"
        f"{'vs pipeline':>13}"
    )
    for r in rows:
        print(
            f"{r['contender']:<16}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{r['iqr_ms']:>9.2f}{r['gb_per_s']:>8.1f}"
            f"{r['pct_of_roofline']:>7.0f}%{r['pct_of_copy']:>7.0f}%{r['speedup_vs_pipeline']:>12.2f}x"
        )
    ours = next(r for r in rows if r["contender"] == "zero_ext")
    frac, speedup = TARGETS[device.type]
    verdicts = [
        f"{'PASS' if ours['pct_of_roofline'] >= 100 * frac else 'FAIL'}: zero_ext at {ours['pct_of_roofline']:.0f}% "
        f"of the roofline ({roofline}; target >= {100 * frac:.0f}%); {ours['pct_of_copy']:.0f}% of copy",
        f"{'PASS' if ours['speedup_vs_pipeline'] >= speedup else 'FAIL'}: zero_ext {ours['speedup_vs_pipeline']:.2f}x "
        f"the torch mixed-precision pipeline (target >= {speedup:.2f}x)",
    ]
    print("\n".join(verdicts))
    if not args.no_write:
        print("wrote " + ", ".join(str(p) for p in write_results(meta, n, args, rows, roofline, verdicts)))


if __name__ == "__main__":
    main()
