"""zero_ext.ops.fused_adamw_ (bf16 grad -> fp32 master/m/v -> bf16 param) against the torch alternatives.

    python bench/bench_fused_adamw.py                            # CPU, 2^26 elements: the headline and its targets
    python bench/bench_fused_adamw.py --device cuda              # on a GPU machine
    python bench/bench_fused_adamw.py --sizes 20,22,24,26 --all  # every torch Adam/AdamW flavour, several sizes
    python bench/bench_fused_adamw.py --device cuda --precision  # + every precision setting (issue 37's targets)

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
  with --precision: zero_ext_<setting> for every other precision setting (precision_settings.py: remainders,
                  bf16 moments with and without remainders, int8 moments with and without remainders), each the
                  kernel the engine calls, credited with the bytes it must move (26, 20, 18, 16.25, 14.25); their
                  verdicts: >= 85% of the copy bandwidth on CUDA, >= 80% of the roofline on CPU, and each step's
                  time over the default's (zero_ext's, ratio of medians) within issue 37's target

Copy bandwidth. A plain dst.copy_(src) of a large fp32 buffer (--copy-mib, default 1 GiB: far beyond any L2 or
L3), credited with read + write bytes, timed interleaved with the contenders of every size (the same rounds, so
the same machine noise); on CPU it runs on the torch threads the kernels use. Every row reports "% of copy BW"
against it. The CUDA target is per row: >= 85% of the copy bandwidth (H100/H200), PASS/FAIL in the row.

Roofline (the CPU target). copy writes to lines it has not read, and a CPU reads a line before writing it
(write-allocate): it moves 12 bytes/element while it is credited with 8, so it understates the bandwidth. AdamW's
streams are mostly in place (master, m, v are read and written back), which pays no such penalty; scale_inplace and
add_inplace are streams of that shape. The roofline is the best GB/s of copy, scale_inplace and add_inplace
measured at the same size (the report names which); "% of copy" (the same-size copy) is kept for older rows.

Bytes per element (the "B/elem" column; GB/s = B/elem x n / median time). The mixed-precision update needs 28
B/element (bf16 grad r 2, fp32 master r/w 8, m r/w 8, v r/w 8, bf16 param w 2): zero_ext and torch_pipeline use
these 28 bytes (the pipeline actually moves 40: + 6 for the grad upcast + 6 for the param downcast). torch_fused is
credited with what it moves (28 B: p, m, v r/w, fp32 grad r), torch_foreach with 80 B (eight passes: p*=, lerp m,
v*=, addcmul v, sqrt, /, +eps, addcdiv p); the --all flavours with the 28 useful bytes.

Targets (PASS/FAIL in the output, exit status 0 either way): CPU, at the largest size, >= 85% of the roofline and
>= 1.3x the pipeline; CUDA >= 85% of the copy bandwidth (every row, and zero_ext's verdict at every size) and, at the
largest size, >= 1.35x the pipeline. CUDA times are CUDA events around each call. Sizes whose buffers would not fit
in 70% of the available memory are skipped with a message.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import precision_settings  # noqa: E402
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
# (what the fraction is of, the fraction, speedup vs pipeline). CUDA: a kernel that reads and writes each byte once
# can reach a plain copy's rate, so 85% of it; a CPU's copy pays write-allocate, hence the in-place roofline there.
TARGETS = {"cpu": ("roofline", 0.85, 1.30), "cuda": ("copy_bw", 0.85, 1.35)}
# --precision rows: the other settings' (issue 37): on CPU each at >= 80% of the roofline (its int8 and bf16 paths
# compute more per byte than the default), on CUDA at the same 85% of the copy bandwidth as the default
PRECISION = "zero_ext_"  # row name prefix: zero_ext_<setting>
PRECISION_FRACTION = {"cpu": 0.80, "cuda": TARGETS["cuda"][1]}
COPY_BW = "copy_bw"  # the large-buffer copy's name among the timed callables (not a row)


def _adam(cls, init: torch.Tensor, grad: torch.Tensor, **kind):
    p = init.clone().requires_grad_()
    p.grad = grad.to(torch.float32).clone()
    h = HYPER
    return p, cls([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"], **kind)


def copy_buffers(mib: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The large copy's fp32 source and destination, every page written first (an untouched CPU page reads as the
    shared zero page, from cache), the source random (zeros can run faster than real data)."""
    n = mib * 2**20 // 4
    return torch.empty(n, device=device).uniform_(), torch.empty(n, device=device).fill_(1.0)


def l3_bytes() -> int:
    """This CPU's last-level cache (0 if unknown), to say how far beyond it the copy buffer is."""
    try:
        size = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
        return int(size.rstrip("KM")) * (2**20 if size.endswith("M") else 2**10)
    except (OSError, ValueError):
        return 0


def timer(device: torch.device) -> Callable[[Callable], float]:
    """Seconds one call takes: CUDA events around it on the GPU (no host round trip in the time), the host clock
    on CPU."""
    if device.type != "cuda":
        return harness.timed

    def cuda_timed(fn: Callable) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return cuda_timed


def make_contenders(n: int, device: torch.device, everything: bool, precision: bool = False) -> tuple[dict, str]:
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
    if precision:
        others = [s for s in precision_settings.BYTES if s != "default"]
        for setting, fn in precision_settings.steps(init, grad_bf16, others).items():
            out[PRECISION + setting] = _numbered(fn)
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


def _numbered(fn: Callable[[float], None]) -> Callable[[], None]:
    """``fn(step)`` with the step number counting up from 1 at each call (bias correction moves as in training)."""
    step = [0]

    def call():
        step[0] += 1
        fn(float(step[0]))

    return call


def credited_bytes(name: str) -> float:
    if name.startswith(PRECISION) and name[len(PRECISION) :] in precision_settings.BYTES:
        return precision_settings.BYTES[name[len(PRECISION) :]]
    return ROOFLINES.get(name) or CORE.get(name) or USEFUL


def copy_bandwidth(times: list, copy_numel: int, n: int, threads: int) -> dict:
    """The large copy's GB/s (read + write bytes) from its times in the rounds of size ``n``."""
    s = harness.summary(times)
    return dict(numel=n, buffer_bytes=4 * copy_numel, threads=threads, median_ms=s["median_s"] * 1e3,
                iqr_ms=(s["q3_s"] - s["q1_s"]) * 1e3, gb_per_s=8 * copy_numel / s["median_s"] / 1e9)  # fmt: skip


def summarize(times: dict, n: int, copy_bw: dict, device_type: str) -> tuple[list[dict], str]:
    """Rows per contender, and the name of the roofline (the best-measured of ROOFLINES)."""
    stats = {name: harness.summary(t) for name, t in times.items()}
    gbs = {name: credited_bytes(name) * n / s["median_s"] / 1e9 for name, s in stats.items()}
    roofline = max(ROOFLINES, key=gbs.get)
    pipeline, ours = stats["torch_pipeline"]["median_s"], stats["zero_ext"]["median_s"]
    of, frac, _ = TARGETS[device_type]
    rows = []
    for name, s in stats.items():
        pct_bw = 100 * gbs[name] / copy_bw["gb_per_s"]
        rows.append(
            dict(
                numel=n,
                contender=name,
                median_ms=s["median_s"] * 1e3,
                min_ms=s["min_s"] * 1e3,
                max_ms=s["max_s"] * 1e3,
                iqr_ms=(s["q3_s"] - s["q1_s"]) * 1e3,
                bytes_per_element=credited_bytes(name),
                gb_per_s=gbs[name],
                pct_of_copy_bw=pct_bw,
                pct_of_roofline=100 * gbs[name] / gbs[roofline],
                pct_of_copy=100 * gbs[name] / gbs["copy"],
                speedup_vs_pipeline=pipeline / s["median_s"],
                time_vs_zero_ext=s["median_s"] / ours,
                target=("PASS" if pct_bw >= 100 * frac else "FAIL") if of == COPY_BW else "",
            )
        )
    return rows, roofline


def precision_verdicts(rows: list[dict], device_type: str) -> list[str]:
    """--precision: each other setting at the largest size, against its bandwidth target (CUDA: the copy bandwidth;
    CPU: the roofline) and issue 37's time target over the default step (zero_ext's row, ratio of medians)."""
    largest = max(r["numel"] for r in rows)
    frac = PRECISION_FRACTION[device_type]
    lines = []
    for r in rows:
        if r["numel"] != largest or not r["contender"].startswith(PRECISION):
            continue
        setting = r["contender"][len(PRECISION) :]
        pct, of = (
            (r["pct_of_copy_bw"], "the copy bandwidth")
            if device_type == "cuda"
            else (r["pct_of_roofline"], "the roofline")
        )
        ok = pct >= 100 * frac
        line = f"{'PASS' if ok else 'FAIL'}: {setting} at {_size(largest)}: {r['gb_per_s']:.1f} GB/s ({r['bytes_per_element']} B/element) = {pct:.0f}% of {of} (target >= {100 * frac:.0f}%)"
        target = precision_settings.TARGETS.get(setting)
        ratio = r["time_vs_zero_ext"]
        if target is not None:
            line += (
                f"; {'PASS' if ratio <= target else 'FAIL'}: {ratio:.2f}x the default step's time (target <= {target})"
            )
        else:
            line += f"; {ratio:.2f}x the default step's time"
        lines.append(line)
    return lines


def verdicts(rows: list[dict], roofline: str, copy_bws: list[dict], device_type: str) -> list[str]:
    """CPU: roofline and speedup at the largest size. CUDA: the copy-bandwidth target at every size, then the
    speedup at the largest."""
    of, frac, speedup = TARGETS[device_type]
    ours = [r for r in rows if r["contender"] == "zero_ext"]
    lines = []
    if of == COPY_BW:
        for r, bw in zip(ours, copy_bws):
            lines.append(
                f"{r['target']}: zero_ext at {_size(r['numel'])}: {r['gb_per_s']:.0f} GB/s "
                f"({r['bytes_per_element']} B/element) = {r['pct_of_copy_bw']:.0f}% of the copy bandwidth "
                f"({bw['gb_per_s']:.0f} GB/s, {bw['buffer_bytes'] / 2**30:.2g} GiB buffer; target >= {100 * frac:.0f}%)"
            )
    else:
        r = ours[-1]
        lines.append(
            f"{'PASS' if r['pct_of_roofline'] >= 100 * frac else 'FAIL'}: zero_ext at {r['pct_of_roofline']:.0f}% "
            f"of the roofline ({roofline}; target >= {100 * frac:.0f}%); {r['pct_of_copy_bw']:.0f}% of the copy "
            f"bandwidth, {r['pct_of_copy']:.0f}% of copy"
        )
    r = ours[-1]
    lines.append(
        f"{'PASS' if r['speedup_vs_pipeline'] >= speedup else 'FAIL'}: zero_ext {r['speedup_vs_pipeline']:.2f}x "
        f"the torch mixed-precision pipeline (target >= {speedup:.2f}x)"
    )
    return lines + precision_verdicts(rows, device_type)


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
            r["bytes_per_element"],
            f"{r['gb_per_s']:.1f}",
            f"{r['pct_of_copy_bw']:.0f}%",
            r["target"] or "-",
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
    "B/elem",
    "GB/s",
    "% of copy BW",
    f">= {100 * TARGETS['cuda'][1]:.0f}% copy BW",
    "% of roofline",
    "% of copy",
    "speedup vs pipeline",
    "time vs zero_ext",
]


def copy_line(bw: dict) -> str:
    return (f"copy bandwidth at {_size(bw['numel'])}'s rounds: {bw['gb_per_s']:.1f} GB/s (dst.copy_(src) of a "
            f"{bw['buffer_bytes'] / 2**30:.3g} GiB fp32 buffer, read + write; median {bw['median_ms']:.2f} ms, IQR "
            f"{bw['iqr_ms']:.2f} ms; {bw['threads']} threads)")  # fmt: skip


def write(name: str, args, meta: dict, rows: list, roofline: str, copy_bws: list, lines: list, notes: list) -> list:
    """<out-dir>/<name>.{json,md}, and the rows appended to <out-dir>/fused_adamw.csv (earlier rows kept)."""
    credits = ", ".join(f"{k} {credited_bytes(k)}" for k in {**ROOFLINES, **CORE})
    body = [
        f"- {args.reps} repetitions after {args.warmup} warm-up, interleaved round-robin per size; "
        f"{meta['torch_threads']} torch threads; zero_ext {zero_ext.__version__}, ISA {meta['zero_ext_cpu_isa']}",
        *[f"- {copy_line(bw)}" for bw in copy_bws],
        f"- roofline: the best-measured of {', '.join(ROOFLINES)} in the same run (largest size: **{roofline}**)",
        "",
        harness.markdown_table(HEADERS, table_rows(rows)),
        "",
        f"Bytes per element credited: {credits}, the --all flavours {USEFUL} "
        "(zero_ext and torch_pipeline: the 28 useful bytes; the pipeline moves 40).",
        "",
        "Targets:",
        "",
        "```",
        *lines,
        "```",
        "",
        *[f"- {n}" for n in notes if n],
    ]
    payload = dict(numel=[r["numel"] for r in rows], reps=args.reps, warmup=args.warmup, roofline=roofline)
    payload.update(copy_bandwidth=copy_bws, rows=rows, verdicts=lines, notes=notes)
    written = harness.write_results(name, meta, payload, "\n".join(body), args.out_dir)
    csv_meta = {k: meta[k] for k in ("device", "date", "commit", "torch", "load_avg_1m", "command", "torch_threads")}
    csv_meta.update(zero_ext=zero_ext.__version__, cpu_isa=meta["zero_ext_cpu_isa"], reps=args.reps)
    bw_of = {bw["numel"]: f"{bw['gb_per_s']:.4g}" for bw in copy_bws}
    csv_rows = [
        {
            **csv_meta,
            **{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()},
            "roofline": roofline,
            "copy_bw_gb_per_s": bw_of[r["numel"]],
        }  # fmt: skip
        for r in rows
    ]
    return written + [harness.append_csv(os.path.join(args.out_dir, "fused_adamw.csv"), csv_rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="26", help="log2 of the element counts, comma-separated (default: 26)")
    p.add_argument("--numel", type=int, default=None, help="one element count instead of --sizes (any number)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--all", action="store_true", help="also every other torch Adam/AdamW flavour (and DeepSpeed)")
    p.add_argument("--precision", action="store_true", help="also every other precision setting (issue 37's targets)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", default=str(harness.RESULTS), help="default: bench/results")
    p.add_argument(
        "--name",
        default=None,
        help="result file stem (default: fused_adamw_<device>, or "
        "fused_adamw_sizes_<device> for several sizes);\nrows are appended to <out-dir>/fused_adamw.csv",
    )
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB of the copy-bandwidth buffer (default: 1 GiB)")
    p.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error("--reps must be >= 2")
    device = torch.device(harness.resolve_device(args.device))
    sizes = [args.numel] if args.numel else sorted(2 ** int(s) for s in args.sizes.split(","))
    meta = harness.meta(device)  # at the start: the commit and load the run started with
    meta["torch_threads"] = torch.get_num_threads()
    print(f"fused_adamw_ benchmark: {meta['device']}, {args.reps} reps (+{args.warmup} warm-up)", flush=True)
    src, dst = copy_buffers(args.copy_mib, device)  # held for the whole run: ~2x --copy-mib
    copy_notes = []
    if device.type == "cpu" and src.numel() * 4 < 8 * l3_bytes():
        copy_notes.append(f"the copy buffer ({args.copy_mib} MiB) is not far beyond L3 ({l3_bytes() / 2**20:.0f} "
                          "MiB): the copy bandwidth is partly the cache's")  # fmt: skip
    time_one = timer(device)
    rows, copy_bws, skipped, note, roofline = [], [], [], "", None
    for n in sizes:
        need = n * (BUFFER_BYTES + (len(EXTRA) + 1) * EXTRA_BUFFER_BYTES * args.all)
        need += n * sum(v for k, v in precision_settings.HELD_BYTES.items() if k != "default") * args.precision
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else harness.free_memory_bytes()
        if need > 0.7 * free:
            skipped.append(f"{_size(n)}: skipped, needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")
            print(skipped[-1], flush=True)
            continue
        contenders, note = make_contenders(n, device, args.all, args.precision)
        contenders[COPY_BW] = lambda: dst.copy_(src)
        timed = {name: (lambda fn=fn: time_one(fn)) for name, fn in contenders.items()}
        times = harness.round_robin(timed, args.warmup, args.reps)
        copy_bws.append(copy_bandwidth(times.pop(COPY_BW), src.numel(), n, torch.get_num_threads()))
        size_rows, roofline = summarize(times, n, copy_bws[-1], device.type)
        del contenders, timed
        rows += size_rows
        print(harness.text_table(HEADERS, table_rows(size_rows)), flush=True)
        print(copy_line(copy_bws[-1]), flush=True)
    if not rows:
        print("nothing measured")
        return 1
    lines = verdicts(rows, roofline, copy_bws, device.type)
    print("\n".join(lines + [note, *copy_notes, *skipped]))
    if args.no_write:
        return 0
    name = args.name or (f"fused_adamw_{device.type}" if len(sizes) == 1 else f"fused_adamw_sizes_{device.type}")
    written = write(name, args, meta, rows, roofline, copy_bws, lines, [note, *copy_notes, *skipped])
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
