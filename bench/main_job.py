"""The main job: train a small GPT with today's standard recipe, then with ZeroAdamW stage 1 and stage 2.

    python bench/main_job.py                  # 2 gloo processes on CPU, or every visible GPU with NCCL

Recipes (same data, same seed, same starting weights, gradient norm clipped at 1.0):
  DDP + torch.optim.AdamW(fused=True), fp32 params, bf16 autocast   (16 bytes of model state per param)
  ZeroAdamW stage 1 / stage 2, bf16 params (fp32 master inside), bf16 autocast

Prints a table (per-rank model-state memory measured and from zero_ext.memory.estimate, peak memory, step
time, tokens/s, final loss), checks that the losses agree (stage 1 and stage 2 bitwise), and writes
bench/results/main_job.{md,json,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from gpt_model import MarkovData, add_model_args, model_config  # noqa: E402
from launch import default_world, launch, resolve_device  # noqa: E402
from main_job_report import agreement, render, save_chart  # noqa: E402
from train_run import RunConfig, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if visible")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: 2 on CPU, every GPU on CUDA)")
    p.add_argument("--stages", default="1,2", help="ZeroAdamW stages to run, comma-separated (default: 1,2)")
    p.add_argument("--no-baseline", action="store_true", help="skip the DDP + torch AdamW run")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (split over the ranks)")
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-size",
        type=int,
        default=0,
        help="ZeroAdamW bucket size in elements (default 0 = the engine's default: an eighth of the parameters on NCCL,\n"
        "a quarter on gloo, clamped to [N * 2**16, max(2**22, N * 2**18)], so reduction overlaps backward)",
    )
    p.add_argument(
        "--loss-tol",
        type=float,
        default=0.02,
        help="max |loss(ZeRO) - loss(DDP)| allowed at any step, in nats (default 0.02, see README)",
    )
    p.add_argument("--out-dir", default=str(common.RESULTS), help="where to write the results")
    p.add_argument("--name", default="main_job", help="result file stem (default: main_job)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-chart", action="store_true")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    args.world_size = args.world_size or default_world(args.device)
    if args.batch % args.world_size:
        p.error(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    args.stages = [int(s) for s in args.stages.split(",") if s]
    if not set(args.stages) <= {1, 2}:
        p.error("--stages takes 1 and/or 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    meta = common.meta(__import__("torch").device(args.device))  # at the start: the commit that ran
    model = model_config(args)
    recipes = ([] if args.no_baseline else ["ddp"]) + [f"zero{s}" for s in args.stages]
    world = args.world_size
    entropy = MarkovData(args.vocab, args.seq_len, seed=args.seed).entropy_rate()
    print(
        f"GPT d={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} seq={args.seq_len}; "
        f"global batch {args.batch} x {args.seq_len} tokens; {args.steps} steps; {world} x {args.device}; "
        f"data: Markov chain, best possible loss {entropy:.3f} nats"
    )
    runs = {}
    for recipe in recipes:
        cfg = RunConfig(
            recipe=recipe,
            model=model,
            steps=args.steps,
            global_batch=args.batch,
            lr=args.lr,
            seed=args.seed,
            bucket_size=args.bucket_size or None,
            progress=not args.no_progress,
        )
        runs[recipe] = launch(train, world, args.device, cfg)
    checks = agreement(runs, args.loss_tol)
    meta["wall_time_s"] = round(time.perf_counter() - t_start, 1)
    text, markdown = render(runs, checks, meta, entropy, args)
    print(text)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"entropy_rate": entropy, "checks": checks, "runs": runs}
    written = common.write_results(args.name, meta, payload, markdown, out)
    if not args.no_chart:
        written.append(save_chart(runs, out / f"{args.name}.png", meta))
    print("wrote " + ", ".join(str(p) for p in written))
    print(f"total wall time {time.perf_counter() - t_start:.1f} s")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
