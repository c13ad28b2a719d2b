"""What reading the next step's first chunks ahead buys an ``offload="nvme"`` training iteration: the optimizer as
shipped against the same optimizer with that read-ahead switched off (its ``step_done`` only waits for the writes,
as before the read-ahead existed), and the in-memory optimizer, round robin in one process on the same disk. Each
turn is bench_offload's: an untimed iteration, the timed one, then the wait for the timed one's read-ahead, so that
no contender's reads run into another's turn.

    python bench/nvme_read_ahead.py [--sizes 4,16,64] [--rounds 10] [--dir bench/out/read_ahead]

Per size: the median iteration (forward + backward + step() + zero_grad()) and step() of each, what the nvme step
costs the iteration (nvme iteration - memory iteration + memory step()), and whether the two nvme runs stay bitwise
equal. Writes results/nvme_read_ahead.{json,md}. Switching the read-ahead off patches one instance: a diagnostic,
not a configuration the library offers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics

import torch
from bench_offload import Contender
from harness import OUT, RESULTS, cores, markdown_table, meta, write_results

from zero_ext.offload import DEFAULT_WINDOW

VARIANTS = ("read_ahead", "no_read_ahead", "memory")


def without_read_ahead(contender: Contender) -> None:
    """``step_done`` as it was before the read-ahead: wait for every slot's writes, read nothing."""
    for group in contender.opt.sharded_state.groups:
        state = group.state

        def step_done(state=state):
            for slot in state.slots:
                slot.wait_free()

        state.step_done = step_done


def run_size(size: float, directory: str, rounds: int) -> dict:
    runs = {}
    for name in VARIANTS:
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        runs[name] = Contender("memory" if name == "memory" else "nvme", size, os.path.join(directory, name),
                               DEFAULT_WINDOW)  # fmt: skip
    without_read_ahead(runs["no_read_ahead"])
    try:
        for c in runs.values():  # the first step reads never-written (fallocated) blocks: not timed
            c.iteration()
            c.settle()
        times = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name, c in runs.items():
                times[name].append(c.turn())  # primed, timed, then its read-ahead waited for (untimed)
        bitwise = all(torch.equal(a, b) for a, b in zip(runs["read_ahead"].params(), runs["no_read_ahead"].params()))
        psi = sum(p.numel() for p in runs["memory"].model.parameters())
    finally:
        for c in runs.values():
            c.opt.close()
    out = {"params": psi, "bitwise_equal": bitwise, "times_s": times}
    med = {n: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v)) for n, v in times.items()}
    for name in VARIANTS:
        out[name] = {"iteration_s": med[name][0], "step_s": med[name][1]}
    for name in ("read_ahead", "no_read_ahead"):
        out[name]["step_cost_s"] = med[name][0] - med["memory"][0] + med["memory"][1]
    # per round: each round's nvme iterations against each other (a drift of the machine hits both)
    out["iteration_ratio_per_round"] = statistics.median(
        a / b for (a, _), (b, _) in zip(times["read_ahead"], times["no_read_ahead"])
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,16,64", help="model sizes, millions of parameters")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dir", default=str(OUT / "read_ahead"))
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--name", default="nvme_read_ahead")
    args = ap.parse_args()
    torch.set_num_threads(cores())
    info = meta(torch.device("cpu"))
    results = []
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            results.append(run_size(size, args.dir, args.rounds))
            print(results[-1]["params"], {n: results[-1][n] for n in VARIANTS}, flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    rows = [[f"{r['params'] / 1e6:.1f}M", ms(r["memory"]["iteration_s"]),
             *(f"{ms(r[n]['iteration_s'])} / {ms(r[n]['step_s'])} / {ms(r[n]['step_cost_s'])}"
               for n in ("no_read_ahead", "read_ahead")),
             f"{r['iteration_ratio_per_round']:.3f}x", "yes" if r["bitwise_equal"] else "NO"] for r in results]  # fmt: skip
    body = markdown_table(["params", "memory iteration (ms)", "nvme without read-ahead: iteration / step() / step cost (ms)",
                           "nvme with read-ahead (as shipped): iteration / step() / step cost (ms)",
                           "iteration with / without (per round)", "bitwise equal"], rows)  # fmt: skip
    body += (
        f"\n\nOne rank, stage 2, bf16 params, {cores()} threads, window {DEFAULT_WINDOW >> 20} MiB (bench_offload.py's "
        f"model: 8 square linear layers, batch 8); medians of {args.rounds} round-robin rounds after one untimed "
        "iteration each. 'step cost' = nvme iteration - memory iteration + memory step(): what the nvme step costs "
        "the iteration, reads run during forward and backward included.\n"
    )
    write_results(args.name, info, {"config": vars(args), "sizes": results}, body, args.out_dir)
    print(body)


if __name__ == "__main__":
    main()
