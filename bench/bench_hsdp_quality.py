"""Quality of compressed inter-node gradient sums: the precision bench's GPT trained on a 2 x 2 mesh (4 gloo ranks,
``mesh=("replicate", "shard")``) with ``inter_node_reduce_dtype`` None (fp32 sums), torch.bfloat16 and torch.int8,
the same weights, batches, clipping and bf16 autocast as bench/bench_precision_quality.py (whose training loop and
options it shares), the final loss of each against the fp32 run's: the bars are 0.1 % (bf16) and 0.5 % (int8).

    python bench/bench_hsdp_quality.py --steps 300 --out-dir bench/results                  # the 3.3M GPT
    python bench/bench_hsdp_quality.py --d-model 128 --layers 2 --seq-len 64 --steps 300 \\
        --out-dir bench/results --name hsdp_quality_470k                                   # the 470k one

Writes <name>.{json,md} (default hsdp_quality) to --out-dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_precision_quality import final_loss  # noqa: E402
from gpt_model import GPT, MarkovData, add_model_args, model_config, num_params  # noqa: E402
from harness import OUT, RunConfig  # noqa: E402
from main_job_compute import describe, matmul_context  # noqa: E402

SETTINGS = {"fp32": None, "bf16": "bfloat16", "int8": "int8"}
BARS = {"bf16": 0.1, "int8": 0.5}  # |gap to fp32's final loss| in percent (issue 50)


def train(rank: int, world: int, device, setting, shape, cfg: RunConfig, matmul: str) -> dict:
    """Rank 0's losses (means over ranks) of one run on the ``shape`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import zero_ext

    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [data.batch(s, cfg.global_batch, rank, world) for s in range(cfg.steps)]
    torch.manual_seed(cfg.seed)
    model = GPT(c)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.to(dtype=torch.bfloat16)
    stage = int(cfg.recipe[-1])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    dtype = None if setting is None else getattr(torch, setting)
    opt = zero_ext.ZeroAdamW(model.named_parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             stage=stage, max_grad_norm=cfg.max_grad_norm, mesh=mesh, inter_node_reduce_dtype=dtype,
                             **(dict(module=model) if stage == 3 else {}))  # fmt: skip
    losses = []
    t0 = time.perf_counter()
    for x, y in batches:
        with matmul_context(matmul), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if rank == 0 and len(losses) % 50 == 0:
            print(f"  step {len(losses)}: loss {losses[-1].item():.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
    loss_t = torch.stack(losses)
    dist.all_reduce(loss_t)
    loss_t /= world
    stats = opt.comm_stats()
    opt.close()
    return {"losses": [float(v) for v in loss_t], "train_s": time.perf_counter() - t0,
            "inter_node_bytes": stats["inter_node_bytes"], "skipped_steps": opt.skipped_steps}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--mesh", default="2x2", help="R x S (default 2x2: 4 gloo ranks)")
    p.add_argument("--settings", default=",".join(SETTINGS))
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--last", type=int, default=20)
    p.add_argument("--matmul", default="fp32", choices=["bf16", "fp32"], help="as the committed precision runs")
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--name", default="hsdp_quality")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.mesh.split("x"))
    world = shape[0] * shape[1]
    meta_ = harness.meta(torch.device("cpu"))
    cfg = RunConfig(recipe=f"zero{args.stage}", model=model_config(args), steps=args.steps, global_batch=args.batch,
                    lr=args.lr, seed=args.seed)  # fmt: skip
    runs = {}
    for name in args.settings.split(","):
        print(f"[{name}] {args.steps} steps on a {args.mesh} mesh ...", flush=True)
        start = time.perf_counter()
        runs[name] = harness.launch(train, world, "cpu", SETTINGS[name], shape, cfg, args.matmul)
        runs[name]["wall_s"] = time.perf_counter() - start
        runs[name]["final_loss"] = final_loss(runs[name]["losses"], args.last)
        print(f"[{name}] final loss {runs[name]['final_loss']:.5f}", flush=True)
    ref = runs.get("fp32")
    rows, checks = [], {}
    for name, r in runs.items():
        gap = None if ref is None else 100 * (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
        r["gap_to_fp32_pct"] = gap
        if name in BARS and gap is not None:
            checks[name] = {"bar_pct": BARS[name], "gap_pct": gap, "ok": abs(gap) <= BARS[name]}
        rows.append([name, f"{r['final_loss']:.5f}", "-" if gap is None else f"{gap:+.4f}",
                     f"{r['inter_node_bytes'] / 2**20 / args.steps:.3f}", r["skipped_steps"], f"{r['train_s']:.0f}"])  # fmt: skip
    n_params = num_params(GPT(cfg.model))
    entropy = MarkovData(args.vocab, args.seq_len, seed=args.seed).entropy_rate()
    body = "\n".join(
        [
            f"The benchmark GPT ({n_params:,} params: vocab {args.vocab}, seq {args.seq_len}, d_model {args.d_model}, "
            f"{args.layers} layers), {args.steps} steps, global batch {args.batch} x {args.seq_len}, lr {args.lr}, "
            f"clipped at 1.0, seed {args.seed}; ZeroAdamW stage {args.stage}, bf16 params, on a {args.mesh} mesh of gloo "
            f"ranks; {describe(args.matmul)}. Best possible loss {entropy:.4f} nats.",
            "",
            harness.markdown_table(
                [
                    "inter_node_reduce_dtype",
                    f"final loss (mean of last {args.last})",
                    "gap to fp32 %",
                    "inter-node MiB / step / rank",
                    "skipped steps",
                    "train s",
                ],
                rows,
            ),  # fmt: skip
            "",
            "Checks:",
            "",
            *[
                f"- {'PASS' if c['ok'] else 'FAIL'} {n} within {c['bar_pct']} % of fp32's final loss: gap "
                f"{c['gap_pct']:+.4f} %"
                for n, c in checks.items()
            ],  # fmt: skip
        ]
    )
    print(body)
    payload = {"config": {**asdict(cfg), "mesh": shape, "last": args.last, "matmul": args.matmul},
               "runs": runs, "checks": checks}  # fmt: skip
    for path in harness.write_results(args.name, meta_, payload, body, args.out_dir):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
