"""What each precision setting's fused step costs on the CPU, against the default, on one shard: the default
(fp32 master, exp_avg, exp_avg_sq; bf16 grad and param_out), ``param_remainders``, bf16 moments (with and without
remainders), int8 moments and int8 moments with remainders, each the kernel the engine calls for it, round robin in one
process with the in-place streams that make the CPU roofline (bench/bench_fused_adamw.py's: the best GB/s of copy,
scale_inplace and add_inplace at the same size).

    python bench/investigations/precision_kernel_cost.py [--numel 16777216,67108864] [--reps 9]
    python bench/investigations/precision_kernel_cost.py --before /path/to/baseline/checkout --pairs 3

Per setting and size: the median step time, bytes per element (what the setting must move), GB/s, % of the roofline,
and the median of each round's ratio to the default step (the figure issue 37's targets are written for); then each
setting's compute floor (its step in L2 on one core, the call's own cost taken out) and the best ratio to the default
that overlapping that compute perfectly with the setting's bytes at the roofline would give, so a missed target says
whether the instructions or the overlap stand in the way. With
``--before``, each pair launches one child per tree (its own ``zero_ext`` on PYTHONPATH, this script's code),
before then after, and the report puts the two trees' per-round ratios side by side (a ratio to the same child's
default step, so a load swing between children cancels).

Writes precision_kernel_cost.{json,md} (``--name`` changes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
import precision_settings  # noqa: E402
import torch  # noqa: E402

BYTES, TARGETS = precision_settings.BYTES, precision_settings.TARGETS  # bench/precision_settings.py
STREAMS = {"copy": 8, "scale_inplace": 8, "add_inplace": 12}  # bytes credited per element (bench_fused_adamw.py)
ROOFLINE_TARGET = 0.8  # every setting at >= 80% of the roofline on CPU
# The compute floor: each step over COMPUTE_NUMEL elements, in L2 on one core (below one 64K-element chunk of the
# kernels: one thread), less the same call over OVERHEAD_NUMEL (the Python and dispatcher cost of a call, ~25 us
# here, more than the 16K elements' kernel); CALLS_PER_TIMING calls a timing after one that brings the setting's
# buffers back into L2, the garbage collector off, the minimum of COMPUTE_ROUNDS rounds (noise only adds: the
# minimum matches a C++ loop over the same kernel, 0.66 / 1.05 / 1.39 ns/element for default / bf16 / int8 moments on
# the 2-core EPYC, where the round-robin median was up to 35 % above it).
COMPUTE_NUMEL, OVERHEAD_NUMEL, CALLS_PER_TIMING, COMPUTE_ROUNDS = 2**14, 64, 32, 30


def setting_steps(n: int) -> dict:
    """precision_settings.steps (the kernel the engine calls for each setting) over this bench's n-element shard: a
    seeded fp32 master and bf16 gradient."""
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    master = torch.randn(n, generator=g) * 0.02
    return precision_settings.steps(master, grad)


def timer(step: list, calls: int = 1, warm: bool = False):
    """fn(step number) -> a round_robin contender returning the seconds per call over ``calls`` calls, each with the
    next step number (``warm``: one untimed call first)."""

    def wrap(fn):
        def run():
            if warm:
                step[0] += 1
                fn(float(step[0]))
            t0 = time.perf_counter()
            for _ in range(calls):
                step[0] += 1
                fn(float(step[0]))
            return (time.perf_counter() - t0) / calls

        return run

    return wrap


def contenders(n: int) -> dict:
    """Every setting's step and the in-place streams that make the roofline, each timed by the host clock."""
    timed = timer([0])
    src, dst = torch.rand(n), torch.empty(n)
    a, b, c = torch.ones(n), torch.full((n,), 1e-6), torch.ones(n)
    out = {name: timed(fn) for name, fn in setting_steps(n).items()}
    # 0.999 ** (a few hundred reps) stays far from denormals; the in-place add drifts by 1e-6 per rep.
    out.update(copy=timed(lambda s: dst.copy_(src)), scale_inplace=timed(lambda s: a.mul_(0.999)),
               add_inplace=timed(lambda s: c.add_(b)))  # fmt: skip
    return out


def compute_floor() -> dict:
    """Every setting's step at COMPUTE_NUMEL and at OVERHEAD_NUMEL elements, round robin: each round's seconds a call
    at either size (compute_rows takes the difference of their minimums per element: what the step's instructions
    cost with the memory and the call out of the way)."""
    import gc

    timed = timer([0], calls=CALLS_PER_TIMING, warm=True)
    calls = {(name, n): timed(fn) for n in (COMPUTE_NUMEL, OVERHEAD_NUMEL) for name, fn in setting_steps(n).items()}
    gc.disable()
    try:
        raw = harness.round_robin(calls, 1, COMPUTE_ROUNDS)
    finally:
        gc.enable()
    return {name: {"call_s": raw[(name, COMPUTE_NUMEL)], "overhead_s": raw[(name, OVERHEAD_NUMEL)]} for name in BYTES}


def measure(sizes: list[int], warmup: int, reps: int) -> dict:
    """Per size: every contender's times, round robin, and each setting's per-round ratio to the default."""
    from zero_ext import ops

    torch.set_num_threads(harness.cores())
    out = {"isa": ops.cpu_isa(), "threads": torch.get_num_threads(), "sizes": {}}
    for n in sizes:
        raw = harness.round_robin(contenders(n), warmup, reps)
        base = raw["default"]
        ratios = {name: [t / b for t, b in zip(times, base)] for name, times in raw.items() if name in BYTES}
        out["sizes"][str(n)] = {"times_s": raw, "ratios": ratios}
    out["compute_floor"] = compute_floor()
    return out


def run_tree(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--numel", args.numel, "--warmup",
           str(args.warmup), "--reps", str(args.reps)]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def size_label(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else str(n)


def setting_rows(n: int, runs: list[dict]) -> tuple[list[list], dict]:
    """One row per setting at size n over the runs (one tree): medians over all rounds."""
    times = {
        name: sum((r["sizes"][str(n)]["times_s"][name] for r in runs), [])
        for name in runs[0]["sizes"][str(n)]["times_s"]
    }
    ratios = {name: sum((r["sizes"][str(n)]["ratios"][name] for r in runs), []) for name in BYTES}  # fmt: skip
    gbs = {name: (BYTES.get(name) or STREAMS[name]) * n / statistics.median(t) / 1e9 for name, t in times.items()}
    roofline = max(STREAMS, key=gbs.get)
    rows, payload = [], {"roofline": roofline, "roofline_gb_per_s": gbs[roofline], "settings": {}}
    for name in BYTES:
        s = harness.summary(times[name])
        ratio = statistics.median(ratios[name])
        pct = 100 * gbs[name] / gbs[roofline]
        target = TARGETS.get(name)
        verdict = "-" if target is None else ("PASS" if ratio <= target else "FAIL")
        payload["settings"][name] = {**s, "bytes_per_element": BYTES[name], "gb_per_s": gbs[name],
                                     "pct_of_roofline": pct, "ratio_to_default_per_round": ratio,
                                     "target_ratio": target, "rounds": len(ratios[name])}  # fmt: skip
        rows.append([size_label(n), name, f"{s['median_s'] * 1e3:.1f}", f"{s['median_s'] * 1e9 / n:.2f}",
                     BYTES[name], f"{gbs[name]:.1f}", f"{pct:.0f}%", f"{ratio:.2f}",
                     f"<= {target} {verdict}" if target is not None else "-"])  # fmt: skip
    return rows, payload


def compute_rows(runs: list[dict], per_size: dict) -> tuple[list[list], dict]:
    """The compute floor of each setting over the runs (one tree) and, per size, the best ratio to the default that
    perfect overlap of that compute with the setting's bytes at the roofline would give."""
    threads = runs[0]["threads"]

    def fastest(name, key):
        return min(min(r["compute_floor"][name][key]) for r in runs)

    floor = {name: (fastest(name, "call_s") - fastest(name, "overhead_s")) / (COMPUTE_NUMEL - OVERHEAD_NUMEL)
             for name in BYTES}  # fmt: skip
    rows, payload = [], {}
    for name in BYTES:
        c = floor[name] * 1e9
        bounds = {}
        for n, p in per_size.items():
            memory = BYTES[name] / p["roofline_gb_per_s"]  # ns per element at the roofline
            default = p["settings"]["default"]["median_s"] * 1e9 / int(n)
            bounds[n] = max(c / threads, memory) / default
        relative = floor[name] / floor["default"]
        payload[name] = {"ns_per_element_one_thread": c, "ratio_to_default": relative,
                         "best_ratio_with_perfect_overlap": bounds}  # fmt: skip
        rows.append([name, f"{c:.2f}", f"{relative:.2f}", f"{c / threads:.2f}"]
                    + [f"{bounds[str(n)]:.2f}" for n in sorted(map(int, per_size))]
                    + [" / ".join(f"{p['settings'][name]['ratio_to_default_per_round']:.2f}"
                                  for _, p in sorted((int(k), v) for k, v in per_size.items()))])  # fmt: skip
    return rows, payload


HEADERS = ["n", "setting", "step ms", "ns/element", "B/element", "GB/s", "% of roofline", "/ default (per round)",
           "issue 37 target"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default=f"{2**24},{2**26}", help="comma-separated sizes")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--before", help="a checkout with its extension built: measure it too, in alternate children")
    ap.add_argument("--pairs", type=int, default=3, help="with --before: children per tree")
    ap.add_argument("--out-dir", default=str(harness.RESULTS))
    ap.add_argument("--name", default="precision_kernel_cost")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(x) for x in args.numel.split(",")]
    if args.child:
        print(json.dumps(measure(sizes, args.warmup, args.reps)))
        return
    info = harness.meta(torch.device("cpu"))
    here = Path(__file__).resolve().parents[2]
    trees = {"after": here} if not args.before else {"before": Path(args.before).resolve(), "after": here}
    runs: dict[str, list] = {tag: [] for tag in trees}
    loads = []  # the 1-minute load average after each child: other work on the machine during the run
    for k in range(args.pairs if args.before else 1):
        for tag, tree in trees.items():
            runs[tag].append(run_tree(tree, args) if args.before else measure(sizes, args.warmup, args.reps))
            loads.append(round(os.getloadavg()[0], 2))
            print(f"pair {k} {tag}: done (load average {loads[-1]:.2f})", flush=True)
    commits = {tag: subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() for tag, tree in trees.items()}  # fmt: skip
    last = runs["after"][-1]
    payload = {"sizes": sizes, "threads": last["threads"], "isa": last["isa"], "trees": {}, "commits": commits,
               "load_avg_1m_after_each_child": loads}  # fmt: skip
    body = ""
    for tag, tree in trees.items():
        rows, per_size = [], {}
        for n in sizes:
            r, p = setting_rows(n, runs[tag])
            rows += r
            per_size[str(n)] = p
        payload["trees"][tag] = {"path": str(tree), "commit": commits[tag], "sizes": per_size}
        crow, cpay = compute_rows(runs[tag], per_size)
        payload["trees"][tag]["compute_floor"] = cpay
        labels = [size_label(n) for n in sorted(sizes)]
        rooflines = ", ".join(f"{size_label(n)}: {p['roofline']} {p['roofline_gb_per_s']:.1f} GB/s"
                              for n, p in ((int(k), v) for k, v in per_size.items()))  # fmt: skip
        body += (f"\n## {tag}: `{commits[tag]}` ({tree})\n\n" + harness.markdown_table(HEADERS, rows)
                 + f"\n\nRoofline (best in-place stream at the same size, same rounds): {rooflines}.\n"
                 + f"\nCompute floor ({COMPUTE_NUMEL} elements, in L2, one thread, less a {OVERHEAD_NUMEL}-element "
                 "call's time: the call's own cost) and the best ratio to the default that overlapping it perfectly with the setting's "
                 f"bytes at the roofline would give: max(compute / {last['threads']} threads, B/element / roofline "
                 "GB/s) / the default's measured ns/element.\n\n"
                 + harness.markdown_table(["setting", "compute ns/element", "/ default", f"/ {last['threads']} threads"]
                                          + [f"best ratio {x}" for x in labels]
                                          + [f"measured ratio {' / '.join(labels)}"], crow) + "\n")  # fmt: skip
    if args.before:
        rows = []
        for n in sizes:
            for name in BYTES:
                b, a = (payload["trees"][t]["sizes"][str(n)]["settings"][name]["ratio_to_default_per_round"]
                        for t in ("before", "after"))  # fmt: skip
                rows.append([size_label(n), name, f"{b:.2f}", f"{a:.2f}", f"{a / b:.2f}"])
        body = ("\n## per-round ratio to the default step, before and after\n\n"
                + harness.markdown_table(["n", "setting", "before", "after", "after / before"], rows) + "\n" + body)  # fmt: skip
    body += (
        f"\nOne fused step per setting over one shard on the CPU ({last['threads']} threads, ISA {last['isa']}), bf16 "
        "gradient, the kernel the engine calls for each: default = fp32 master and moments writing the bf16 param; "
        "remainders = bf16 param + int16 remainder as the master; bf16 moments with stochastic rounding; int8 = codes "
        "+ one fp32 scale per 64 elements (dequantize, update, requantize), with an fp32 master or with remainders. "
        f"Round robin with the streams, {args.reps} rounds after {args.warmup} warm-up"
        + (f", {args.pairs} children per tree, alternately" if args.before else "")
        + f"; 1-minute load average after each child: {', '.join(f'{x:.2f}' for x in loads)}"
        + "; the ratio column is the median of each round's ratio to the default step in the same round. B/element "
        "is what the setting must move; % of roofline is its GB/s over the best in-place stream's.\n"
    )
    print(body)
    harness.write_results(args.name, info, payload, body, Path(args.out_dir))


if __name__ == "__main__":
    main()
