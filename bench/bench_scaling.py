"""Step time, memory per rank and communication volume against world size.

    python bench/bench_scaling.py                      # CPU: 1, 2, 3, 4 gloo processes
    python bench/bench_scaling.py --device cuda        # GPU: 1 .. every visible GPU, NCCL

Weak scaling: every rank trains the main job's GPT on the same per-rank batch, with DDP + torch AdamW (fused)
and ZeroAdamW stages 1, 2 and 3 (the main job's training run, ``main_job.train``, at each world size; ``zero3_keep``
is stage 3 with ``reshard_after_forward=False``). For every ZeroAdamW run it checks the communication volume per
step, from the engine's own counters (``comm_stats()``) against the padded size of the flat param buffer
(``memory_report()``), each collective padded to whole buckets (one rank: nothing):
  stages 1, 2: 2 Psi (Psi reduce-scattered (gradients) + Psi all-gathered (params)), every step;
  stage 3: 3 Psi (Psi reduce-scattered + Psi all-gathered before forward + Psi again before backward, less the
  buckets backward needs first, which forward keeps: ``harness.kept_for_backward_numel``), or 2 Psi
  with reshard_after_forward=False, every step after the first (the first forward has no learned order yet and
  frees after every use: it is reported, not checked).
Counted are the elements each rank hands to the collective, not wire bytes (a ring moves (N-1)/N of them per rank);
the all-gather's bytes are checked too (its elements in the param dtype: nothing gathered twice, nothing wider).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
from gpt_model import add_model_args, model_config  # noqa: E402
from harness import MIB, RECIPES, RunConfig  # noqa: E402
from main_job import train  # noqa: E402


def comm_check(run: dict) -> dict:
    """Elements per step through reduce-scatter and all-gather vs the padded Psi: 1 + 1 at stages 1 and 2, 1 + 2 at
    stage 3 less the buckets kept from forward for backward (1 + 1 without resharding after forward) from the
    second step on (one rank: nothing at all)."""
    world, by_step = run["world_size"], run["comm_by_step"]
    stage3 = run["recipe"] == "zero3"
    gathers = 2 if stage3 and run["config"]["reshard_after_forward"] else 1
    checked = by_step[1:] if stage3 and len(by_step) > 1 else by_step
    step = checked[0]
    rs, ag = step["reduce_scatter_elements"], step["all_gather_elements"]
    padded, psi = run["padded_numel"], run["num_params"]
    every_step_same = all(c == step for c in checked)
    kept = run.get("kept_for_backward_numel", 0)
    expected_rs, expected_ag = (padded, gathers * padded - kept) if world > 1 else (0, 0)
    itemsize = getattr(torch, run["config"]["param_dtype"]).itemsize
    ag_bytes_ok = step["all_gather_bytes"] == expected_ag * itemsize
    ok = rs == expected_rs and ag == expected_ag and ag_bytes_ok and every_step_same and padded >= psi
    return {
        "ok": ok,
        "psi": psi,
        "padded_psi": padded,
        "padding_elems": padded - psi,
        "psi_per_step": 1 + gathers,  # what a step should move, in padded Psi (less kept_for_backward_elems)
        "kept_for_backward_elems": kept,
        "steps_checked": "2nd onwards" if checked is not by_step else "every",
        "reduce_scatter_elems_per_step": rs,
        "reduce_scatter_bytes_per_step": step["reduce_scatter_bytes"],
        "all_gather_elems_per_step": ag,
        "all_gather_bytes_per_step": step["all_gather_bytes"],
        "expected_all_gather_bytes_per_step": expected_ag * itemsize,
        "all_reduce_bytes_per_step": step["all_reduce_bytes"],
        "first_step_all_gather_elems": by_step[0]["all_gather_elements"],
        "every_step_same": every_step_same,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--worlds", default=None, help="world sizes (default: 1,2,3,4 on CPU, 1..#GPUs on CUDA)")
    p.add_argument("--recipes", default=",".join([*RECIPES, "zero3_keep"]),
                   help="of ddp, zero1, zero2, zero3, zero3_keep (stage 3, reshard_after_forward=False)")  # fmt: skip
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-per-rank", type=int, default=4)
    add_model_args(p)
    p.add_argument(
        "--bucket-size",
        type=int,
        default=2**19,
        help="ZeroAdamW bucket size (elements; the committed scaling results used 2**19)",
    )
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default: scaling_<device>)")
    args = p.parse_args(argv)
    device = harness.resolve_device(args.device)
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
    else:
        worlds = [1, 2, 3, 4] if device == "cpu" else list(range(1, torch.cuda.device_count() + 1))
    recipes = args.recipes.split(",")
    for r in recipes:
        if r not in (*RECIPES, "zero3_keep"):
            p.error(f"unknown recipe {r!r}")
    model = model_config(args)
    cores = harness.cores()

    meta = harness.meta(torch.device(device))  # at the start: the commit that ran
    runs, rows, checks = [], [], []
    for world in worlds:
        for recipe in recipes:
            cfg = RunConfig(
                recipe=recipe.removesuffix("_keep"),
                reshard_after_forward=not recipe.endswith("_keep"),
                model=model,
                steps=args.steps,
                warmup=2,
                global_batch=args.batch_per_rank * world,
                bucket_size=args.bucket_size,
            )
            run = harness.launch(train, world, device, cfg)
            s = harness.step_stats(run)
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
                        f"{c['psi_per_step']} x {c['padded_psi']:,}"
                        + (f" - {c['kept_for_backward_elems']:,} kept" if c["kept_for_backward_elems"] else "")
                        + f" ({c['padding_elems']:,} padding; "
                        f"{c['reduce_scatter_bytes_per_step'] / MIB:.2f} + {c['all_gather_bytes_per_step'] / MIB:.2f} "
                        f"MiB) {verdict}"
                    )
                    if c["steps_checked"] != "every":
                        comm += f" (steps 2+; step 1 all-gathered {c['first_step_all_gather_elems']:,})"
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
        "comm check: the elements each rank passed to reduce-scatter and all-gather per step (the engine's "
        "comm_stats()), against the padded flat param buffer (memory_report()['params'] / 2; stage 3 keeps 1/N of "
        "it: x N) for N > 1 and zero for N = 1 (one rank skips communication), the same on every step: 1 + 1 padded "
        "Psi at stages 1 and 2, 1 + 2 at stage 3 less the buckets backward needs first, kept from forward ('kept'; "
        "zero3_keep, reshard_after_forward=False: 1 + 1) from step 2 on (the "
        "first stage-3 forward has no learned order and frees after every use; its all-gather is shown); the MiB are "
        "what travelled (on gloo bf16 gradients travel as bf16 and are summed in fp32 afterwards); plus one 8-byte "
        "all-reduce per step (gradient norm and inf check).",
    ]
    if oversub:
        notes.append(
            f"this machine has {cores} cores: N = {oversub} oversubscribe them (one thread per rank), so step time "
            "there measures time-sharing, not scaling."
        )
    all_ok = all(checks)
    verdict = (
        f"{'PASS' if all_ok else 'FAIL'} communication per step == 2 x padded Psi elements for every ZeroAdamW stage "
        "1 and 2 run, 3 x (stage 3) and 2 x (stage 3, reshard_after_forward=False)"
    )
    print(verdict)
    print("\n".join(notes))
    body = "\n".join([harness.markdown_table(headers, rows), "", f"- {verdict}", *[f"- {n}" for n in notes]])
    name = args.name or f"scaling_{device}"
    for r in runs:  # keep the result file readable: the per-step lists and the ledger text stay out
        r["run"].pop("config", None)
    written = harness.write_results(name, meta, {"runs": runs, "comm_ok": all_ok}, body, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
