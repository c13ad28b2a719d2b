"""zero_ext.ops.fused_adamw_ (bf16 grad -> fp32 master/m/v -> bf16 param) against the torch alternatives.

    python bench/bench_fused_adamw.py                            # CPU, 2^26 elements: the headline and its targets
    python bench/bench_fused_adamw.py --device cuda              # on a GPU machine
    python bench/bench_fused_adamw.py --sizes 20,22,24,26 --all  # every torch Adam/AdamW flavour, several sizes

Contenders, all in one process and interleaved round-robin per size (so machine noise hits them alike):
  copy            dst.copy_(src) on fp32 tensors (bytes = read + write = 8/element)
  scale_inplace   a.mul_(0.999) on fp32: an in-place read-modify-write stream (8 B/element)
  add_inplace     a.add_(b) on fp32: two read streams, one written in place (12 B/element)
  zero_ext        fused_adamw_(master, grad_bf16, m, v, param_out=param_bf16)
  torch_pipeline  what a user writes without zero_ext (buffers preallocated): grad32.copy_(grad_bf16);
                  torch.optim.AdamW(fused=True) step on the fp32 master; param_bf16.copy_(master)
  torch_fused     torch.optim.AdamW(fused=True) on fp32 params and fp32 grads
  torch_foreach   torch.optim.AdamW(foreach=True) on fp32 params and fp32 grads
  with --all:     torch_adamw_forloop, torch_adam_{forloop,foreach,fused} (Adam: weight decay is L2), and
                  DeepSpeed's CPU Adam / FusedAdam when DeepSpeed is importable (never required)

Roofline. copy writes to lines it has not read, and a CPU reads a line before writing it (write-allocate):
it moves 12 bytes/element while it is credited with 8, so it understates the bandwidth. AdamW's streams are
mostly in place (master, m, v are read and written back), which pays no such penalty; scale_inplace and
add_inplace are streams of that shape. The roofline is the best GB/s of copy, scale_inplace and add_inplace
measured in the same run (the report names which); "% of copy" is kept for comparison with older rows.

Bytes per element. The mixed-precision update needs 28 B/element (master r/w 8, m r/w 8, v r/w 8,
bf16 grad r 2, bf16 param w 2): "GB/s" of zero_ext and torch_pipeline uses these 28 bytes (the pipeline
actually moves 40: + 6 for the grad upcast + 6 for the param downcast). torch_fused is credited with what it
moves (28 B: p, m, v r/w, fp32 grad r), torch_foreach with 80 B (eight passes: p*=, lerp m, v*=, addcmul v,
sqrt, /, +eps, addcdiv p); the --all flavours with the 28 useful bytes.

Targets, at the largest size measured (PASS/FAIL in the output, exit status 0 either way): CPU >= 85% of the
roofline and >= 1.3x the pipeline; CUDA >= 90% and >= 1.35x. Sizes whose buffers would not fit in 70% of the
available memory are skipped with a message.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402

import zero_ext  # noqa: E402
from zero_ext import ops  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
ROOFLINES = {"copy": 8, "scale_inplace": 8, "add_inplace": 12}  # bytes credited per element
CORE = {"zero_ext": 28, "torch_pipeline": 28, "torch_fused": 28, "torch_foreach": 80}
EXTRA = ("torch_adamw_forloop", "torch_adam_forloop", "torch_adam_foreach", "torch_adam_fused")
USEFUL = 28  # bytes per element one mixed-precision AdamW update must move; what the --all flavours are credited
BUFFER_BYTES = 6 + 8 + 12 + 14 + 22 + 16 + 24  # per element, everything the core contenders hold at once
EXTRA_BUFFER_BYTES = 16 + 8  # per element and --all flavour (+ temporaries)
TARGETS = {"cpu": (0.85, 1.30), "cuda": (0.90, 1.35)}  # (fraction of the roofline, speedup vs pipeline)


def _adam(cls, init: torch.Tensor, grad: torch.Tensor, **kind):
    p = init.clone().requires_grad_()
    p.grad = grad.to(torch.float32).clone()
    h = HYPER
    return p, cls([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"], **kind)


def make_contenders(n: int, device: torch.device, everything: bool) -> tuple[dict, str]:
    """name -> a callable doing one repetition (each owns its buffers), and a note on DeepSpeed."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(n, generator=gen).to(device)
    grad_bf16 = (torch.randn(n, generator=gen) * 1e-2).to(device=device, dtype=torch.bfloat16)
    src, dst = init.clone(), torch.empty_like(init)
    a, b, c = torch.ones(n, device=device), torch.full((n,), 1e-6, device=device), torch.ones(n, device=device)
    # 0.999 ** (a few hundred reps) stays far from denormals; the in-place add only drifts by 1e-6 per rep.
    out = {"copy": lambda: dst.copy_(src), "scale_inplace": lambda: a.mul_(0.999), "add_inplace": lambda: c.add_(b)}

    master, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    param, step = torch.empty(n, device=device, dtype=torch.bfloat16), [0]

    def zero_ext_step():
        step[0] += 1
        ops.fused_adamw_(master, grad_bf16, m, v, step=step[0], param_out=param, **HYPER)

    out["zero_ext"] = zero_ext_step
    pipe_master, pipe_opt = _adam(torch.optim.AdamW, init, grad_bf16, fused=True)
    pipe_param = torch.empty(n, device=device, dtype=torch.bfloat16)

    def pipeline_step():
        with torch.no_grad():
            pipe_master.grad.copy_(grad_bf16)
            pipe_opt.step()
            pipe_param.copy_(pipe_master)

    out["torch_pipeline"] = pipeline_step
    out["torch_fused"] = _adam(torch.optim.AdamW, init, grad_bf16, fused=True)[1].step
    out["torch_foreach"] = _adam(torch.optim.AdamW, init, grad_bf16, foreach=True)[1].step
    if not everything:
        return out, "DeepSpeed not measured (without --all)"
    out["torch_adamw_forloop"] = _adam(torch.optim.AdamW, init, grad_bf16, foreach=False)[1].step
    out["torch_adam_forloop"] = _adam(torch.optim.Adam, init, grad_bf16, foreach=False)[1].step
    out["torch_adam_foreach"] = _adam(torch.optim.Adam, init, grad_bf16, foreach=True)[1].step
    out["torch_adam_fused"] = _adam(torch.optim.Adam, init, grad_bf16, fused=True)[1].step
    try:  # DeepSpeed's CPU Adam (CPU) or FusedAdam (CUDA)
        if device.type == "cpu":
            from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
        else:
            from deepspeed.ops.adam import FusedAdam as cls
        name = "deepspeed_cpu_adam" if device.type == "cpu" else "deepspeed_fused_adam"
        out[name] = _adam(cls, init, grad_bf16, adamw_mode=True)[1].step
        return out, f"{name} included"
    except Exception as e:  # ImportError, or its JIT build failing: optional, never required
        why = str(e).splitlines()[0][:120] if str(e) else ""
        return out, f"DeepSpeed not measured ({type(e).__name__}: {why})"


def credited_bytes(name: str) -> int:
    return ROOFLINES.get(name) or CORE.get(name) or USEFUL


def summarize(times: dict, n: int) -> tuple[list[dict], str]:
    """Rows per contender, and the name of the roofline (the best-measured of ROOFLINES)."""
    stats = {name: harness.summary(t) for name, t in times.items()}
    gbs = {name: credited_bytes(name) * n / s["median_s"] / 1e9 for name, s in stats.items()}
    roofline = max(ROOFLINES, key=gbs.get)
    pipeline, ours = stats["torch_pipeline"]["median_s"], stats["zero_ext"]["median_s"]
    rows = []
    for name, s in stats.items():
        rows.append(
            dict(
                numel=n,
                contender=name,
                median_ms=s["median_s"] * 1e3,
                min_ms=s["min_s"] * 1e3,
                max_ms=s["max_s"] * 1e3,
                iqr_ms=(s["q3_s"] - s["q1_s"]) * 1e3,
                gb_per_s=gbs[name],
                pct_of_roofline=100 * gbs[name] / gbs[roofline],
                pct_of_copy=100 * gbs[name] / gbs["copy"],
                speedup_vs_pipeline=pipeline / s["median_s"],
                time_vs_zero_ext=s["median_s"] / ours,
            )
        )
    return rows, roofline


def verdicts(rows: list[dict], roofline: str, device_type: str) -> list[str]:
    ours = next(r for r in rows if r["contender"] == "zero_ext")
    frac, speedup = TARGETS[device_type]
    return [
        f"{'PASS' if ours['pct_of_roofline'] >= 100 * frac else 'FAIL'}: zero_ext at {ours['pct_of_roofline']:.0f}% "
        f"of the roofline ({roofline}; target >= {100 * frac:.0f}%); {ours['pct_of_copy']:.0f}% of copy",
        f"{'PASS' if ours['speedup_vs_pipeline'] >= speedup else 'FAIL'}: zero_ext {ours['speedup_vs_pipeline']:.2f}x "
        f"the torch mixed-precision pipeline (target >= {speedup:.2f}x)",
    ]


def _size(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def table_rows(rows: list[dict]) -> list[list]:
    return [
        [
            _size(r["numel"]),
            r["contender"],
            f"{r['median_ms']:.2f}",
            f"{r['min_ms']:.2f}-{r['max_ms']:.2f}",
            f"{r['iqr_ms']:.2f}",
            f"{r['gb_per_s']:.1f}",
            f"{r['pct_of_roofline']:.0f}%",
            f"{r['pct_of_copy']:.0f}%",
            f"{r['speedup_vs_pipeline']:.2f}x",
            f"{r['time_vs_zero_ext']:.2f}x",
        ]
        for r in rows
    ]


HEADERS = [
    "n",
    "contender",
    "median ms",
    "min-max ms",
    "IQR ms",
    "GB/s",
    "% of roofline",
    "% of copy",
    "speedup vs pipeline",
    "time vs zero_ext",
]


def write(name: str, args, meta: dict, rows: list, roofline: str, lines: list, notes: list) -> list:
    """<out-dir>/<name>.{json,md}, and the rows appended to <out-dir>/fused_adamw.csv (earlier rows kept)."""
    credits = ", ".join(f"{k} {credited_bytes(k)}" for k in {**ROOFLINES, **CORE})
    body = [
        f"- {args.reps} repetitions after {args.warmup} warm-up, interleaved round-robin per size; "
        f"{meta['torch_threads']} torch threads; zero_ext {zero_ext.__version__}, ISA {meta['zero_ext_cpu_isa']}",
        f"- roofline: the best-measured of {', '.join(ROOFLINES)} in the same run (largest size: **{roofline}**)",
        "",
        harness.markdown_table(HEADERS, table_rows(rows)),
        "",
        f"Bytes per element credited: {credits}, the --all flavours {USEFUL} "
        "(zero_ext and torch_pipeline: the 28 useful bytes; the pipeline moves 40).",
        "",
        f"Targets at {_size(rows[-1]['numel'])}:",
        "",
        "```",
        *lines,
        "```",
        "",
        *[f"- {n}" for n in notes if n],
    ]
    payload = dict(numel=[r["numel"] for r in rows], reps=args.reps, warmup=args.warmup, roofline=roofline)
    payload.update(rows=rows, verdicts=lines, notes=notes)
    written = harness.write_results(name, meta, payload, "\n".join(body), args.out_dir)
    csv_meta = {k: meta[k] for k in ("device", "date", "commit", "torch", "load_avg_1m", "command", "torch_threads")}
    csv_meta.update(zero_ext=zero_ext.__version__, cpu_isa=meta["zero_ext_cpu_isa"], reps=args.reps)
    csv_rows = [
        {**csv_meta, **{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()}, "roofline": roofline}
        for r in rows
    ]
    return written + [harness.append_csv(os.path.join(args.out_dir, "fused_adamw.csv"), csv_rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="26", help="log2 of the element counts, comma-separated (default: 26)")
    p.add_argument("--numel", type=int, default=None, help="one element count instead of --sizes (any number)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--all", action="store_true", help="also every other torch Adam/AdamW flavour (and DeepSpeed)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", default=str(harness.RESULTS), help="default: bench/results")
    p.add_argument(
        "--name",
        default=None,
        help="result file stem (default: fused_adamw_<device>, or "
        "fused_adamw_sizes_<device> for several sizes);\nrows are appended to <out-dir>/fused_adamw.csv",
    )
    p.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error("--reps must be >= 2")
    device = torch.device(harness.resolve_device(args.device))
    sizes = [args.numel] if args.numel else sorted(2 ** int(s) for s in args.sizes.split(","))
    meta = harness.meta(device)  # at the start: the commit and load the run started with
    meta["torch_threads"] = torch.get_num_threads()
    print(f"fused_adamw_ benchmark: {meta['device']}, {args.reps} reps (+{args.warmup} warm-up)", flush=True)
    rows, skipped, note, roofline = [], [], "", None
    for n in sizes:
        need = n * (BUFFER_BYTES + (len(EXTRA) + 1) * EXTRA_BUFFER_BYTES * args.all)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else harness.free_memory_bytes()
        if need > 0.7 * free:
            skipped.append(f"{_size(n)}: skipped, needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")
            print(skipped[-1], flush=True)
            continue
        contenders, note = make_contenders(n, device, args.all)
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        timed = {name: (lambda fn=fn: harness.timed(fn, sync)) for name, fn in contenders.items()}
        size_rows, roofline = summarize(harness.round_robin(timed, args.warmup, args.reps), n)
        del contenders, timed
        rows += size_rows
        print(harness.text_table(HEADERS, table_rows(size_rows)), flush=True)
    if not rows:
        print("nothing measured")
        return 1
    largest = [r for r in rows if r["numel"] == rows[-1]["numel"]]  # sizes run in ascending order
    lines = verdicts(largest, roofline, device.type)
    print("\n".join(lines + [note, *skipped]))
    if args.no_write:
        return 0
    name = args.name or (f"fused_adamw_{device.type}" if len(sizes) == 1 else f"fused_adamw_sizes_{device.type}")
    written = write(name, args, meta, rows, roofline, lines, [note, *skipped])
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
