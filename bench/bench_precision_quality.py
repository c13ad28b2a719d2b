"""Quality of the optimizer-state precisions, measured side by side: the benchmark GPT trained with ZeroAdamW's fp32
state, ``param_remainders=True``, ``moment_dtype=torch.bfloat16`` and ``moment_dtype=torch.int8``, against DDP +
torch.optim.AdamW (the anchor) and torchao's AdamW8bit on one process (the peer reference, when torchao is installed).

    python bench/bench_precision_quality.py                            # writes bench/out/precision_quality.*
    python bench/bench_precision_quality.py --out-dir bench/results    # refresh the committed results on purpose

Every run starts from the same weights (initialised in fp32 from --seed and rounded to bf16), sees the same global
batches (MarkovData: a pure function of seed and step), clips the gradient norm at 1.0 and runs forward under bf16
autocast. ZeroAdamW runs keep bf16 params (stage --stage, 2 gloo ranks); DDP and torchao keep fp32 params (torchao
sees the whole global batch on one process: the same mean loss as two ranks' averaged gradients, to rounding).

The table gives each run's final loss (the mean of the last --last steps' losses) and its gap to the fp32 run in
percent; the issue's bar is bf16 / int8 moments within --bar % of fp32. ``param_remainders`` must train bitwise as
fp32 (losses and final params); the max |diff| of both is printed. A run whose options the engine refuses at
construction (an unknown option, or int8 moments while the engine does not take them) is reported as skipped with
the engine's message; the other runs go on. Writes precision_quality.{json,md,png} to --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import asdict, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import GPT, MarkovData, add_model_args, model_config, num_params  # noqa: E402
from harness import OUT, RunConfig  # noqa: E402
from main_job_compute import describe, matmul_context, probe  # noqa: E402

# name -> (what trains it, ZeroAdamW options, label). Options are written as strings of torch dtypes so that a run's
# options print as typed; the engine sees torch dtypes.
RUNS = {
    "fp32": ("zero", {}, "ZeroAdamW, fp32 master and moments"),
    "remainders": ("zero", {"param_remainders": True}, "ZeroAdamW, param_remainders=True"),
    "bf16_moments": ("zero", {"moment_dtype": "bfloat16"}, "ZeroAdamW, moment_dtype=torch.bfloat16"),
    "int8_moments": ("zero", {"moment_dtype": "int8"}, "ZeroAdamW, moment_dtype=torch.int8"),
    "ddp": ("ddp", {}, "DDP + torch AdamW(fused), fp32 params"),
    "torchao_adamw8bit": ("torchao", {}, "torchao AdamW8bit, 1 process, fp32 params"),
}
BAR_RUNS = ("bf16_moments", "int8_moments")  # the issue's bar: within --bar % of fp32's final loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)} (default: all)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (split over the ranks)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks of the ZeroAdamW and DDP runs")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--last", type=int, default=20, help="final loss = mean of the last LAST steps' losses")
    p.add_argument("--bar", type=float, default=1.0, help="bf16/int8 moments: |gap to fp32| in percent (default 1)")
    p.add_argument("--smooth", type=int, default=20, help="the chart's moving-average window in steps")
    p.add_argument("--matmul", default="auto", choices=["auto", "bf16", "fp32"],
                   help="autocast's matmuls as bf16 or fp32 GEMMs (auto: bench/main_job_compute.py's probe)")  # fmt: skip
    p.add_argument("--out-dir", default=str(OUT), help="default bench/out/ (ignored by git); bench/results on purpose")
    p.add_argument("--name", default="precision_quality")
    p.add_argument("--no-chart", action="store_true")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {unknown}; expected some of {list(RUNS)}")
    if args.last < 1 or args.last > args.steps:
        p.error(f"--last must be in [1, --steps={args.steps}], got {args.last}")
    return args


# ------------------------------------------------------------------------------------------------ one run (a process)
def engine_options(options: dict) -> dict:
    return {k: getattr(torch, v) if k == "moment_dtype" else v for k, v in options.items()}


def build(kind: str, options: dict, cfg: RunConfig, device: torch.device):
    """(model, module to call, optimizer): the weights of harness.build (fp32 init from the seed, rounded to bf16)."""
    if kind == "ddp":
        return harness.build(replace(cfg, recipe="ddp"), cfg.model, device)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    hyper = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if kind == "torchao":
        from torchao.optim import AdamW8bit

        return model, model, AdamW8bit(model.parameters(), **hyper)
    import zero_ext

    model.to(device=device, dtype=torch.bfloat16)
    stage = int(cfg.recipe[-1])
    s3 = dict(module=model) if stage == 3 else {}
    opt = zero_ext.ZeroAdamW(model.named_parameters(), **hyper, stage=stage, max_grad_norm=cfg.max_grad_norm,
                             **s3, **engine_options(options))  # fmt: skip
    return model, model, opt


def train(rank: int, world: int, device: torch.device, kind: str, options: dict, cfg: RunConfig, matmul: str):
    """Rank 0's view of one run: losses (means over ranks), seconds of the training loop, final params (bf16 bits of
    ZeroAdamW's params; DDP/torchao: fp32), or ``{"refused": message}`` when construction raised on this rank."""
    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [data.batch(s, cfg.global_batch, rank, world) for s in range(cfg.steps)]
    try:
        model, net, opt = build(kind, options, cfg, device)
    except Exception as e:  # the engine refuses the options: every rank raises the same before any collective
        return {"refused": f"{type(e).__name__}: {e}"}
    clip = kind != "zero"  # ZeroAdamW clips inside step()
    losses = []
    t0 = time.perf_counter()
    for x, y in batches:
        with matmul_context(matmul), torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if rank == 0 and len(losses) % 50 == 0:  # a sign of life: a run takes minutes on a loaded machine
            print(f"  step {len(losses)}: loss {losses[-1].item():.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
    train_s = time.perf_counter() - t0
    loss_t = torch.stack(losses)
    if world > 1:
        dist.all_reduce(loss_t)
        loss_t /= world
    # Stage 3 keeps 1/N of every parameter between steps: read the full ones inside gathered_params() (collective).
    with opt.gathered_params() if cfg.recipe == "zero3" and kind == "zero" else contextlib.nullcontext():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": [float(v) for v in loss_t], "train_s": train_s, "params": params,
            "num_params": num_params(model), "skipped_steps": getattr(opt, "skipped_steps", 0)}  # fmt: skip


def run_one(name: str, cfg: RunConfig, world: int, matmul: str) -> dict:
    """One run in fresh processes; never raises: what went wrong is the run's record."""
    kind, options, label = RUNS[name]
    rec = {"label": label, "kind": kind, "options": options}
    if kind == "torchao" and importlib.util.find_spec("torchao") is None:
        return {**rec, "skipped": "torchao is not installed (pip install torchao==0.18.0; not a project dependency)"}
    start = time.perf_counter()
    try:
        out = harness.launch(train, 1 if kind == "torchao" else world, "cpu", kind, options, cfg, matmul)
    except Exception as e:  # a crash mid-run (e.g. a child raised): recorded, the other runs go on
        return {**rec, "skipped": f"failed: {type(e).__name__}: {str(e)[-800:]}", "wall_s": time.perf_counter() - start}
    rec["wall_s"] = time.perf_counter() - start
    rec["world_size"] = 1 if kind == "torchao" else world
    if "refused" in out:
        return {**rec, "skipped": f"refused by the engine: {out['refused']}"}
    return {**rec, **out}


# ------------------------------------------------------------------------------------------------ analysis
def final_loss(losses: list, last: int) -> float:
    return sum(losses[-last:]) / len(losses[-last:])


def max_abs_param_diff(a: dict, b: dict) -> float:
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def analyse(runs: dict, args) -> dict:
    """Final losses, gaps to fp32 (and to DDP), the bitwise check of remainders, the bar's verdicts."""
    trained = {n: r for n, r in runs.items() if "losses" in r}
    ref = trained.get("fp32")
    ddp = trained.get("ddp")
    for r in trained.values():
        r["final_loss"] = final_loss(r["losses"], args.last)
        r["min_loss"] = min(r["losses"])
        r["nonfinite_losses"] = sum(not math.isfinite(v) for v in r["losses"])
    for r in trained.values():
        if ref is not None:
            r["gap_to_fp32_pct"] = 100 * (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
        if ddp is not None:
            r["gap_to_ddp_pct"] = 100 * (r["final_loss"] - ddp["final_loss"]) / ddp["final_loss"]
    checks = {}
    rem = trained.get("remainders")
    if ref is not None and rem is not None:
        loss_diff = max(abs(a - b) for a, b in zip(rem["losses"], ref["losses"]))
        param_diff = max_abs_param_diff(rem["params"], ref["params"])
        equal = rem["losses"] == ref["losses"] and all(
            torch.equal(rem["params"][n], ref["params"][n]) for n in ref["params"]
        )
        first = next((i + 1 for i, (a, b) in enumerate(zip(rem["losses"], ref["losses"])) if a != b), None)
        checks["remainders_bitwise_fp32"] = {"ok": equal, "max_abs_loss_diff": loss_diff,
                                             "max_abs_param_diff": param_diff, "first_differing_step": first}  # fmt: skip
    for name in BAR_RUNS:
        r = runs.get(name)
        if r is None:
            continue
        if "losses" not in r or ref is None:
            checks[f"{name}_within_bar"] = {"ok": None, "why": r.get("skipped", "no fp32 run to compare with")}
        else:
            checks[f"{name}_within_bar"] = {
                "ok": abs(r["gap_to_fp32_pct"]) <= args.bar,
                "gap_pct": r["gap_to_fp32_pct"],
            }
    return checks


def verdict(ok) -> str:
    return {True: "PASS", False: "FAIL", None: "NOT RUN"}[ok]


def torchao_8bit_numel(model) -> int:
    """Elements whose moments torchao's AdamW8bit keeps in 8 bits: parameters of >= 4096 elements and a multiple of
    its block size, 256 (torchao 0.18, optim/adam.py ``_new_buffer``); the others keep fp32 moments."""
    return sum(p.numel() for p in model.parameters() if p.numel() >= 4096 and p.numel() % 256 == 0)


def render(runs: dict, checks: dict, args, meta_: dict, entropy: float, n_params: int, n_8bit: int) -> str:
    rows = []
    for name, r in runs.items():
        if "losses" not in r:
            rows.append([name, r["label"], "-", "-", "-", "-", f"{r.get('wall_s', 0):.0f}", f"skipped: {r['skipped']}"])
            continue
        gap = f"{r['gap_to_fp32_pct']:+.3f}" if "gap_to_fp32_pct" in r else "-"
        gap_ddp = f"{r['gap_to_ddp_pct']:+.3f}" if "gap_to_ddp_pct" in r else "-"
        rows.append([name, r["label"], r["world_size"], f"{r['final_loss']:.4f}", gap, gap_ddp, f"{r['wall_s']:.0f}",
                     f"train {r['train_s']:.0f} s, min loss {r['min_loss']:.4f}"])  # fmt: skip
    headers = ["run", "what", "ranks", f"final loss (mean of last {args.last})", "gap to fp32 %", "gap to DDP %",
               "wall s", "notes"]  # fmt: skip
    lines = [
        f"The benchmark GPT ({n_params:,} params: vocab {args.vocab}, seq {args.seq_len}, d_model {args.d_model}, "
        f"{args.layers} layers, {args.heads} heads), {args.steps} steps, global batch {args.batch} x {args.seq_len} "
        f"tokens, lr {args.lr}, betas (0.9, 0.95), weight decay 0.1, gradient norm clipped at 1.0, seed {args.seed}; "
        f"ZeroAdamW stage {args.stage} with bf16 params on {args.world_size} gloo ranks; {describe(meta_['matmul'])}. "
        f"Best possible loss {entropy:.4f} nats (the Markov chain's entropy rate).",
        "",
        harness.markdown_table(headers, rows),
        "",
        "Checks:",
        "",
    ]
    for key, c in checks.items():
        if key == "remainders_bitwise_fp32":
            lines.append(f"- {verdict(c['ok'])} param_remainders trains bitwise as fp32: max |dloss| "
                         f"{c['max_abs_loss_diff']:.3g} nats, max |dparam| {c['max_abs_param_diff']:.3g}, first "
                         f"differing step {c['first_differing_step']}")  # fmt: skip
        elif c["ok"] is None:
            lines.append(f"- {verdict(None)} {key.removesuffix('_within_bar')} within {args.bar} % of fp32: {c['why']}")
        else:
            lines.append(f"- {verdict(c['ok'])} {key.removesuffix('_within_bar')} within {args.bar} % of fp32's "
                         f"final loss: gap {c['gap_pct']:+.3f} %")  # fmt: skip
    lines += [
        "",
        "- gap = (final loss - fp32's final loss) / fp32's final loss; DDP's gap to fp32 is the size of a change of "
        "param dtype alone (fp32 params there, bf16 here): a scale for the others.",
        "- wall s: the run's processes from start to end (process start, data, and torchao's torch.compile included); "
        "train: the training loop alone. Other work on the 2 cores slows both.",
        "- torchao AdamW8bit: block size 256, dynamic-tree 8-bit maps (signed for exp_avg, unsigned for exp_avg_sq), "
        f"parameters under 4096 elements or not a multiple of 256 keep fp32 moments: {n_8bit:,} of {n_params:,} "
        f"elements ({100 * n_8bit / n_params:.1f} %) have 8-bit moments here; fp32 params, one process.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    meta_ = harness.meta(torch.device("cpu"))
    if args.matmul == "auto":
        m = probe(
            args.batch // args.world_size * args.seq_len, args.d_model, max(1, harness.cores() // args.world_size)
        )
    else:
        m = {"matmul": args.matmul, "decided_by": "--matmul"}
    meta_["matmul"] = m["matmul"]
    model_cfg = model_config(args)
    cfg = RunConfig(recipe=f"zero{args.stage}", model=model_cfg, steps=args.steps, global_batch=args.batch,
                    lr=args.lr, seed=args.seed)  # fmt: skip
    runs = {}
    for name in args.runs:
        print(f"[{name}] {RUNS[name][2]}: {args.steps} steps ...", flush=True)
        runs[name] = run_one(name, cfg, args.world_size, m["matmul"])
        r = runs[name]
        if "losses" in r:
            print(f"[{name}] last-{args.last} loss {final_loss(r['losses'], args.last):.4f}, {r['wall_s']:.0f} s",
                  flush=True)  # fmt: skip
        else:
            print(f"[{name}] SKIPPED: {r['skipped']}", flush=True)
    checks = analyse(runs, args)
    entropy = MarkovData(args.vocab, args.seq_len, seed=args.seed).entropy_rate()
    model = GPT(model_cfg)
    n_params, n_8bit = num_params(model), torchao_8bit_numel(model)
    body = render(runs, checks, args, meta_, entropy, n_params, n_8bit)
    print(body)
    payload = {
        "config": {
            **asdict(cfg),
            "model": asdict(model_cfg),
            "world_size": args.world_size,
            "last": args.last,
            "bar_pct": args.bar,
            "smooth": args.smooth,
            "matmul": m,
        },
        "entropy_rate": entropy,
        "num_params": n_params,
        "torchao_8bit_numel": n_8bit,
        "runs": {n: {k: v for k, v in r.items() if k != "params"} for n, r in runs.items()},
        "checks": checks,
    }
    paths = harness.write_results(args.name, meta_, payload, body, args.out_dir)
    if not args.no_chart:
        from precision_quality_chart import save_chart

        chart = save_chart(runs, entropy, args, os.path.join(args.out_dir, f"{args.name}.png"), checks)
        with open(paths[1], "a") as f:
            f.write(f"\n![loss curves]({os.path.basename(chart)})\n")
        paths.append(chart)
    for path in paths:
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
