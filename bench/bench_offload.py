"""Offload: a training iteration with the optimizer state in memory, in host memory (``offload="cpu"``) and on disk
(``offload="nvme"``), against what the added work costs by itself, measured in the same run:

- nvme: the state's I/O (12 B/param read, 12 B/param written per step) against the disk's own sequential read and
  write bandwidth, measured by a plain O_DIRECT Python streaming loop on the same directory with the same block
  size, interleaved with the steps. Target: the step's I/O throughput >= 80 % of the disk's. The step's time is
  what it costs the iteration: the nvme iteration minus the in-memory one, plus the in-memory step() (the same
  kernel work). Not step() alone: the optimizer reads the next step's first chunks as soon as a step ends, so part
  of its I/O runs during forward and backward, outside step().
- cpu: the extra time over the in-memory iteration against the copies offload adds (the new bf16 parameters from
  their staging into the parameters, 2 B/param; on one process without a GPU the reduced gradient is added straight
  into the host grad shard since issue 23, so no 4 B/param landing copy), timed alone as plain ``copy_`` calls. On a CPU-only machine those copies are all it
  adds; on a GPU they become the D2H / H2D transfers (see profile_overlap.py).

Every contender runs in one process, one rank, round robin (machine noise hits them alike), on a stack of square
bf16 linear layers (parameter count set exactly by the size), one model copy per contender.

    python bench/bench_offload.py [--sizes 4,16,64,128] [--dir bench/out/offload] [--out-dir bench/results]

Writes offload_cpu.json / .md and offload_cpu.png (step time vs model size).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import disk_probe
import torch
from disk_probe import DiskStream
from harness import MIB, OUT, RESULTS, cores, markdown_table, meta, round_robin, summary, write_results

from zero_ext import ZeroAdamW
from zero_ext.placement.disk import chunk_numel
from zero_ext.placement.files import ALIGN
from zero_ext.placement.offload import DEFAULT_WINDOW
from zero_ext.update.adamw import AdamW

assert disk_probe.ALIGN == ALIGN, "the probe's transfers must be aligned as the optimizer's are"

MODES = ("memory", "cpu", "nvme")
LAYERS = 8


def build_model(params_m: float, seed: int = 0) -> torch.nn.Module:
    dim = int(math.sqrt(params_m * 1e6 / LAYERS))
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(LAYERS)])


class Contender:
    """One model with its optimizer; ``iteration()`` returns (total seconds, seconds inside step())."""

    def __init__(self, mode: str, params_m: float, directory: str, window: int):
        self.model = build_model(params_m)
        dim = self.model[0].in_features
        self.x = torch.randn(8, dim, generator=torch.Generator().manual_seed(1))
        kw = {"memory": {}, "cpu": dict(offload="cpu")}.get(mode, dict(offload="nvme", offload_dir=directory,
                                                                       offload_window=window))  # fmt: skip
        self.opt = ZeroAdamW(self.model.parameters(), lr=1e-4, stage=2, **kw)

    def turn(self) -> tuple[float, float]:
        """One timed iteration as in steady training, alone on the disk: an untimed iteration first (with nvme its
        step reads the next step's first chunks ahead, which the timed iteration's forward and backward overlap, as
        every iteration after the first does), and after it, untimed, the wait for its own read-ahead (which would
        otherwise run into the next contender's turn, or the disk probe's, and slow it)."""
        self.iteration()
        times = self.iteration()
        self.settle()
        return times

    def settle(self) -> None:
        """Wait for reads the optimizer started ahead (nvme), so that nothing of this contender is in flight."""
        for group in self.opt.sharded_state.groups:
            for slot in getattr(group.state, "slots", ()):
                for f in slot.reads:
                    f.result()

    def iteration(self) -> tuple[float, float]:
        return timed_iteration(self.model, self.x, self.opt)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def timed_iteration(model, x, opt) -> tuple[float, float]:
    """One iteration of ``model`` (built by :func:`build_model`) on ``x``: (iteration s, of which ``step()`` s)."""
    t0 = time.perf_counter()
    # bf16 parameters, fp32 matmuls: on a CPU without AVX-512 torch's bf16 matmul has no fast path and took
    # 6.3 s of a 128M-param iteration whose step() took 0.14 s, drowning what offload changes.
    h = x
    for layer in model:
        h = torch.nn.functional.linear(h, layer.weight.float())
    h.pow(2).mean().backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    opt.zero_grad()
    return time.perf_counter() - t0, t2 - t1


class AddedCopies:
    """What offload="cpu" adds on a CPU-only machine, as plain copies between buffers allocated once: bf16 staging
    -> parameters (``numel``), and fp32 landing -> grad shard (``numel``) where a landing ring exists: not on one
    process without a GPU, where the gradients are added straight into the host grad shard (issue 23; the benchmark
    runs one rank, so only with ``HostGradients.IN_PLACE_WITHOUT_GPU`` off)."""

    def __init__(self, numel: int):
        from zero_ext.placement.host import HostGradients

        self.lands = not HostGradients.IN_PLACE_WITHOUT_GPU
        self.src32, self.dst32 = torch.ones(numel), torch.zeros(numel)
        self.src16, self.dst16 = torch.ones(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        if self.lands:
            self.dst32.copy_(self.src32)
        self.dst16.copy_(self.src16)
        return time.perf_counter() - t0


def run_size(params_m: float, directory: str, window: int, warmup: int, reps: int) -> dict:
    contenders = {mode: Contender(mode, params_m, directory, window) for mode in MODES}
    psi = sum(p.numel() for p in contenders["memory"].model.parameters())
    rule = AdamW(torch.bfloat16)  # the optimizer's state kinds, each on disk, read and written once per step
    state_bytes = rule.bytes_per_element() * psi
    chunk = chunk_numel(window, rule, psi) * 4  # the optimizer's transfer size (bytes per kind)
    disk = DiskStream(directory, state_bytes, chunk)
    fns = {mode: c.turn for mode, c in contenders.items()}
    fns["disk_write"] = disk.write
    fns["disk_read"] = disk.read
    fns["copies"] = AddedCopies(psi)
    try:
        raw = round_robin(fns, warmup, reps)
    finally:
        disk.close()
    # the same training: offload must not change a bit
    reference = contenders["memory"].params()
    bitwise = {m: all(torch.equal(a, b) for a, b in zip(reference, contenders[m].params())) for m in ("cpu", "nvme")}
    report = contenders["nvme"].opt.memory_report()
    for c in contenders.values():
        c.opt.close()
    out = {"params": psi, "state_bytes_on_disk": sum(report.on_disk.values()), "bitwise_equal": bitwise,
           "host_window_bytes": report.offload_buffers}  # fmt: skip
    for mode in MODES:
        out[mode] = {"iteration": summary([t for t, _ in raw[mode]]), "step": summary([s for _, s in raw[mode]])}
    for name in ("disk_write", "disk_read", "copies"):
        out[name] = summary(raw[name])
    w, r = out["disk_write"]["median_s"], out["disk_read"]["median_s"]
    disk_bw = 2 * disk.nbytes / (w + r)  # sequential read + write, one after the other
    # What the nvme step costs the iteration (reads ahead run during forward and backward, outside step()).
    cost = (
        out["nvme"]["iteration"]["median_s"]
        - out["memory"]["iteration"]["median_s"]
        + out["memory"]["step"]["median_s"]
    )
    out["nvme_step_cost_s"] = cost
    step_io = 2 * state_bytes / cost
    out["disk"] = {"write_GBps": disk.nbytes / w / 1e9, "read_GBps": disk.nbytes / r / 1e9,
                   "read_write_GBps": disk_bw / 1e9, "probe_bytes": disk.nbytes, "block_bytes": disk.block}  # fmt: skip
    out["nvme_step_io_GBps"] = step_io / 1e9
    out["nvme_vs_disk"] = step_io / disk_bw
    extra = out["cpu"]["iteration"]["median_s"] - out["memory"]["iteration"]["median_s"]
    out["cpu_extra_s"] = extra
    out["cpu_extra_vs_copies"] = extra / out["copies"]["median_s"]
    # The same from each round's pair (the contenders run back to back within a round): a drift of the machine
    # that lasts a round hits both sides, where the medians above may take their values from different rounds.
    mem_i, cpu_i = [t for t, _ in raw["memory"]], [t for t, _ in raw["cpu"]]
    out["cpu_extra_per_round_s"] = statistics.median(c - m for c, m in zip(cpu_i, mem_i))
    out["nvme_vs_disk_per_round"] = statistics.median(
        (2 * state_bytes / (n - m + ms)) / (2 * disk.nbytes / (w + r))
        for (n, _), (m, ms), w, r in zip(raw["nvme"], raw["memory"], raw["disk_write"], raw["disk_read"])
    )
    return out


def chart(results: list[dict], path: Path, info: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    x = [r["params"] / 1e6 for r in results]
    styles = {"memory": dict(color="tab:blue", marker="o"), "cpu": dict(color="tab:orange", marker="s"),
              "nvme": dict(color="tab:green", marker="^")}  # fmt: skip
    labels = {"memory": "state in memory", "cpu": 'offload="cpu" (host memory)', "nvme": 'offload="nvme" (disk)'}
    for mode in MODES:
        med = [r[mode]["iteration"]["median_s"] for r in results]
        lo = [r[mode]["iteration"]["median_s"] - r[mode]["iteration"]["q1_s"] for r in results]
        hi = [r[mode]["iteration"]["q3_s"] - r[mode]["iteration"]["median_s"] for r in results]
        ax.errorbar(x, med, yerr=[lo, hi], label=labels[mode], capsize=3, **styles[mode])
    io_floor = [24 * r["params"] / (r["disk"]["read_write_GBps"] * 1e9) for r in results]
    ax.plot(x, io_floor, ls=":", color="tab:green", alpha=0.7, label="disk time for 24 B/param at the probe's rate")
    ax.set(xscale="log", yscale="log", xlabel="parameters (millions)", ylabel="training iteration (s, median, IQR)",
           title="Iteration time vs model size (one rank, stage 2, bf16)")  # fmt: skip
    ax.set_xticks(x, [f"{v:.0f}" for v in x])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ratios = [r["nvme_vs_disk"] * 100 for r in results]
    bars = ax_ratio.bar([f"{v:.0f}M" for v in x], ratios, color="tab:green", alpha=0.8)
    ax_ratio.bar_label(bars, [f"{v:.0f} %" for v in ratios])
    ax_ratio.axhline(80, color="k", ls="--", lw=1, label="target 80 %")
    ax_ratio.set(ylabel="nvme step I/O / disk sequential read+write (%)", ylim=(0, max(110, max(ratios) * 1.15)),
                 title='offload="nvme": step I/O throughput vs the disk')  # fmt: skip
    ax_ratio.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{info['device']} · {info['date']} · commit {info['commit']}", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_and_start(doc: str, sizes: str, directory: str, dir_help: str, name: str) -> tuple[argparse.Namespace, dict]:
    """The offload benchmarks' shared command line (model sizes, the state directory, the window, rounds, where the
    results go) and start: every core's thread, the directory made, the run's record with its filesystem."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--sizes", default=sizes, help="model sizes, millions of parameters")
    ap.add_argument("--dir", default=str(OUT / directory), help=dir_help)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="offload_window (bytes; the engine's default)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--name", default=name)
    args = ap.parse_args()
    torch.set_num_threads(cores())
    os.makedirs(args.dir, exist_ok=True)
    info = meta(torch.device("cpu"))
    info["disk"] = _filesystem(args.dir)
    return args, info


def main() -> None:
    args, info = parse_and_start(__doc__, "4,16,64,128", "offload", "where the nvme state and the disk probe go",
                                 "offload_cpu")  # fmt: skip
    sizes = [float(s) for s in args.sizes.split(",")]
    results = []
    for size in sizes:
        results.append(run_size(size, args.dir, args.window, args.warmup, args.reps))
        r = results[-1]
        print(f"{r['params'] / 1e6:.1f}M: memory {r['memory']['iteration']['median_s']:.3f}s cpu "
              f"{r['cpu']['iteration']['median_s']:.3f}s nvme {r['nvme']['iteration']['median_s']:.3f}s; nvme I/O "
              f"{r['nvme_step_io_GBps']:.2f} GB/s = {100 * r['nvme_vs_disk']:.0f}% of the disk's "
              f"{r['disk']['read_write_GBps']:.2f} (per round {100 * r['nvme_vs_disk_per_round']:.0f}%); cpu extra "
              f"{r['cpu_extra_s'] * 1e3:.1f} ms (per round {r['cpu_extra_per_round_s'] * 1e3:.1f}) vs copies "
              f"{r['copies']['median_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    shutil.rmtree(args.dir, ignore_errors=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = chart(results, out_dir / f"{args.name}.png", info)
    rows = [[f"{r['params'] / 1e6:.1f}M", *(f"{r[m]['iteration']['median_s'] * 1e3:.0f}" for m in MODES),
             f"{r['nvme']['step']['median_s'] * 1e3:.0f}", f"{r['nvme_step_cost_s'] * 1e3:.0f}",
             f"{r['disk']['write_GBps']:.2f} / {r['disk']['read_GBps']:.2f}",
             f"{r['nvme_step_io_GBps']:.2f}",
             f"{100 * r['nvme_vs_disk']:.0f} % ({100 * r['nvme_vs_disk_per_round']:.0f} %)",
             f"{r['cpu_extra_s'] * 1e3:.1f} ({r['cpu_extra_per_round_s'] * 1e3:.1f}) / {r['copies']['median_s'] * 1e3:.1f}",
             "yes" if all(r["bitwise_equal"].values()) else "NO"] for r in results]  # fmt: skip
    body = markdown_table(
        ["params", "memory (ms)", "cpu (ms)", "nvme (ms)", "nvme step() (ms)", "nvme step cost (ms)",
         "disk write / read (GB/s)",
         "nvme step I/O per s of its cost (GB/s)", "nvme / disk (per round)", "cpu extra (per round) / its copies (ms)",
         "bitwise equal"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\nIteration = forward + backward + step() + zero_grad() of {LAYERS} square bf16 linear layers (fp32 matmuls), batch 8, "
        f"stage 2, one rank, {cores()} threads; median of {args.reps} round-robin rounds. nvme window "
        f"{args.window // MIB} MiB. The disk probe writes then reads the state's size sequentially with O_DIRECT in "
        f"the optimizer's transfer size, in the same directory ({info['disk']}). 'nvme step cost' is what the nvme "
        "step costs the iteration: nvme iteration - memory iteration + memory step() (the same kernel work); the "
        "optimizer reads the next step's first chunks while forward and backward run, so step() alone is less. "
        "'nvme / disk' is the step's 24 B/param of I/O per second of that cost over the probe's read+write rate "
        "(above 100 % when reads hidden behind forward and backward save more than the rest costs). 'cpu extra' "
        "is the cpu-offload "
        "iteration minus the in-memory one, against the plain copies offload adds (2 B/param of parameters; no landing copy on one process without a GPU). In brackets: "
        "the median over rounds of each round's own ratio or difference (the contenders and the probe run back to "
        "back within a round, so a drift of the machine hits both sides of it); outside: from the medians.\n\n"
        f"![step time vs model size]({png.name})\n"
    )
    write_results(args.name, info, {"window": args.window, "sizes": results}, body, out_dir)
    print(f"wrote {out_dir / args.name}.json, .md, .png")


def _filesystem(directory: str) -> str:
    try:
        st = os.statvfs(directory)
        dev = os.stat(directory).st_dev
        return f"{directory} (device {os.major(dev)}:{os.minor(dev)}, {st.f_bsize} B blocks)"
    except OSError:
        return directory


if __name__ == "__main__":
    main()
