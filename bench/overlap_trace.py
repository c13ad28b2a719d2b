"""The overlap analysis behind bench/profile_overlap.py: interval algebra, device events classified as compute or
collective, how much of each collective's time had compute beside it, and the extraction of device events and phase
windows from a chrome trace. Pure functions of event intervals, no GPU needed (tests/tooling/test_profile_overlap.py
feeds them synthetic timelines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from zero_ext.comm.base import PROFILER_LABELS

# this script's ranges around the phases of a step
FORWARD, BACKWARD, STEP = "zero_ext_bench.forward", "zero_ext_bench.backward", "zero_ext_bench.step"
REDUCE_SCATTER, ALL_GATHER = PROFILER_LABELS["reduce_scatter"], PROFILER_LABELS["all_gather"]
THRESHOLD = 0.5  # the reduce-scatter must be overlapped for at least this fraction of its time
Interval = tuple[float, float]


# ------------------------------------------------------------------------------------------------ interval algebra
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as ``intervals`` (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(e, out[-1][1]))
        else:
            out.append((s, e))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two outputs of :func:`union`, itself sorted and disjoint."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return out


def measure(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


# ------------------------------------------------------------------------------------------------ analysis
@dataclass(frozen=True)
class DeviceEvent:
    """One kernel or copy on the device timeline; ``collective``: what launched it, when the CPU side says so;
    ``phase``: the step phase ("forward", "backward", "step") its launch fell in, when known."""

    name: str
    stream: int
    start: float  # us
    end: float  # us
    collective: Optional[str] = None
    phase: Optional[str] = None


def _events(events: Iterable[Any]) -> list[DeviceEvent]:
    """DeviceEvents, or ``(name, stream, start_us, end_us[, collective])`` tuples, as DeviceEvents."""
    return [e if isinstance(e, DeviceEvent) else DeviceEvent(*e) for e in events]


def _busy(events: Iterable[DeviceEvent]) -> list[Interval]:
    return union((e.start, e.end) for e in events)


def classify(e: Any) -> str:
    """One of "reduce_scatter", "all_gather", "other_comm", "compute": a known ``collective`` decides, else a name
    containing "nccl" is communication (which one read from the name, underscores ignored), else compute."""
    e = _events([e])[0]
    name = e.name.lower()
    if e.collective or "nccl" not in name:
        return e.collective or "compute"
    flat = name.replace("_", "").replace(" ", "")
    return "reduce_scatter" if "reducescatter" in flat else "all_gather" if "allgather" in flat else "other_comm"


def collective_overlap(events: Iterable[Any], kind: str, windows: Optional[Sequence[Interval]]) -> dict[str, Any]:
    """How much of the ``kind`` collectives' device time had compute beside it: the union over streams s of
    U(kind on s) ∩ U(compute on streams != s) ∩ U(windows). Concurrent compute kernels count once, compute on the
    collective's own stream never counts; ``windows=None``: all compute counts (``started_in_window`` is None)."""
    evs = _events(events)
    comm = sorted((e for e in evs if classify(e) == kind), key=lambda e: (e.start, e.stream))
    win = union(windows) if windows is not None else None
    beside: dict[int, list[Interval]] = {}  # per collective stream: compute time on the other streams
    for s in {e.stream for e in comm}:
        others = _busy(c for c in evs if classify(c) == "compute" and c.stream != s)
        beside[s] = intersect(others, win) if win is not None else others
    over = [iv for s, o in beside.items() for iv in intersect(_busy(e for e in comm if e.stream == s), o)]
    total = measure(_busy(comm))
    per_event = [
        dict(name=e.name, stream=e.stream, start_us=e.start, dur_us=e.end - e.start,
             overlapped_us=measure(intersect(union([(e.start, e.end)]), beside[e.stream])))
        for e in comm
    ]  # fmt: skip
    return {
        "count": len(comm),
        "time_us": total,
        "overlapped_us": measure(union(over)),
        "overlap_fraction": measure(union(over)) / total if total > 0 else None,
        # Started inside a window (at or after its start, strictly before its end): before backward ended.
        "started_in_window": None if win is None else sum(any(a <= e.start < b for a, b in win) for e in comm),
        "streams": sorted({e.stream for e in comm}),
        "events": per_event,
    }


def analyze_overlap(events: Iterable[Any], backward_windows: Sequence[Interval], step_windows=None) -> dict[str, Any]:
    """The report: reduce-scatters against the compute of ``backward_windows``, all-gathers against that of
    ``step_windows`` (all compute when None)."""
    evs = _events(events)
    other = [e for e in evs if classify(e) == "other_comm"]
    compute = [e for e in evs if classify(e) == "compute"]
    rs = collective_overlap(evs, "reduce_scatter", backward_windows)
    return {
        "reduce_scatter": rs,
        "reduce_scatter_started_before_backward_end": bool(rs["started_in_window"]),
        "all_gather": collective_overlap(evs, "all_gather", step_windows),
        "other_comm": {"count": len(other), "time_us": measure(_busy(other))},
        "compute": {
            "count": len(compute),
            "time_us": measure(_busy(compute)),
            "streams": sorted({e.stream for e in compute}),
        },
        "backward_windows": [list(w) for w in backward_windows],
        "step_windows": None if step_windows is None else [list(w) for w in step_windows],
    }


def prefetch_overlap(events: Iterable[Any], forward_windows, backward_windows) -> dict[str, Any]:
    """Stage 3: the all-gathers launched in each phase against that phase's compute on other streams (the prefetched
    gather of bucket k+1 beside bucket k's compute). ``overlapped_count``: gathers with any overlap at all."""
    evs = _events(events)
    out = {}
    for phase, windows in (("forward", forward_windows), ("backward", backward_windows)):
        mine = [e for e in evs if classify(e) != "all_gather" or e.phase == phase]
        r = collective_overlap(mine, "all_gather", windows)
        r["overlapped_count"] = sum(e["overlapped_us"] > 0 for e in r["events"])
        out[phase] = r
    return out


def verdict(report: dict[str, Any], threshold: float = THRESHOLD) -> str:
    rs = report["reduce_scatter"]
    if not rs["count"] or rs["overlap_fraction"] is None:
        return "FAIL: no reduce-scatter found on the device timeline (nothing to overlap)"
    pct = 100 * rs["overlap_fraction"]
    line = f"reduce-scatter overlaps backward ({pct:.0f}% of its time)"
    if rs["overlap_fraction"] < threshold:
        return f"FAIL: reduce-scatter overlaps backward for only {pct:.0f}% of its time (< {100 * threshold:.0f}%)"
    for phase, r in (report.get("prefetch") or {}).items():
        if not r["count"]:
            return f"FAIL: {line}, but no all-gather was launched in {phase} (nothing prefetched)"
        frac = r["overlap_fraction"] or 0.0
        if frac < threshold:
            return (f"FAIL: {line}, but the all-gathers launched in {phase} overlap its compute for only "
                    f"{100 * frac:.0f}% of their time (< {100 * threshold:.0f}%)")  # fmt: skip
        line += f"; all-gathers overlap {phase} ({100 * frac:.0f}%, {r['overlapped_count']} of {r['count']})"
    return f"PASS: {line}"


# ------------------------------------------------------------------------------------------------ trace -> events
_MARKS = {FORWARD: "forward", BACKWARD: "backward", STEP: "step", REDUCE_SCATTER: "reduce_scatter",
          ALL_GATHER: "all_gather"}  # fmt: skip
PHASES = ("forward", "backward", "step")


def _stream_id(ev: dict[str, Any]) -> int:
    """A device event's stream: ``args.stream``, else the trace row (``tid``, an int or e.g. "stream 7")."""
    v = (ev.get("args") or {}).get("stream", ev.get("tid", -1))
    if isinstance(v, (int, float)):
        return int(v)
    digits = "".join(c for c in str(v) if c.isdigit())
    return int(digits) if digits else -1


def _range_of(ts: Optional[float], ranges: Sequence[Interval]) -> Optional[int]:
    return None if ts is None else next((i for i, (a, b) in enumerate(ranges) if a <= ts <= b), None)


def _window(events: Sequence[DeviceEvent]) -> Optional[Interval]:
    """A phase's device-time span: first start to last end of its compute on the stream that ran most of it."""
    busy: dict[int, float] = {}
    for e in events:
        busy[e.stream] = busy.get(e.stream, 0.0) + (e.end - e.start)
    if not busy:
        return None
    mine = [e for e in events if e.stream == max(busy, key=lambda s: (busy[s], -s))]
    return (min(e.start for e in mine), max(e.end for e in mine))


def extract(trace: Any) -> dict[str, Any]:
    """Device events and phase windows from a chrome trace (``prof.export_chrome_trace``'s JSON, loaded).

    A device event is tied to its CPU launch by ``args.correlation``, and the launch time puts it in a range (by
    time, not thread: autograd launches backward from its own thread). Inside a collective's range, copies and NCCL
    kernels are the collective, other kernels (its epilogue) compute; other copies are left out. A step's backward
    window is the span of backward's compute on its main stream (not of all it launched, which would stretch over
    the last collective and the epilogues after it); the forward's likewise. Each event carries the phase its launch
    fell in."""
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    launches: dict[Any, float] = {}
    ranges: dict[str, list[Interval]] = {v: [] for v in _MARKS.values()}
    device = []
    for ev in raw:
        cat, args = str(ev.get("cat", "")).lower(), ev.get("args") or {}
        if ev.get("ph") != "X":
            continue
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append(
                (cat != "kernel", str(ev.get("name", "")), _stream_id(ev), ts, ts + dur, args.get("correlation"))
            )
        elif cat in ("cuda_runtime", "cuda_driver") and args.get("correlation") is not None:
            launches[args["correlation"]] = ts
        elif ev.get("name") in _MARKS and not cat.startswith("gpu"):  # not the device-side gpu_user_annotation
            ranges[_MARKS[ev["name"]]].append((ts, ts + dur))
    for v in ranges.values():
        v.sort()
    events, phases, unmatched = [], [], 0
    for is_copy, name, stream, start, end, corr in device:
        launched = launches.get(corr) if corr is not None else None
        unmatched += launched is None
        inside = next((k for k in ("reduce_scatter", "all_gather") if _range_of(launched, ranges[k]) is not None), None)
        collective = inside if inside and (is_copy or "nccl" in name.lower()) else None
        if is_copy and collective is None:
            continue
        where = tuple(_range_of(launched, ranges[ph]) for ph in PHASES)  # (forward, backward, step) range indices
        phase = next((ph for ph, i in zip(PHASES, where) if i is not None), None)
        events.append(DeviceEvent(name, stream, start, end, collective, phase))
        phases.append(where)

    def windows(which: int, n: int) -> list[Interval]:
        found = [
            _window([e for e, ph in zip(events, phases) if ph[which] == i and classify(e) == "compute"])
            for i in range(n)
        ]
        return [w for w in found if w is not None]

    def launched_in(phase: str, kind: str) -> int:
        return sum(1 for e in events if e.phase == phase and classify(e) == kind)

    return {
        "events": events,
        "forward_windows": windows(0, len(ranges["forward"])),
        "backward_windows": windows(1, len(ranges["backward"])),
        "step_windows": windows(2, len(ranges["step"])),
        "cpu_ranges": {k: len(v) for k, v in ranges.items()},
        "reduce_scatters_launched_in_backward": launched_in("backward", "reduce_scatter"),
        "all_gathers_launched_in": {ph: launched_in(ph, "all_gather") for ph in PHASES},
        "device_events_without_launch": unmatched,
    }


def collectives_by_phase(trace: Any) -> dict[str, dict[str, int]]:
    """How many of the engine's collective ranges (CPU side) began inside each phase's range: where the engine
    launched its collectives (stage 3: all-gathers inside forward and backward), readable from a CPU-only profile."""
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    ranges: dict[str, list[Interval]] = {v: [] for v in _MARKS.values()}
    for ev in raw:
        if ev.get("ph") == "X" and ev.get("name") in _MARKS and not str(ev.get("cat", "")).lower().startswith("gpu"):
            ts = float(ev.get("ts", 0.0))
            ranges[_MARKS[ev["name"]]].append((ts, ts + float(ev.get("dur", 0.0))))
    out = {k: dict.fromkeys((*PHASES, "elsewhere"), 0) for k in ("reduce_scatter", "all_gather")}
    for kind, found in out.items():
        for start, _ in ranges[kind]:
            phase = next((ph for ph in PHASES if _range_of(start, ranges[ph]) is not None), "elsewhere")
            found[phase] += 1
    return out
