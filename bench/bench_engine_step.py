"""Step time and per-rank model-state memory: ZeroAdamW stage 1 and 2 against DDP + torch AdamW(fused=True).

    python bench/bench_engine_step.py                    # CPU: 2 gloo processes
    python bench/bench_engine_step.py --device cuda      # GPU machine: every visible GPU, NCCL

Every contender trains the same GPT (bench/gpt_model.py) from the same weights on the same batches at the same
world size, all inside ONE process-group launch, interleaved round-robin: a turn of --steps-per-turn steps
per contender, --rounds times, after --warmup-rounds rounds that are not counted, so load swings hit all
contenders alike. Step time is the slowest rank's (forward + backward + clip + optimizer step + zero_grad).

Two comparisons, run interleaved together:
  fp32   apples to apples, no autocast: DDP + AdamW(fused) on fp32 params vs ZeroAdamW on fp32 params
         (their own master: 4 + 4 + 8 bytes/param in the formula).
  mixed  the recipes users compare: DDP fp32 params + bf16 autocast (bench/train_run.py's ``ddp``) vs
         ZeroAdamW with bf16 params + bf16 autocast (``zero1``/``zero2``, fp32 master inside).
Everyone clips the global gradient norm at 1.0 (DDP: clip_grad_norm_; ZeroAdamW: max_grad_norm).

Targets: ZeroAdamW's median step time <= 1.03x DDP's in the same comparison; persistent model state per rank
(memory_report()) == the ZeRO formula for this rank's share + declared padding + staging pool + fp32 grad
shard, exactly, and the rank's share within the padding of zero_ext.memory.estimate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import MarkovData, add_model_args, model_config, num_params  # noqa: E402
from launch import default_world, resolve_device  # noqa: E402
from launch import launch as run_on  # noqa: E402
from train_run import RunConfig, build, ddp_model_state, forward_backward  # noqa: E402

MIB = 2**20
TARGET_RATIO = 1.03
# name -> (comparison, recipe, param dtype label)
CONTENDERS = {
    "ddp_fp32": ("fp32", "ddp", "fp32"),
    "zero1_fp32": ("fp32", "zero1", "fp32"),
    "zero2_fp32": ("fp32", "zero2", "fp32"),
    "ddp_amp": ("mixed", "ddp", "fp32 + bf16 autocast"),
    "zero1_bf16": ("mixed", "zero1", "bf16 + bf16 autocast"),
    "zero2_bf16": ("mixed", "zero2", "bf16 + bf16 autocast"),
}
LABELS = {
    "ddp_fp32": "DDP + AdamW(fused), fp32",
    "zero1_fp32": "ZeroAdamW stage 1, fp32 params",
    "zero2_fp32": "ZeroAdamW stage 2, fp32 params",
    "ddp_amp": "DDP + AdamW(fused), fp32 params, bf16 autocast",
    "zero1_bf16": "ZeroAdamW stage 1, bf16 params, bf16 autocast",
    "zero2_bf16": "ZeroAdamW stage 2, bf16 params, bf16 autocast",
}


def forward_backward_fp32(cfg: RunConfig, model, net, x, y) -> torch.Tensor:
    loss = net(x, y)
    loss.backward()
    if net is not model:  # DDP: clip here; ZeroAdamW clips inside step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    return loss


class Contender:
    def __init__(self, name: str, cfg: RunConfig, device: torch.device):
        self.name = name
        self.comparison, recipe, self.dtype = CONTENDERS[name]
        dtype = "float32" if self.comparison == "fp32" else "bfloat16"
        self.cfg = RunConfig(**{**cfg.__dict__, "recipe": recipe, "param_dtype": dtype})
        self.model, self.net, self.opt = build(self.cfg, cfg.model, device)
        self.is_ddp = self.net is not self.model
        self.device = device
        self.times: list[list[float]] = []  # one list per counted round
        self.memory = None
        self.steps = 0

    def step(self, x, y) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if self.comparison == "fp32":
            forward_backward_fp32(self.cfg, self.model, self.net, x, y)
        else:
            forward_backward(self.cfg, self.model, self.net, self.opt, x, y, self.device)
        self.opt.step()
        if self.memory is None:  # persistent model state after the first step, grads still allocated
            self.memory = self.memory_ledger()
        self.opt.zero_grad(set_to_none=True)
        sync()
        self.steps += 1
        return time.perf_counter() - t0

    def memory_ledger(self) -> dict:
        import zero_ext

        psi = num_params(self.model)
        world = dist.get_world_size()
        if self.is_ddp:
            parts = ddp_model_state(self.model, self.net, self.opt)
            formula = int(zero_ext.memory.estimate(psi, world, 0, param_bytes=4, grad_bytes=4, optimizer_state_bytes=8))
            core = parts["params"] + parts["grads"] + parts["exp_avg"] + parts["exp_avg_sq"]
            return {
                "allocated": parts,
                "total": sum(parts.values()),
                "formula": formula,
                "estimate": formula,
                "core": core,
                "extra": {"ddp_buckets": parts["ddp_buckets"], "step": parts["step"]},
            }
        r = self.opt.memory_report()
        return {
            "allocated": dict(r.allocated),
            "total": r.total,
            "formula": r.formula,
            "estimate": r.estimate,
            "padding": r.padding,
            "staging": r.staging,
            "grad_shard_fp32": r.grad_shard_fp32,
            "owned_numel": r.owned_numel,
            "widths": r.widths,
        }


def bench(
    rank: int, world: int, device: torch.device, cfg: RunConfig, names: list, rounds: int, warmup: int, per_turn: int
) -> dict:
    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    n_batches = per_turn * 2
    batches = [data.batch(s, cfg.global_batch, rank, world) for s in range(n_batches)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    contenders = [Contender(n, cfg, device) for n in names]
    for r in range(warmup + rounds):
        for ct in contenders:  # round-robin: a turn of per_turn steps each
            dist.barrier()
            turn = [ct.step(*batches[ct.steps % n_batches]) for _ in range(per_turn)]
            if r >= warmup:
                ct.times.append(turn)
    out = {"threads_per_rank": torch.get_num_threads(), "num_params": num_params(contenders[0].model), "runs": {}}
    for ct in contenders:
        t = torch.tensor(ct.times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time, step by step
        ledgers = [None] * world
        dist.all_gather_object(ledgers, ct.memory)
        out["runs"][ct.name] = {"step_times_s": t.cpu().tolist(), "memory_by_rank": ledgers}
    return out


def time_stats(rounds: list) -> dict:
    flat = [t for turn in rounds for t in turn]
    q = statistics.quantiles(flat, n=4)
    return {
        "median_s": statistics.median(flat),
        "q1_s": q[0],
        "q3_s": q[2],
        "min_s": min(flat),
        "max_s": max(flat),
        "round_medians_s": [statistics.median(turn) for turn in rounds],
    }


def memory_check(name: str, ledgers: list) -> dict:
    """The identity on every rank, and the rank's share of the formula within the padding of the estimate."""
    out = []
    for led in ledgers:
        if name.startswith("ddp"):
            ok = led["core"] == led["formula"]
            out.append({"ok": ok, "gap_vs_formula": led["total"] - led["formula"]})
            continue
        parts = led["formula"] + led["padding"] + led["staging"] + led["grad_shard_fp32"]
        identity = parts == led["total"]
        share = led["formula"] - led["estimate"]
        within = abs(share) <= max(x["padding"] for x in ledgers) + 1e-6
        out.append({"ok": identity and within, "identity": identity, "rank_share_minus_estimate": share})
    return {"ok": all(r["ok"] for r in out), "by_rank": out}


def report(result: dict, names: list) -> tuple[str, list, bool]:
    runs = result["runs"]
    rows, time_ok, mem_ok = [], True, True
    for name in names:
        comp = CONTENDERS[name][0]
        s = runs[name]["stats"] = time_stats(runs[name]["step_times_s"])
        ddp = next(n for n in names if CONTENDERS[n][0] == comp and n.startswith("ddp"))
        base = runs[ddp]["stats"] if ddp in runs and "stats" in runs[ddp] else time_stats(runs[ddp]["step_times_s"])
        ratio = s["median_s"] / base["median_s"]
        paired = statistics.median(a / b for a, b in zip(s["round_medians_s"], base["round_medians_s"]))
        runs[name]["ratio_vs_ddp"], runs[name]["paired_round_ratio_vs_ddp"] = ratio, paired
        verdict = "-"
        if name != ddp:
            ok = ratio <= TARGET_RATIO
            time_ok &= ok
            verdict = f"{'PASS' if ok else 'FAIL'}"
        rows.append(
            [
                comp,
                LABELS[name],
                f"{s['median_s'] * 1e3:.0f}",
                f"{s['q1_s'] * 1e3:.0f}-{s['q3_s'] * 1e3:.0f}",
                f"{s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}",
                f"{ratio:.3f}x",
                f"{paired:.3f}x",
                verdict,
            ]
        )
    time_headers = [
        "comparison",
        "contender",
        "step ms median",
        "IQR ms",
        "min-max ms",
        "vs DDP (medians)",
        "vs DDP (median of per-round ratios)",
        f"<= {TARGET_RATIO}x",
    ]
    mem_rows = []
    for name in names:
        led = runs[name]["memory_by_rank"][0]
        chk = runs[name]["memory_check"] = memory_check(name, runs[name]["memory_by_rank"])
        mem_ok &= chk["ok"]
        if name.startswith("ddp"):
            extra = f"DDP buckets {led['extra']['ddp_buckets'] / MIB:.2f}"
            ident = "params + grads + exp_avg + exp_avg_sq == 16 Psi"
            pad = stg = gs = "-"
        else:
            extra = "-"
            ident = "total == formula + padding + staging + fp32 grad shard"
            pad, stg, gs = (f"{led[k] / MIB:.2f}" for k in ("padding", "staging", "grad_shard_fp32"))
        mem_rows.append(
            [
                LABELS[name],
                f"{led['total'] / MIB:.2f}",
                f"{led['formula'] / MIB:.2f}",
                f"{led['estimate'] / MIB:.2f}",
                pad,
                stg,
                gs,
                extra,
                f"{'PASS' if chk['ok'] else 'FAIL'} {ident} (every rank)",
            ]
        )
    mem_headers = [
        "contender",
        "model state MiB/rank",
        "formula (this rank)",
        "estimate",
        "padding",
        "staging",
        "fp32 grad shard",
        "other",
        "check",
    ]
    body = "\n".join(
        [
            "## Step time (slowest rank)",
            "",
            common.markdown_table(time_headers, rows),
            "",
            "## Persistent model state per rank (rank 0 shown; checks on every rank)",
            "",
            common.markdown_table(mem_headers, mem_rows),
        ]
    )
    verdicts = [
        f"{'PASS' if time_ok else 'FAIL'} step time: every ZeroAdamW contender's median <= {TARGET_RATIO}x the DDP "
        "median of its comparison",
        f"{'PASS' if mem_ok else 'FAIL'} model state: every contender's identity holds on every rank "
        "(ZeroAdamW: total == formula + padding + staging + fp32 grad shard, share within padding of the estimate)",
    ]
    return body, verdicts, time_ok and mem_ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--world-size", type=int, default=None, help="default: 2 on CPU, every GPU on CUDA")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=8, help="counted rounds of the round-robin")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--steps-per-turn", type=int, default=3)
    p.add_argument("--batch-per-rank", type=int, default=4)
    add_model_args(p)
    p.add_argument("--bucket-size", type=int, default=None, help="ZeroAdamW bucket size (default: the engine's)")
    p.add_argument("--out-dir", default=str(common.RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default: engine_step_<device>)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    world = args.world_size or default_world(device)
    names = args.contenders.split(",")
    for n in names:
        if n not in CONTENDERS:
            p.error(f"unknown contender {n!r}; expected some of {list(CONTENDERS)}")
    for comp in {CONTENDERS[n][0] for n in names}:
        if not any(CONTENDERS[n][0] == comp and n.startswith("ddp") for n in names):
            p.error(f"comparison {comp!r} needs its DDP baseline among --contenders")
    model = model_config(args)
    cfg = RunConfig(model=model, global_batch=args.batch_per_rank * world, bucket_size=args.bucket_size, progress=False)

    meta = common.meta(torch.device(device))  # at the start: the commit that ran
    result = run_on(bench, world, device, cfg, names, args.rounds, args.warmup_rounds, args.steps_per_turn)
    body, verdicts, all_ok = report(result, names)
    psi = result["num_params"]
    notes = [
        f"world size {world} ({'gloo' if device == 'cpu' else 'NCCL'}), {result['threads_per_rank']} torch "
        f"thread(s) per rank; Psi = {psi:,} params (d_model {args.d_model}, {args.layers} layers, vocab "
        f"{args.vocab}); {args.batch_per_rank} x {args.seq_len} tokens per rank per step; ZeroAdamW bucket size "
        f"{args.bucket_size or 'engine default'}; DDP defaults (25 MB buckets, gradient_as_bucket_view=False).",
        f"interleaved round-robin in one launch: {args.warmup_rounds} warm-up round(s), then {args.rounds} rounds "
        f"x {args.steps_per_turn} steps per contender; times are the slowest rank's per step.",
        "vs DDP (medians): median step time / the DDP median of the same comparison (the target's statistic); "
        "median of per-round ratios: the same from each round's medians (cancels slow load drifts).",
        "model state: ZeroAdamW from memory_report() after the first step; DDP from its params, .grad, AdamW "
        "state and DDP's own gradient buckets (a second fp32 copy of the grads). formula = "
        "zero_ext.memory.estimate for this rank's share (fp32: 4 + 4 + 8 bytes/param; bf16: 2 + 2 + 12).",
    ]
    text = "\n".join([body, "", *[f"- {v}" for v in verdicts], *[f"- {n}" for n in notes]])
    print(text)
    name = args.name or f"engine_step_{device}"
    written = common.write_results(name, meta, {"world_size": world, **result, "ok": all_ok}, text, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
