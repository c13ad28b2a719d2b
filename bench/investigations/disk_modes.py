"""Is the disk, or the process measuring it, what moves bench_offload's 'nvme / disk' ratio? The disk's sequential
O_DIRECT write and read rate (disk_probe.DiskStream, the probe bench_offload uses) and a replay of the nvme step's
I/O order (StepReplay, below: three files, read chunk i + 1 then write chunk i - 1, one transfer at a time,
no threads, no CPU work), in child processes that differ in one of two ways, cycling through the four mixes:
torch imported first or not at all, and transfer buffers in 4 KiB pages or in transparent huge pages (what
zero_ext.placement.files.aligned_buffer gives the optimizer's window).

    python bench/investigations/disk_modes.py [--gb 1.5] [--children 8] [--rounds 3] [--dir bench/out/disk_modes]

--gb is the state's size (12 B/param: 1.5 GB at 128M params); the transfer size is the optimizer's at the default
window for that size. Writes results/disk_modes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)  # disk_probe, harness

from disk_probe import ALIGN, DiskStream, io_buffer  # noqa: E402  (no torch: "plain" children stay without it)

MIXES = [("plain", "4k"), ("torch", "4k"), ("plain", "huge"), ("torch", "huge")]


class StepReplay:
    """The nvme step's transfers without the optimizer: three files (master, exp_avg, exp_avg_sq) of ``nbytes / 3``
    each, walked in ``block``-byte chunks; chunk ``i + 1`` of every file is read, then chunk ``i - 1`` written, one
    transfer at a time (the order the step issues them in, without its threads and its CPU work)."""

    def __init__(self, directory: str, nbytes: int, block: int, pages: str = "huge"):
        self.block = max(ALIGN, block // ALIGN * ALIGN)
        self.chunks = max(1, nbytes // 3 // self.block)
        self.bufs = [io_buffer(self.block, pages) for _ in range(6)]
        self.paths = [os.path.join(directory, f"replay.{k}") for k in ("master", "exp_avg", "exp_avg_sq")]
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
        self.fds = [os.open(p, flags, 0o600) for p in self.paths]
        for fd in self.fds:
            os.posix_fallocate(fd, 0, self.chunks * self.block)
            for i in range(self.chunks):
                os.pwritev(fd, [self.bufs[0]], i * self.block)

    @property
    def nbytes(self) -> int:
        """Bytes read (and as many written) by one ``step()``."""
        return 3 * self.chunks * self.block

    def step(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.chunks + 1):
            if i < self.chunks:
                for k, fd in enumerate(self.fds):
                    os.preadv(fd, [self.bufs[k]], i * self.block)
            if i:
                for k, fd in enumerate(self.fds):
                    os.pwritev(fd, [self.bufs[3 + k]], (i - 1) * self.block)
        return time.perf_counter() - t0

    def close(self) -> None:
        for fd, path in zip(self.fds, self.paths):
            os.close(fd)
            os.remove(path)


def child(directory: str, nbytes: int, block: int, rounds: int, pages: str) -> list[dict]:
    probe, replay = DiskStream(directory, nbytes, block, pages), StepReplay(directory, nbytes, block, pages)
    out = []
    try:
        for _ in range(rounds):
            w, r = probe.write(), probe.read()
            s = replay.step()
            both = 2 * probe.nbytes / (w + r)
            out.append({"write_GBps": probe.nbytes / w / 1e9, "read_GBps": probe.nbytes / r / 1e9,
                        "probe_read_write_GBps": both / 1e9, "replay_GBps": 2 * replay.nbytes / s / 1e9,
                        "replay_vs_probe": 2 * replay.nbytes / s / both})  # fmt: skip
    finally:
        probe.close()
        replay.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--children", type=int, default=8, help="child processes, cycling through the four mixes")
    ap.add_argument("--rounds", type=int, default=3, help="probe + replay rounds per child")
    ap.add_argument("--dir", default=os.path.join(BENCH, "out", "disk_modes"))
    ap.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    ap.add_argument("--child", choices=["plain", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--pages", choices=["4k", "huge"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = int(args.gb * 1e9)
    if args.child:
        if args.child == "torch":
            import torch  # noqa: F401  (loaded, never used: the point is its presence)
        block = int(sys.stdin.readline())
        print(json.dumps(child(args.dir, nbytes, block, args.rounds, args.pages)))
        return

    import torch
    from harness import markdown_table, meta, write_results

    from zero_ext.placement.disk import chunk_numel
    from zero_ext.placement.offload import DEFAULT_WINDOW
    from zero_ext.update.adamw import AdamW

    info = meta(torch.device("cpu"))
    rule = AdamW(torch.bfloat16)
    block = chunk_numel(DEFAULT_WINDOW, rule, nbytes // rule.bytes_per_element()) * 4  # bytes per kind per chunk
    os.makedirs(args.dir, exist_ok=True)
    runs = []
    try:
        for i in range(args.children):
            mode, pages = MIXES[i % len(MIXES)]
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--pages", pages, "--gb", str(args.gb),
                   "--rounds", str(args.rounds), "--dir", args.dir]  # fmt: skip
            done = subprocess.run(cmd, input=f"{block}\n", capture_output=True, text=True, check=True, cwd=BENCH)
            rounds = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append({"child": i, "torch_imported": mode == "torch", "pages": pages, "rounds": rounds})
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(f"child {i} ({mode}, {pages} pages): write {med['write_GBps']:.2f} read {med['read_GBps']:.2f} GB/s; replay "
                  f"{med['replay_GBps']:.2f} GB/s = {100 * med['replay_vs_probe']:.0f}% of the probe", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    for run in runs:
        for j, r in enumerate(run["rounds"]):
            rows.append([run["child"], "yes" if run["torch_imported"] else "no", run["pages"], j,
                         f"{r['write_GBps']:.2f}",
                         f"{r['read_GBps']:.2f}", f"{r['probe_read_write_GBps']:.2f}", f"{r['replay_GBps']:.2f}",
                         f"{100 * r['replay_vs_probe']:.0f} %"])  # fmt: skip
    body = markdown_table(["child", "torch imported", "buffer pages", "round", "probe write GB/s", "probe read GB/s",
                           "probe read+write GB/s", "step replay GB/s", "replay / probe"], rows)  # fmt: skip
    body += (
        f"\n\n{args.gb} GB of state (read and written once per replayed step; the probe writes and reads as much), "
        f"{block} B transfers (the optimizer's chunk at the default window), O_DIRECT, in {args.dir}. Children cycle through: without torch / with torch imported "
        "(loaded and unused), and transfer buffers in 4 KiB pages (madvise NOHUGEPAGE) / in huge pages (2 MiB-aligned, "
        "madvise HUGEPAGE, as the optimizer's window); nothing else differs. 'replay / probe' is the replay's read+write rate over the probe's "
        "in the same round.\n"
    )
    write_results("disk_modes", info, {"gb": args.gb, "block_bytes": block, "runs": runs}, body, args.out_dir)
    print(f"wrote {args.out_dir}/disk_modes.json, .md")


if __name__ == "__main__":
    main()
