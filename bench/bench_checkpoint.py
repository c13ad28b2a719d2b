"""zero_ext.checkpoint: save and load time and bytes per rank for a >= 100M-parameter bf16 model at 1, 2 and 3
ranks (gloo on CPU), against a plain file copy of the same size measured in the same run, interleaved.

Every repetition: (1) ``checkpoint.save`` (every rank writes its shard file, fsynced); (2) the baseline: every
rank copies a file of the size of its shard (read + write + fsync, all ranks at once, like the save);
(3) ``checkpoint.load`` into the same optimizer (reads verified by crc32 per 1 MiB block, then params are
all-gathered). Loads read from the page cache (the file was just written; dropping caches needs root), so
they measure the checkpoint code, not the disk. Times are the slowest rank's (a collective ends then).

    python bench/bench_checkpoint.py                 # 1, 2, 3 ranks, 3 repetitions, ~2 GB of disk
    python bench/bench_checkpoint.py --worlds 2 --reps 1 --params 20e6
    python bench/bench_checkpoint.py --worlds 1 2 --reps 1 --dim 256 --params 2e5 --out-dir /tmp/ckpt   # seconds
    python bench/bench_checkpoint.py --dcp --worlds 1 2 --reps 3   # dcp.save / dcp.async_save vs checkpoint.save
                                                                    # (checkpoint_dcp_rows.py; results checkpoint_dcp.*)
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import RESULTS, launch, markdown_table, meta, text_table, write_results  # noqa: E402


def _copy(src: str, dst: str) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 16 << 20)
        fo.flush()
        os.fsync(fo.fileno())


def _timed_collective(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _run(rank, world, device, num_params, dim, reps, root):
    import zero_ext
    from zero_ext import checkpoint
    from zero_ext.layout import Range

    torch.manual_seed(0)
    layers = max(1, round(num_params / (dim * dim)))
    params = [
        (f"layers.{i}.weight", torch.nn.Parameter(torch.randn(dim, dim, dtype=torch.bfloat16))) for i in range(layers)
    ]
    opt = zero_ext.ZeroAdamW(params, lr=1e-3, stage=2)
    with torch.no_grad():  # realistic, incompressible state, written through the sharded state's seam
        for group in opt.sharded_state.groups:
            everything = Range(0, group.layout.shard_numel)
            for kind, fill in (("master", torch.randn), ("exp_avg", torch.randn), ("exp_avg_sq", torch.rand)):
                group.state.write(kind, everything, fill(everything.numel))
    path = os.path.join(root, f"ckpt-w{world}")
    mine = os.path.join(path, f"rank{rank:05d}.bin")
    rows = []
    for rep in range(reps):
        t_save = _timed_collective(lambda: checkpoint.save(path, opt))
        nbytes = os.path.getsize(mine) + os.path.getsize(mine[:-4] + ".json")
        src = os.path.join(root, f"copy-src-{rank}")
        if rep == 0:
            _copy(mine, src)  # a file of the size of this rank's shard
        t_copy = _timed_collective(lambda: _copy(src, os.path.join(root, f"copy-dst-{rank}")))
        t_load = _timed_collective(lambda: checkpoint.load(path, opt))
        rows.append(dict(rep=rep, rank=rank, bytes=nbytes, save_s=t_save, copy_s=t_copy, load_s=t_load))
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    return dict(layers=layers, numel=layers * dim * dim, rows=[r for rs in everyone for r in rs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="model size (rounded to whole --dim x --dim layers)")
    ap.add_argument("--dim", type=int, default=4096, help="layer width (default 4096)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default="checkpoint", help="result file stem (default: checkpoint)")
    ap.add_argument(
        "--out-dir", default=str(RESULTS), help="where to write <out>.{json,md,csv} (default: bench/results)"
    )
    ap.add_argument("--dcp", action="store_true", help="torch.distributed.checkpoint rows (checkpoint_dcp_rows.py)")
    args = ap.parse_args()
    m = meta(torch.device("cpu"))
    if args.dcp:
        return _main_dcp(args, m)
    table, csv_rows = [], []
    for world in args.worlds:
        res = _launch_in_scratch(_run, world, args, "zero_ext_ckpt_bench_")
        rows = res["rows"]
        for r in rows:
            csv_rows.append(dict(world=world, numel=res["numel"], **r))
        per_rank_bytes = max(r["bytes"] for r in rows)
        total = sum(r["bytes"] for r in rows if r["rep"] == 0)

        def med(key):  # slowest rank per repetition (all are equal up to the barrier), then median and spread
            by_rep = [max(r[key] for r in rows if r["rep"] == k) for k in range(args.reps)]
            return statistics.median(by_rep), min(by_rep), max(by_rep)

        s, c, ld = med("save_s"), med("copy_s"), med("load_s")
        gbps = lambda t: total / t / 1e9  # noqa: E731  aggregate over ranks
        table.append([world, f"{res['numel'] / 1e6:.1f}M", f"{per_rank_bytes / 1e6:.1f}", f"{total / 1e6:.1f}",
                      f"{s[0]:.2f} ({s[1]:.2f}-{s[2]:.2f})", f"{gbps(s[0]):.2f}",
                      f"{c[0]:.2f} ({c[1]:.2f}-{c[2]:.2f})", f"{gbps(c[0]):.2f}", f"{s[0] / c[0]:.2f}",
                      f"{ld[0]:.2f} ({ld[1]:.2f}-{ld[2]:.2f})", f"{gbps(ld[0]):.2f}"])  # fmt: skip
    headers = ["ranks", "params", "MB/rank", "MB total", "save s (min-max)", "save GB/s", "copy s (min-max)",
               "copy GB/s", "save/copy", "load s (min-max)", "load GB/s"]  # fmt: skip
    print(text_table(headers, table))
    body = (
        "bf16 params, ZeroAdamW stage 2; each rank writes fp32 master, exp_avg, exp_avg_sq and its bf16 param "
        "slices (14 B/param over all ranks). GB/s = bytes written by all ranks / slowest rank's time. "
        "`copy` = every rank copies a file of its shard's size at the same time (read + write + fsync), "
        f"interleaved with the saves; `load` reads from the page cache. Median of {args.reps} repetitions.\n\n"
        + markdown_table(headers, table)
    )
    paths = write_results(args.out, m, {"rows": csv_rows}, body, args.out_dir)
    csv_path = Path(args.out_dir) / f"{args.out}.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        w.writeheader()
        w.writerows(csv_rows)
    print("wrote", *[str(p) for p in paths], str(csv_path))


def _launch_in_scratch(fn, world: int, args, prefix: str) -> dict:
    """``fn`` on ``world`` gloo ranks, writing under a scratch folder in ``args.dir`` that is removed afterwards."""
    root = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    try:
        return launch(fn, world, "cpu", int(args.params), args.dim, args.reps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _main_dcp(args, m) -> None:
    from checkpoint_dcp_rows import HEADERS, run_dcp, table_rows

    table, raw = [], []
    for world in args.worlds:
        res = _launch_in_scratch(run_dcp, world, args, "zero_ext_dcp_bench_")
        raw += [dict(world=world, numel=res["numel"], **r) for r in res["rows"]]
        table += table_rows(world, res, args.reps)
    print(text_table(HEADERS, table))
    body = (
        "fp32 params, ZeroAdamW stage 2. zero_ext.save writes master + exp_avg + exp_avg_sq (12 B/param); dcp.save / "
        "dcp.async_save write zero_ext.checkpoint.get_state_dict (the fp32 master as the model's weights, exp_avg, "
        "exp_avg_sq, step: 12 B/param; views of the state, no copy) with FileSystemWriter; async on its own gloo "
        "group, with DCP's default stager (a fresh host copy per save) or one zero_ext.checkpoint.CachedStager for the "
        "run (its buffers reused; allocated by one untimed staging first). blocking = until the call returns "
        "(get_state_dict included, also shown apart); total = until the files are written. Times: slowest rank, "
        f"median (min-max) of {args.reps} interleaved repetitions; peak RSS: above the level before the call; load "
        "avg: the 1-minute load average at each repetition (min-max).\n\n" + markdown_table(HEADERS, table)
    )
    stem = args.out if args.out != "checkpoint" else "checkpoint_dcp"
    paths = write_results(stem, m, {"rows": raw}, body, args.out_dir)
    print("wrote", *[str(p) for p in paths])


if __name__ == "__main__":
    main()
