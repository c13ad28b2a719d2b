"""bench_checkpoint.py --dcp: torch.distributed.checkpoint against zero_ext.checkpoint.save on the same optimizer,
interleaved, per repetition:

- ``zero_ext.checkpoint.save`` (blocking = total: the call returns when the files are written);
- ``dcp.save`` of ``zero_ext.checkpoint.get_state_dict`` (blocking = total; get_state_dict included: views, no copy);
- ``dcp.async_save`` of it on its own gloo group with DCP's default stager (a fresh host copy per save): blocking =
  get_state_dict + staging, until the call returns (training could go on from there); total = until the returned
  future is done;
- the same with ``zero_ext.checkpoint.CachedStager`` (one stager for the run, its buffers reused from save to save;
  one untimed staging before the repetitions allocates them, as the first save of a run does).

``get_state_dict s``: the part of the blocking time spent in ``get_state_dict`` (the rest: staging and starting the
upload thread). The load average is sampled at every repetition.

Times are the slowest rank's (barriers around each). bytes/s = bytes in the checkpoint directory / total time. Peak
RSS: the highest resident set size a 5 ms sampler thread saw during the phase, minus the resident size before it.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist


class RssPeak:
    """The peak resident set size (bytes) above the level at ``start``, sampled from /proc/self/statm."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.delta = self.peak - self.base


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_dcp(rank, world, device, num_params, dim, reps, root):
    import torch.distributed.checkpoint as dcp

    import zero_ext
    from zero_ext import checkpoint
    from zero_ext.layout import Range

    torch.manual_seed(0)
    layers = max(1, round(num_params / (dim * dim)))
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    opt = zero_ext.ZeroAdamW(model.parameters(), lr=1e-3, stage=2, module=model)
    with torch.no_grad():  # realistic, incompressible moments, written through the sharded state's seam
        for group in opt.sharded_state.groups:
            everything = Range(0, group.layout.shard_numel)
            for kind, fill in (("exp_avg", torch.randn), ("exp_avg_sq", torch.rand)):
                group.state.write(kind, everything, fill(everything.numel))
    pg = dist.new_group(backend="gloo")
    stager = checkpoint.CachedStager()
    msd, osd = checkpoint.get_state_dict(model, opt)
    stager.stage({"model": msd, "optim": osd})  # the buffers, allocated once (a run's first save does it)
    del msd, osd
    rows = []

    def zx(path):
        t = time.perf_counter()
        checkpoint.save(path, opt)
        return time.perf_counter() - t, None, 0.0

    def sync(path):
        t = time.perf_counter()
        msd, osd = checkpoint.get_state_dict(model, opt)
        got = time.perf_counter() - t
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        return time.perf_counter() - t, None, got

    def asynchronous(path, async_stager=None):
        t = time.perf_counter()
        msd, osd = checkpoint.get_state_dict(model, opt)
        got = time.perf_counter() - t
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=pg,
                                async_stager=async_stager)  # fmt: skip
        blocking = time.perf_counter() - t
        future.result()
        return time.perf_counter() - t, blocking, got

    methods = (("zero_ext.save", zx), ("dcp.save", sync), ("dcp.async_save", asynchronous),
               (CACHED, lambda path: asynchronous(path, stager)))  # fmt: skip
    for rep in range(reps):
        for name, fn in methods:
            path = os.path.join(root, f"{name}-{rep}")
            dist.barrier()
            with RssPeak() as rss:
                total, blocking, got = fn(path)
            dist.barrier()
            nbytes = _dir_bytes(path) if rank == 0 else 0
            rows.append(dict(rep=rep, method=name, total_s=_slowest(total),
                             blocking_s=_slowest(total if blocking is None else blocking),
                             get_state_dict_s=_slowest(got), load_avg_1m=round(os.getloadavg()[0], 2),
                             peak_rss_mb=_slowest(rss.delta / 1e6), bytes=nbytes))  # fmt: skip
            dist.barrier()
            if rank == 0:
                import shutil

                shutil.rmtree(path, ignore_errors=True)
    stager.close()
    return dict(layers=layers, numel=layers * dim * dim, rows=rows)


CACHED = "dcp.async_save + CachedStager"
METHODS = ("zero_ext.save", "dcp.save", "dcp.async_save", CACHED)
HEADERS = ["ranks", "params", "method", "blocking s (min-max)", "get_state_dict s", "total s (min-max)",
           "blocking / dcp.save total", "MB written", "GB/s", "peak RSS MB", "load avg"]  # fmt: skip


def table_rows(world: int, result: dict, reps: int) -> list[list[str]]:
    """One row per method: medians over repetitions (and their spread)."""
    import statistics

    out = []
    by = lambda m, k: [r[k] for r in result["rows"] if r["method"] == m]  # noqa: E731
    sync_total = statistics.median(by("dcp.save", "total_s"))
    for method in METHODS:
        block, total = by(method, "blocking_s"), by(method, "total_s")
        nbytes = statistics.median(by(method, "bytes"))
        loads = by(method, "load_avg_1m")
        out.append([world, f"{result['numel'] / 1e6:.1f}M", method,
                    f"{statistics.median(block):.2f} ({min(block):.2f}-{max(block):.2f})",
                    f"{statistics.median(by(method, 'get_state_dict_s')):.3f}",
                    f"{statistics.median(total):.2f} ({min(total):.2f}-{max(total):.2f})",
                    f"{statistics.median(block) / sync_total:.1%}", f"{nbytes / 1e6:.0f}",
                    f"{nbytes / statistics.median(total) / 1e9:.2f}",
                    f"{statistics.median(by(method, 'peak_rss_mb')):.0f}",
                    f"{min(loads):.1f}-{max(loads):.1f}"])  # fmt: skip
    return out
