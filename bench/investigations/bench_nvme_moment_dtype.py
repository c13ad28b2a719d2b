"""offload="nvme" with fp32 moments against bf16 and int8 moments (``moment_dtype=``, and int8 with
``param_remainders=True``): the state files and the step's cost, the contenders (in memory and on disk, each
setting) round robin in one process.

Per step the nvme placement reads and writes every state file once: fp32 moments move 12 B/param each way (master
and two moments), bf16 moments 8 (the master stays fp32), int8 moments 6 (the codes: 1 byte each; their fp32 block
scales stay in host memory), int8 with param_remainders 2 (the remainder stays in host memory too). What a step costs the iteration is, as in
bench_offload.py, the nvme iteration minus the in-memory one of the same moment dtype plus that in-memory step()
(the same kernel work; reads of the next step's first chunks run during forward and backward, outside step()).

    python bench/investigations/bench_nvme_moment_dtype.py [--sizes 16,64] [--reps 8] [--dir bench/out/nvme_moments]

Writes nvme_moment_dtype.json / .md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bench_offload, harness

import torch  # noqa: E402
from bench_offload import build_model, parse_and_start, timed_iteration  # noqa: E402
from harness import MIB, cores, markdown_table, round_robin, summary, write_results  # noqa: E402

from zero_ext import ZeroAdamW  # noqa: E402

# setting -> (moment dtype, param_remainders)
DTYPES = {
    "fp32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),
    "int8": (torch.int8, False),
    "int8_remainders": (torch.int8, True),
}


class Contender:
    """One model with its optimizer (stage 2, one rank); ``turn()`` returns (iteration s, step() s)."""

    def __init__(self, placement: str, moments: str, params_m: float, directory: str, window: int):
        self.model = build_model(params_m)
        dim = self.model[0].in_features
        self.x = torch.randn(8, dim, generator=torch.Generator().manual_seed(1))
        kw = {} if placement == "memory" else dict(offload="nvme", offload_window=window,
                                                   offload_dir=os.path.join(directory, moments))  # fmt: skip
        moment_dtype, remainders = DTYPES[moments]
        self.opt = ZeroAdamW(self.model.parameters(), lr=1e-4, stage=2, moment_dtype=moment_dtype,
                             param_remainders=remainders, **kw)  # fmt: skip

    def iteration(self) -> tuple[float, float]:
        return timed_iteration(self.model, self.x, self.opt)

    def turn(self) -> tuple[float, float]:
        """An untimed iteration (its step reads the next step's first chunks ahead), a timed one, then the wait for
        the read-ahead, so that nothing of this contender runs into the next one's turn (bench_offload.py)."""
        self.iteration()
        times = self.iteration()
        for group in self.opt.sharded_state.groups:
            for slot in getattr(group.state, "slots", ()):
                for f in slot.reads:
                    f.result()
        return times


def run_size(params_m: float, directory: str, window: int, warmup: int, reps: int) -> dict:
    contenders = {
        f"{placement}-{m}": Contender(placement, m, params_m, directory, window)
        for placement in ("memory", "nvme")
        for m in DTYPES
    }
    psi = sum(p.numel() for p in contenders["memory-fp32"].model.parameters())
    raw = round_robin({name: c.turn for name, c in contenders.items()}, warmup, reps)
    out: dict = {"params": psi}
    for m in DTYPES:
        report = contenders[f"nvme-{m}"].opt.memory_report()
        files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(directory, m)) for f in fs]
        out[m] = {
            "state_files_bytes": sum(os.path.getsize(f) for f in files),  # on disk, not the ledger
            "ledger_on_disk_bytes": sum(report.on_disk.values()),
            "files": sorted(os.path.basename(f) for f in files),
        }
        for placement in ("memory", "nvme"):
            times = raw[f"{placement}-{m}"]
            out[m][placement] = {"iteration": summary([t for t, _ in times]), "step": summary([s for _, s in times])}
        # what the nvme step costs the iteration, from each round's pair (a drift of the machine hits both)
        costs = [n - mi + ms for (n, _), (mi, ms) in zip(raw[f"nvme-{m}"], raw[f"memory-{m}"])]
        out[m]["nvme_step_cost"] = summary(costs)
        out[m]["step_io_bytes"] = 2 * out[m]["state_files_bytes"]  # every file read and written once per step
    out["cost_ratio_per_round"] = {
        m: statistics.median(
            (nb - mb + mbs) / (nf - mf + mfs)
            for (nb, _), (mb, mbs), (nf, _), (mf, mfs) in zip(
                raw[f"nvme-{m}"], raw[f"memory-{m}"], raw["nvme-fp32"], raw["memory-fp32"]
            )
        )
        for m in DTYPES
        if m != "fp32"
    }
    for c in contenders.values():
        c.opt.close()
    return out


def main() -> None:
    args, info = parse_and_start(__doc__, "16,64", "nvme_moments", "where the nvme state goes", "nvme_moment_dtype")
    results = []
    for size in [float(s) for s in args.sizes.split(",")]:
        results.append(run_size(size, args.dir, args.window, args.warmup, args.reps))
        r = results[-1]
        print(f"{r['params'] / 1e6:.1f}M: " + "; ".join(
            f"{m}: files {r[m]['state_files_bytes'] / MIB:.0f} MiB, nvme step cost "
            f"{r[m]['nvme_step_cost']['median_s'] * 1e3:.0f} ms" for m in DTYPES
        ) + "; cost / fp32's per round " + ", ".join(f"{m} {v:.3f}" for m, v in r["cost_ratio_per_round"].items()),
              flush=True)  # fmt: skip
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    for r in results:
        for m in DTYPES:
            s = r[m]
            rows.append([f"{r['params'] / 1e6:.1f}M", m, f"{s['state_files_bytes'] / r['params']:.2f}",
                         f"{s['state_files_bytes'] / MIB:.1f}",
                         f"{s['memory']['iteration']['median_s'] * 1e3:.0f}",
                         f"{s['nvme']['iteration']['median_s'] * 1e3:.0f}",
                         f"{s['nvme']['step']['median_s'] * 1e3:.0f}",
                         f"{s['nvme_step_cost']['median_s'] * 1e3:.0f} "
                         f"[{s['nvme_step_cost']['min_s'] * 1e3:.0f}-{s['nvme_step_cost']['max_s'] * 1e3:.0f}]",
                         f"{r['cost_ratio_per_round'][m]:.3f}" if m != "fp32" else ""])  # fmt: skip
    body = markdown_table(
        ["params", "moments", "state files (B/param)", "state files (MiB)", "memory iteration (ms)",
         "nvme iteration (ms)", "nvme step() (ms)", "nvme step cost (ms) [min-max]", "cost / fp32's (per round)"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\nOne rank, stage 2, bf16 parameters ({cores()} threads), bench_offload.py's model (square bf16 linear "
        f"layers, fp32 matmuls, batch 8); the contenders round robin, median of {args.reps} rounds after "
        f"{args.warmup} warm-up round(s), each timed iteration after an untimed one. nvme window "
        f"{args.window // MIB} MiB, directory {info['disk']}. 'state files' are the files' sizes on disk (fp32 "
        "master + moments: 12 B/param; with bf16 moments 4 + 2 + 2 = 8; int8 4 + 1 + 1 = 6; int8 with param_remainders "
        "1 + 1 = 2, the remainder and the int8 block scales in host memory), each read and written once per step. "
        "'nvme step cost' = nvme iteration - in-memory iteration + in-memory step() of the same moment dtype, per "
        "round, median [range]; the last column is the per-round ratio of the two costs.\n"
    )
    write_results(args.name, info, {"window": args.window, "sizes": results}, body, Path(args.out_dir))
    print(f"wrote {Path(args.out_dir) / args.name}.json, .md")


if __name__ == "__main__":
    main()
