"""Step time, memory per rank and communication volume against world size.

    python bench/bench_scaling.py                      # CPU: 1, 2, 3, 4 gloo processes
    python bench/bench_scaling.py --device cuda        # GPU: 1 .. every visible GPU, NCCL

Weak scaling: every rank trains the main job's GPT on the same per-rank batch, with DDP + torch AdamW
(fused) and ZeroAdamW stage 1 and 2. For every ZeroAdamW run it checks ZeRO-1/2's promise that a step
moves 2 * Psi elements: Psi reduce-scattered (gradients) + Psi all-gathered (params), each padded to
whole buckets (one rank: nothing), from the engine's own counters (``comm_stats()``) against the padded size of the flat param
buffer (``memory_report()``). Counted are the elements each rank hands to the collective, not wire bytes
(a ring moves (N-1)/N of them per rank).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from gpt_model import add_model_args, model_config  # noqa: E402
from launch import launch as run_on  # noqa: E402
from launch import resolve_device  # noqa: E402
from main_job_report import step_stats  # noqa: E402
from train_run import RECIPES, RunConfig, train  # noqa: E402

MIB = 2**20


def comm_check(run: dict) -> dict:
    """Elements per step through reduce-scatter and all-gather vs 2 * padded Psi (one rank: nothing at all)."""
    steps, world = run["config"]["steps"], run["world_size"]
    total, first = run["comm_total"], run["comm_first_step"]
    rs = first["reduce_scatter_elements"]
    ag = first["all_gather_elements"]
    padded, psi = run["padded_numel"], run["num_params"]
    every_step_same = all(total[k] == steps * first[k] for k in first)
    expected = padded if world > 1 else 0
    ok = rs == expected and ag == expected and every_step_same and padded >= psi
    return {
        "ok": ok,
        "psi": psi,
        "padded_psi": padded,
        "padding_elems": padded - psi,
        "reduce_scatter_elems_per_step": rs,
        "reduce_scatter_bytes_per_step": first["reduce_scatter_bytes"],
        "all_gather_elems_per_step": ag,
        "all_gather_bytes_per_step": first["all_gather_bytes"],
        "all_reduce_bytes_per_step": first["all_reduce_bytes"],
        "every_step_same": every_step_same,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--worlds", default=None, help="world sizes (default: 1,2,3,4 on CPU, 1..#GPUs on CUDA)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-per-rank", type=int, default=4)
    add_model_args(p)
    p.add_argument(
        "--bucket-size",
        type=int,
        default=2**19,
        help="ZeroAdamW bucket size (elements; the committed scaling results used 2**19)",
    )
    p.add_argument("--out-dir", default=str(common.RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default: scaling_<device>)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
    else:
        worlds = [1, 2, 3, 4] if device == "cpu" else list(range(1, torch.cuda.device_count() + 1))
    recipes = args.recipes.split(",")
    model = model_config(args)
    cores = len(os.sched_getaffinity(0))

    meta = common.meta(torch.device(device))  # at the start: the commit that ran
    runs, rows, checks = [], [], []
    for world in worlds:
        for recipe in recipes:
            cfg = RunConfig(
                recipe=recipe,
                model=model,
                steps=args.steps,
                warmup=2,
                global_batch=args.batch_per_rank * world,
                bucket_size=args.bucket_size,
                progress=False,
            )
            run = run_on(train, world, device, cfg)
            s = step_stats(run)
            c = comm_check(run) if recipe != "ddp" else None
            runs.append({"world_size": world, "recipe": recipe, "step": s, "comm_check": c, "run": run})
            comm = "-"
            if c:
                checks.append(c["ok"])
                verdict = "PASS" if c["ok"] else "FAIL"
                if world == 1:
                    comm = (
                        f"{c['reduce_scatter_elems_per_step']:,} + {c['all_gather_elems_per_step']:,} "
                        f"(one rank: nothing to communicate) {verdict}"
                    )
                else:
                    comm = (
                        f"{c['reduce_scatter_elems_per_step']:,} + {c['all_gather_elems_per_step']:,} = "
                        f"2 x {c['padded_psi']:,} ({c['padding_elems']:,} padding; "
                        f"{c['reduce_scatter_bytes_per_step'] / MIB:.2f} + {c['all_gather_bytes_per_step'] / MIB:.2f} "
                        f"MiB) {verdict}"
                    )
            row = [
                world,
                recipe,
                f"{run['model_state_total'] / MIB:.2f}",
                f"{run['estimate'] / MIB:.2f}",
                f"{run['peak_memory_bytes'] / MIB:.1f}",
                f"{s['median_s'] * 1e3:.0f} ({s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f})",
                f"{s['tokens_per_s']:.0f}",
                comm,
            ]
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)

    headers = [
        "N",
        "recipe",
        "model state MiB/rank",
        "estimate MiB/rank",
        "peak MiB/rank",
        "step ms median (min-max)",
        "tokens/s (all ranks)",
        "elements/step: reduce-scatter + all-gather",
    ]
    psi = runs[0]["run"]["num_params"]
    oversub = [w for w in worlds if device == "cpu" and w > cores]
    notes = [
        f"Psi = {psi:,} params; {args.batch_per_rank} sequences x {args.seq_len} tokens per rank per step (weak "
        f"scaling); {args.steps} steps, median after 2 warm-up steps, slowest rank.",
        f"peak memory: {runs[0]['run']['peak_memory_measure']}.",
        "comm check: the elements each rank passed to reduce-scatter and all-gather in the first step (the engine's "
        "comm_stats()), equal to the padded flat param buffer (memory_report()['params'] / 2) for N > 1 and zero for "
        "N = 1 (one rank skips communication), and the same on every step; the MiB are what travelled (on gloo bf16 "
        "gradients travel as bf16 and are summed in fp32 afterwards); plus one 8-byte all-reduce per step "
        "(gradient norm and inf check).",
    ]
    if oversub:
        notes.append(
            f"this machine has {cores} cores: N = {oversub} oversubscribe them (one thread per rank), so step time "
            "there measures time-sharing, not scaling."
        )
    all_ok = all(checks)
    verdict = (
        f"{'PASS' if all_ok else 'FAIL'} communication per step == 2 x padded Psi elements for every ZeroAdamW run"
    )
    print(verdict)
    print("\n".join(notes))
    body = "\n".join([common.markdown_table(headers, rows), "", f"- {verdict}", *[f"- {n}" for n in notes]])
    name = args.name or f"scaling_{device}"
    for r in runs:  # keep the result file readable: the per-step lists and the ledger text stay out
        for k in ("memory_table", "config"):
            r["run"].pop(k, None)
    written = common.write_results(name, meta, {"runs": runs, "comm_ok": all_ok}, body, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
