"""Where does an ``offload="nvme"`` step's time go? Every read and write of the state files and every wait of the
step for them, timed, for the optimizer as it is and for two variants, round robin in one process:

- ``default``: the optimizer as shipped (a reader and a writer thread, huge-page window buffers);
- ``one_thread``: reads and writes queued on one thread (the writer pool is the reader pool);
- ``4k_pages``: window buffers in 4 KiB pages (madvise NOHUGEPAGE) instead of huge pages.

Per step: how long the reader and the writer were busy and at what rate, and how long the step waited for them.
The traced step does all of its own I/O: the reads of its first chunks that the previous step started ahead are
dropped before it (``bench/nvme_read_ahead.py`` measures what that read-ahead buys).
The rates are those the disk delivered while the step ran (reads and writes overlapping, unless one thread), to
compare with ``bench_offload.py``'s probe of the same directory.

    python bench/trace_nvme_step.py [--size 128] [--steps 4] [--dir bench/out/trace_nvme]

Writes results/trace_nvme_step.{json,md}. The variants patch the optimizer's I/O module while one is built: a
diagnostic, not a configuration the library offers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from contextlib import contextmanager

import disk_probe
import torch
from bench_offload import Contender
from harness import OUT, RESULTS, markdown_table, meta, write_results

import zero_ext.offload.disk as disk
import zero_ext.offload.files as files
from zero_ext.offload import DEFAULT_WINDOW

VARIANTS = ("default", "one_thread", "4k_pages")
LOG: list[tuple[str, float, float, int]] = []  # (what, start, end, bytes): "read", "write", "wait"


def _traced(fn, what):
    def run(*args):
        t0 = time.perf_counter()
        n = fn(*args)
        LOG.append((what, t0, time.perf_counter(), n))
        return n

    return run


def _traced_wait(fn):
    def run(futures):
        t0 = time.perf_counter()
        fn(futures)
        LOG.append(("wait", t0, time.perf_counter(), 0))

    return run


files.pread_all = _traced(files.pread_all, "read")
files.pwrite_all = _traced(files.pwrite_all, "write")
disk._wait = _traced_wait(disk._wait)


def _small_pages_buffer(nbytes: int) -> torch.Tensor:
    """aligned_buffer's contract (page-aligned, whole pages) in 4 KiB pages: the probe's buffer as a tensor (which
    keeps the mapping alive)."""
    size = max(files.ALIGN, -(-nbytes // files.ALIGN) * files.ALIGN)
    return torch.frombuffer(disk_probe.io_buffer(size, pages="4k"), dtype=torch.uint8)[:nbytes]


@contextmanager
def variant(name: str):
    """The optimizer's I/O module changed as ``name`` says while a contender is built."""
    init, buffer = files.StateFiles.__init__, disk.aligned_buffer

    def one_thread_init(self, *a, **kw):
        init(self, *a, **kw)
        self._writers.shutdown()
        self._writers = self._readers

    if name == "one_thread":
        files.StateFiles.__init__ = one_thread_init
    elif name == "4k_pages":
        disk.aligned_buffer = _small_pages_buffer
    try:
        yield
    finally:
        files.StateFiles.__init__, disk.aligned_buffer = init, buffer


def busy(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for b, e in sorted(intervals):
        total += max(0.0, e - max(b, end))
        end = max(end, e)
    return total


def summarise(log, step_s: float) -> dict:
    out = {"step_s": step_s}
    for what in ("read", "write", "wait"):
        iv = [(b, e) for w, b, e, _ in log if w == what]
        out[f"{what}_busy_s"] = busy(iv)
        out[f"{what}_bytes"] = sum(n for w, _, _, n in log if w == what)
        out[f"{what}_count"] = len(iv)
    for what in ("read", "write"):
        out[f"{what}_GBps_busy"] = out[f"{what}_bytes"] / max(out[f"{what}_busy_s"], 1e-9) / 1e9
    out["io_GBps"] = (out["read_bytes"] + out["write_bytes"]) / step_s / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=128, help="model size, millions of parameters")
    ap.add_argument("--steps", type=int, default=4, help="traced steps per variant (after one untraced)")
    ap.add_argument("--dir", default=str(OUT / "trace_nvme"))
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--name", default="trace_nvme_step")
    args = ap.parse_args()
    info = meta(torch.device("cpu"))
    os.makedirs(args.dir, exist_ok=True)
    contenders = {}
    try:
        for name in VARIANTS:
            os.makedirs(os.path.join(args.dir, name), exist_ok=True)
            with variant(name):
                contenders[name] = Contender("nvme", args.size, os.path.join(args.dir, name), DEFAULT_WINDOW)
        for c in contenders.values():  # the first step reads never-written (fallocated) blocks: not traced
            c.iteration()
            c.settle()  # its read-ahead: not into the next variant's trace
        steps = {name: [] for name in VARIANTS}
        for _ in range(args.steps):
            for name, c in contenders.items():
                for group in c.opt.sharded_state.groups:
                    group.state._drop_read_ahead()  # the traced step does all its own reads: every byte is traced
                LOG.clear()
                _, step_s = c.iteration()
                # Not the next step's read-ahead, which step() starts once its last write is done.
                log = list(LOG)
                last_write = max((e for what, _, e, _ in log if what == "write"), default=float("inf"))
                steps[name].append(summarise([r for r in log if r[0] != "read" or r[1] < last_write], step_s))
                c.settle()  # that iteration's own read-ahead: not into the next variant's trace
    finally:
        for c in contenders.values():
            c.opt.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    med = {}
    for name in VARIANTS:
        med[name] = {k: statistics.median(s[k] for s in steps[name]) for k in steps[name][0]}
        m = med[name]
        rows.append([name, f"{m['step_s'] * 1e3:.0f}", f"{m['io_GBps']:.2f}", f"{m['read_busy_s'] * 1e3:.0f}",
                     f"{m['read_GBps_busy']:.2f}", f"{m['write_busy_s'] * 1e3:.0f}", f"{m['write_GBps_busy']:.2f}",
                     f"{m['wait_busy_s'] * 1e3:.0f}"])  # fmt: skip
        print(" | ".join(map(str, rows[-1])), flush=True)
    psi = int(med["default"]["read_bytes"] // 12)
    body = markdown_table(["variant", "step() ms", "step I/O GB/s", "reader busy ms", "read GB/s while busy",
                           "writer busy ms", "write GB/s while busy", "step waiting for I/O ms"], rows)  # fmt: skip
    body += (
        f"\n\nMedians of {args.steps} traced steps per variant, round robin, after one untraced step each; "
        f"{args.size:g}M params (stage 2, one rank, bf16 params; {psi * 12 / 1e9:.2f} GB read and as much written "
        f"per step), window {DEFAULT_WINDOW >> 20} MiB, files in {args.dir}. 'busy' is the time at least one "
        "transfer of that kind was in flight; 'waiting' the time step() spent blocked on reads or writes (the CPU "
        "AdamW kernel runs in the rest).\n"
    )
    write_results(args.name, info, {"config": vars(args), "steps": steps, "medians": med}, body, args.out_dir)
    print(f"wrote {args.out_dir}/{args.name}.json, .md")


if __name__ == "__main__":
    main()
