"""Does ZeroAdamW's gradient reduce-scatter overlap backward compute? The PyTorch profiler's answer, on one GPU.

    python bench/profile_overlap.py                    # one CUDA GPU, NCCL at world size 1, stage 2
    python bench/profile_overlap.py --stage 1 --trace  # also write the chrome trace next to the results

The benchmark GPT (bench/gpt_model.py; default here d_model 1024, 8 layers, 16 heads, seq 512, batch 8: backward
takes milliseconds on an H100) trains with bf16 params + bf16 autocast under ZeroAdamW on a one-rank NCCL process
group. At one rank ZeroAdamW normally skips communication; this script sets
``zero_ext.reducer.GradReducer.direct_at_one_rank = False`` first, so the path several GPUs take runs: staging
casts, the reduce-scatter issued on the communication stream during backward, events, the all-gather in step().
After --warmup steps, the profiler (CPU + CUDA activities) records one more warm-up step and then --steps steps.

What is measured, from the profiler's device timeline:
  - communication = device activity whose name contains "nccl" (ncclDevKernel_ReduceScatter_*, ...) or that was
    launched inside zero_ext's reduce-scatter / all-gather call (this script wraps them in record_function ranges
    and follows the profiler's launch -> device correlation ids). The second rule matters at one rank: NCCL then
    runs an out-of-place reduce-scatter as a device-to-device cudaMemcpyAsync (no kernel with "nccl" in its
    name) and an in-place all-gather as nothing at all;
  - compute = every other kernel;
  - the backward window = the device-time span of backward's compute (see :func:`extract`);
  - for the reduce-scatters: count, time (union of their intervals), the part of that time during which compute
    kernels of the backward window ran on *other* streams (interval unions: two concurrent compute kernels count
    once, a kernel on the collective's own stream never counts), that fraction, and how many started before
    backward ended. The same for the all-gathers against the optimizer step's compute.

Verdict: "PASS: reduce-scatter overlaps backward (X% of its time)" when X >= 50, else FAIL. Results:
``results/profile_overlap_cuda.{md,json}`` (+ ``profile_overlap_cuda_trace.json`` with --trace). Exit status:
0 PASS, 1 FAIL, 2 when there is no CUDA GPU / NCCL / CUDA build of zero_ext (nothing measured).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from gpt_model import GPT, MarkovData, add_model_args, model_config, num_params  # noqa: E402
from torch.profiler import record_function  # noqa: E402

# record_function names: the CPU-side ranges the analysis keys on.
BACKWARD = "zero_ext_bench.backward"
STEP = "zero_ext_bench.step"
REDUCE_SCATTER = "zero_ext_bench.reduce_scatter"
ALL_GATHER = "zero_ext_bench.all_gather"
THRESHOLD = 0.5  # the reduce-scatter must be overlapped for at least this fraction of its time

Interval = tuple[float, float]


# ---------------------------------------------------------------------------------------------- interval algebra
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as ``intervals`` (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two outputs of :func:`union` (sorted and disjoint), itself sorted and disjoint."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def measure(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


# ---------------------------------------------------------------------------------------------- pure analysis
@dataclass(frozen=True)
class DeviceEvent:
    """One kernel (or copy) on the device timeline. ``collective``: what launched it, when known from the CPU side
    ("reduce_scatter" / "all_gather"); otherwise the name decides (:func:`classify`)."""

    name: str
    stream: int
    start: float  # us
    end: float  # us
    collective: Optional[str] = None


def as_event(e: Any) -> DeviceEvent:
    """A :class:`DeviceEvent` from itself or a ``(name, stream, start_us, end_us[, collective])`` tuple."""
    return e if isinstance(e, DeviceEvent) else DeviceEvent(*e)


def classify(e: Any) -> str:
    """The event's kind: "reduce_scatter", "all_gather", "other_comm" or "compute".

    A known ``collective`` decides; otherwise a name containing "nccl" (case-insensitive) is communication, the
    collective read from it with underscores ignored (ncclDevKernel_ReduceScatter_*, ncclKernel_AllGather_*), and
    every other name is compute."""
    e = as_event(e)
    if e.collective:
        return e.collective
    name = e.name.lower()
    if "nccl" not in name:
        return "compute"
    flat = name.replace("_", "").replace(" ", "")
    if "reducescatter" in flat:
        return "reduce_scatter"
    if "allgather" in flat:
        return "all_gather"
    return "other_comm"


def collective_overlap(events: Iterable[Any], kind: str, windows: Optional[Sequence[Interval]]) -> dict[str, Any]:
    """How much of the ``kind`` collectives' device time had compute running beside it.

    Overlapped time = measure(U over streams s of [U(kind on s) ∩ U(compute on streams != s) ∩ U(windows)]):
    compute kernels that overlap each other count once, compute on the collective's own stream never counts (it
    cannot run concurrently with it), and with ``windows`` (e.g. the backward windows) only compute inside them
    counts. ``windows=None``: all compute counts, and ``started_in_window`` is None.
    """
    evs = [as_event(e) for e in events]
    comm = [e for e in evs if classify(e) == kind]
    compute = [e for e in evs if classify(e) == "compute"]
    win = union(windows) if windows is not None else None
    others_of: dict[int, list[Interval]] = {}
    for s in sorted({e.stream for e in comm}):
        others = union((c.start, c.end) for c in compute if c.stream != s)
        others_of[s] = intersect(others, win) if win is not None else others
    overlapped: list[Interval] = []
    for s, others in others_of.items():
        overlapped += intersect(union((e.start, e.end) for e in comm if e.stream == s), others)
    total = measure(union((e.start, e.end) for e in comm))
    over = measure(union(overlapped))
    per_event = [
        {
            "name": e.name,
            "stream": e.stream,
            "start_us": e.start,
            "dur_us": e.end - e.start,
            "overlapped_us": measure(intersect([(e.start, e.end)], others_of[e.stream])) if e.end > e.start else 0.0,
        }
        for e in sorted(comm, key=lambda e: (e.start, e.stream))
    ]
    return {
        "count": len(comm),
        "time_us": total,
        "overlapped_us": over,
        "overlap_fraction": over / total if total > 0 else None,
        # Started inside a window (at or after its start, strictly before its end): started before backward ended.
        "started_in_window": None if win is None else sum(1 for e in comm if any(a <= e.start < b for a, b in win)),
        "streams": sorted({e.stream for e in comm}),
        "events": per_event,
    }


def analyze_overlap(
    events: Iterable[Any], backward_windows: Sequence[Interval], step_windows: Optional[Sequence[Interval]] = None
) -> dict[str, Any]:
    """The whole report from device events and the device-time windows of backward (and of the optimizer step).

    ``events``: :class:`DeviceEvent` or ``(name, stream, start_us, end_us[, collective])``; every event is either
    communication or compute (see :func:`classify`). Reduce-scatters are compared with the compute of
    ``backward_windows``, all-gathers with the compute of ``step_windows`` (all compute when None).
    """
    evs = [as_event(e) for e in events]
    other = [e for e in evs if classify(e) == "other_comm"]
    compute = [e for e in evs if classify(e) == "compute"]
    rs = collective_overlap(evs, "reduce_scatter", backward_windows)
    return {
        "reduce_scatter": rs,
        "reduce_scatter_started_before_backward_end": bool(rs["started_in_window"]),
        "all_gather": collective_overlap(evs, "all_gather", step_windows),
        "other_comm": {"count": len(other), "time_us": measure(union((e.start, e.end) for e in other))},
        "compute": {
            "count": len(compute),
            "time_us": measure(union((e.start, e.end) for e in compute)),
            "streams": sorted({e.stream for e in compute}),
        },
        "backward_windows": [list(w) for w in backward_windows],
        "step_windows": None if step_windows is None else [list(w) for w in step_windows],
    }


def verdict(report: dict[str, Any], threshold: float = THRESHOLD) -> str:
    """The one-line verdict on the reduce-scatter's overlap with backward."""
    rs = report["reduce_scatter"]
    if not rs["count"] or rs["overlap_fraction"] is None:
        return "FAIL: no reduce-scatter found on the device timeline (nothing to overlap)"
    pct = 100 * rs["overlap_fraction"]
    if rs["overlap_fraction"] >= threshold:
        return f"PASS: reduce-scatter overlaps backward ({pct:.0f}% of its time)"
    return f"FAIL: reduce-scatter overlaps backward for only {pct:.0f}% of its time (< {100 * threshold:.0f}%)"


# ---------------------------------------------------------------------------------------------- trace -> events
_KERNEL_CATS = {"kernel"}
_COPY_CATS = {"gpu_memcpy", "gpu_memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_MARKS = {BACKWARD: "backward", STEP: "step", REDUCE_SCATTER: "reduce_scatter", ALL_GATHER: "all_gather"}


def _stream_id(ev: dict[str, Any]) -> int:
    """A device event's stream: ``args.stream``, else the trace row (``tid``, an int or e.g. "stream 7")."""
    v = (ev.get("args") or {}).get("stream", ev.get("tid", -1))
    if isinstance(v, (int, float)):
        return int(v)
    digits = "".join(c for c in str(v) if c.isdigit())
    return int(digits) if digits else -1


def _range_of(ts: Optional[float], ranges: Sequence[Interval]) -> Optional[int]:
    if ts is None:
        return None
    return next((i for i, (a, b) in enumerate(ranges) if a <= ts <= b), None)


def _window(events: Sequence[DeviceEvent]) -> Optional[Interval]:
    """The device-time span of a phase: first start to last end of its compute on its main stream."""
    busy: dict[int, float] = {}
    for e in events:
        busy[e.stream] = busy.get(e.stream, 0.0) + (e.end - e.start)
    if not busy:
        return None
    main = max(busy, key=lambda s: (busy[s], -s))
    mine = [e for e in events if e.stream == main]
    return (min(e.start for e in mine), max(e.end for e in mine))


def extract(trace: Any) -> dict[str, Any]:
    """Device events and phase windows from a chrome trace (``prof.export_chrome_trace``'s JSON, loaded).

    A device event (kernel, memcpy, memset) is tied to the CPU call that launched it by the profiler's correlation
    id (``args.correlation`` on both); its phase is the ``record_function`` range (backward, step, reduce-scatter,
    all-gather) that the launch's CPU timestamp falls in. Ranges are matched by time, not thread: backward's
    kernels are launched from autograd's device thread while the range was opened on the main thread, and the
    main thread is blocked in ``loss.backward()`` / ``opt.step()`` meanwhile, so nothing else launches then.

    Backward window (one per profiled step): the span from the first start to the last end of the compute kernels
    launched inside the backward range *on the stream that ran most of that compute* (the compute stream). Why:
    the CPU range is the wrong clock (kernels run later than they are launched); the span of everything launched
    in it would include the collectives of the last buckets, which by construction run after backward's compute,
    and zero_ext's follow-up kernels on its communication stream (stage 2 accumulates each reduced shard there),
    which end after the last collective; both would stretch the window past the end of backward's compute and
    count the tail collective as "inside backward". The step windows are built the same way from the step range.

    Copies and memsets launched outside the collective ranges are neither communication nor compute: they are
    left out of the events (and counted per stream in ``streams``).
    """
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    launches: dict[Any, float] = {}
    ranges: dict[str, list[Interval]] = {v: [] for v in _MARKS.values()}
    device = []
    for ev in raw:
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        args = ev.get("args") or {}
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if cat in _KERNEL_CATS or cat in _COPY_CATS:
            device.append((cat, str(ev.get("name", "")), _stream_id(ev), ts, ts + dur, args.get("correlation")))
        elif cat in _LAUNCH_CATS and args.get("correlation") is not None:
            launches[args["correlation"]] = ts
        elif ev.get("name") in _MARKS and not cat.startswith("gpu"):  # not the device-side gpu_user_annotation
            ranges[_MARKS[ev["name"]]].append((ts, ts + dur))
    for v in ranges.values():
        v.sort()

    events: list[DeviceEvent] = []
    phase_of: list[tuple[Optional[int], Optional[int]]] = []  # (backward range, step range) of each event
    streams: dict[int, dict[str, Any]] = {}
    unmatched = 0
    for cat, name, stream, start, end, corr in device:
        launched = launches.get(corr) if corr is not None else None
        unmatched += launched is None
        collective = None
        if _range_of(launched, ranges["reduce_scatter"]) is not None:
            collective = "reduce_scatter"
        elif _range_of(launched, ranges["all_gather"]) is not None:
            collective = "all_gather"
        st = streams.setdefault(stream, {"kernels": 0, "copies": 0, "collective_copies": 0, "spans": []})
        st["spans"].append((start, end))
        if cat in _COPY_CATS:
            st["copies"] += 1
            if collective is None:
                continue
            st["collective_copies"] += 1
        else:
            st["kernels"] += 1
        events.append(DeviceEvent(name, stream, start, end, collective))
        phase_of.append((_range_of(launched, ranges["backward"]), _range_of(launched, ranges["step"])))

    def windows(which: int, n: int) -> list[Interval]:
        out = []
        for i in range(n):
            w = _window([e for e, ph in zip(events, phase_of) if ph[which] == i and classify(e) == "compute"])
            if w is not None:
                out.append(w)
        return out

    rs_in_backward = sum(1 for e, ph in zip(events, phase_of) if ph[0] is not None and classify(e) == "reduce_scatter")
    return {
        "events": events,
        "backward_windows": windows(0, len(ranges["backward"])),
        "step_windows": windows(1, len(ranges["step"])),
        "cpu_ranges": {k: len(v) for k, v in ranges.items()},
        "reduce_scatters_launched_in_backward": rs_in_backward,
        "device_events_without_launch": unmatched,
        "streams": {
            s: {
                "kernels": v["kernels"],
                "copies": v["copies"],
                "collective_copies": v["collective_copies"],
                "busy_us": measure(union(v["spans"])),
            }
            for s, v in sorted(streams.items())
        },
    }


# ---------------------------------------------------------------------------------------------- the GPU run
@contextlib.contextmanager
def annotated_collectives():
    """Wrap zero_ext's flat reduce-scatter / all-gather calls in record_function ranges, so that the device work
    they launch can be found by correlation id whatever NCCL names it (at one rank: a memcpy, or nothing)."""
    import zero_ext.comm as comm

    saved = comm._reduce_scatter_flat, comm._all_gather_flat

    def annotate(fn, label):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return inner

    comm._reduce_scatter_flat = annotate(saved[0], REDUCE_SCATTER)
    comm._all_gather_flat = annotate(saved[1], ALL_GATHER)
    try:
        yield
    finally:
        comm._reduce_scatter_flat, comm._all_gather_flat = saved


def _why_not_runnable() -> Optional[str]:
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False)"
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return f"needs NCCL (torch {torch.__version__} was built without it)"
    import zero_ext  # noqa: F401

    if not torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::fused_adamw_", "CUDA"):
        return "needs the CUDA build of zero_ext (run `bash scripts/gpu_session.sh build` first)"
    return None


def profile_run(args, device: torch.device, trace_path: Path) -> dict[str, Any]:
    """Build, warm up and profile; returns the run's facts (the trace is written to ``trace_path``)."""
    import zero_ext
    from zero_ext.reducer import GradReducer

    cfg = model_config(args)
    GradReducer.direct_at_one_rank = False  # one rank: take the NCCL reduce-scatter path anyway
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    opt = zero_ext.ZeroAdamW(
        model.named_parameters(),
        lr=1e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        stage=args.stage,
        max_grad_norm=1.0,
        bucket_size=args.bucket_size,
    )
    if opt._reducer._direct:
        raise RuntimeError("ZeroAdamW took the direct one-rank path; the reduce-scatter would not run")
    data = MarkovData(cfg.vocab, cfg.seq_len, seed=args.seed)
    batches = [tuple(t.to(device) for t in data.batch(s, args.batch, 0, 1)) for s in range(4)]

    def train_step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        with record_function(BACKWARD):
            loss.backward()
        with record_function(STEP):
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    with annotated_collectives():
        for i in range(args.warmup):
            train_step(i)
        torch.cuda.synchronize(device)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=args.steps, repeat=1)
        with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
            for i in range(1 + args.steps):
                loss = train_step(args.warmup + i)
                torch.cuda.synchronize(device)  # every kernel of the step has run before the profiler moves on
                prof.step()
    prof.export_chrome_trace(str(trace_path))
    buckets = sum(len(fg.layout.buckets) for fg in opt._flat_groups)
    return {
        "num_params": num_params(model),
        "bucket_size": opt.bucket_size,
        "buckets": buckets,
        "last_loss": float(loss.detach().float()),
        "comm_bytes_total": opt.comm_stats(),
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "model": asdict(cfg),
    }


def _us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def report_markdown(args, run: dict[str, Any], ex: dict[str, Any], rep: dict[str, Any], line: str) -> str:
    rs, ag = rep["reduce_scatter"], rep["all_gather"]
    bw = rep["backward_windows"]
    bw_ms = ", ".join(f"{(b - a) / 1e3:.2f}" for a, b in bw) or "none found"
    st_ms = ", ".join(f"{(b - a) / 1e3:.2f}" for a, b in rep["step_windows"] or []) or "none found"

    def row(label, r, against):
        started = "-" if r["started_in_window"] is None else f"{r['started_in_window']} of {r['count']}"
        streams = ", ".join(str(s) for s in r["streams"]) or "-"
        return [label, r["count"], _us(r["time_us"]), _us(r["overlapped_us"]), _pct(r["overlap_fraction"]),
                started, streams, against]  # fmt: skip

    table = common.markdown_table(
        ["collective", "count", "time us", "overlapped us", "overlapped", "started in window", "streams",
         "compute counted"],
        [row("reduce-scatter", rs, "backward window, other streams"),
         row("all-gather", ag, "optimizer-step window, other streams"),
         ["other NCCL", rep["other_comm"]["count"], _us(rep["other_comm"]["time_us"]), "-", "-", "-", "-", "-"]],
    )  # fmt: skip
    streams = common.markdown_table(
        ["stream", "kernels", "copies (of them: collective)", "busy us"],
        [[s, v["kernels"], f"{v['copies']} ({v['collective_copies']})", _us(v["busy_us"])]
         for s, v in ex["streams"].items()],
    )  # fmt: skip
    m = run["model"]
    lines = [
        f"- GPT: Psi = {run['num_params']:,} params (d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} "
        f"heads, vocab {m['vocab']}), {args.batch} x {m['seq_len']} tokens per step, bf16 params + bf16 autocast",
        f"- ZeroAdamW stage {args.stage}, bucket size {run['bucket_size']:,} elements "
        f"({'--bucket-size' if args.bucket_size else 'engine default'}) -> {run['buckets']} buckets; NCCL "
        f"{run['nccl']}, world size 1, `GradReducer.direct_at_one_rank = False` (the multi-GPU path: comm stream, "
        "events, staging)",
        f"- profiled: {args.steps} steps after {args.warmup} warm-up steps + 1 profiler warm-up step; CPU ranges "
        f"found: {ex['cpu_ranges']}; device events without a launch record: {ex['device_events_without_launch']}",
        f"- backward windows (device time, ms): {bw_ms}; optimizer-step windows (ms): {st_ms}; reduce-scatters "
        f"launched inside backward: {ex['reduce_scatters_launched_in_backward']} of {rs['count']}",
        "",
        table,
        "",
        "Device streams (everything the profiler saw in the active steps):",
        "",
        streams,
        "",
        f"**{line}**",
        "",
        "- overlapped = time during which compute kernels ran on another stream (interval unions: concurrent "
        "compute kernels count once; the collective's own stream never counts); reduce-scatters against the compute "
        "of the backward windows (span of backward's compute on its stream), all-gathers against the step's.",
        "- At one rank NCCL runs an out-of-place reduce-scatter as a device-to-device memcpy on its own stream (no "
        "ncclDevKernel; NCCL's one-rank path) and an in-place all-gather as nothing (so expect 0 all-gathers); the "
        "script finds the copies by correlation id from record_function ranges around zero_ext's collective calls. "
        "What this shows: the stream and event ordering lets bucket k's reduce-scatter run while backward computes "
        "on. A real multi-GPU reduce-scatter is longer and competes for SMs; its overlap has to be measured at N > 1.",
    ]
    return "\n".join(lines)


def write_report(args, meta: dict[str, Any], run: dict[str, Any], ex: dict[str, Any], trace: Optional[Path]) -> int:
    """Analyse the extracted events, print and write ``<out_dir>/<name>.{md,json}``; 0 on PASS, 1 on FAIL."""
    rep = analyze_overlap(ex["events"], ex["backward_windows"], ex["step_windows"])
    line = verdict(rep)
    body = report_markdown(args, run, ex, rep, line)
    print(body)
    payload = {
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "run": run,
        "cpu_ranges": ex["cpu_ranges"],
        "device_events_without_launch": ex["device_events_without_launch"],
        "reduce_scatters_launched_in_backward": ex["reduce_scatters_launched_in_backward"],
        "streams": {str(s): v for s, v in ex["streams"].items()},
        "report": rep,
        "threshold": THRESHOLD,
        "verdict": line,
        "ok": line.startswith("PASS"),
        "trace": None if trace is None else str(trace),
    }
    written = common.write_results(args.name, meta, payload, body, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written + ([trace] if trace is not None else [])))
    return 0 if payload["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.set_defaults(seq_len=512, d_model=1024, layers=8, heads=16)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2])
    p.add_argument("--bucket-size", type=int, default=None, help="ZeroAdamW bucket size (default: the engine's)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the profiler starts")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="also write the chrome trace to the results directory")
    p.add_argument("--out-dir", default=str(common.RESULTS))
    p.add_argument("--name", default="profile_overlap_cuda", help="result file stem")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")

    why = _why_not_runnable()
    if why is not None:
        print(f"bench/profile_overlap.py: {why}; nothing was measured.", file=sys.stderr)
        return 2

    import torch.distributed as dist

    # As in bench/launch.py: torch versions that deprecate the flat-collective names warn on every call.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    meta = common.meta(device)  # at the start: the commit that ran
    fd, store = tempfile.mkstemp(prefix="profile_overlap_store_")
    os.close(fd)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = out_dir / f"{args.name}_trace.json" if args.trace else Path(tmp) / "trace.json"
        dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1)
        try:
            run = profile_run(args, device, trace_path)
        finally:
            dist.destroy_process_group()
            os.remove(store)
        with open(trace_path) as f:
            ex = extract(json.load(f))
    return write_report(args, meta, run, ex, trace_path if args.trace else None)


if __name__ == "__main__":
    sys.exit(main())
