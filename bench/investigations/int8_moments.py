"""Which maps and block size for int8 AdamW moments: measured on the benchmark GPT's real moment trajectories.

Two measurements, single process on the CPU (bench/gpt_model.py's GPT and Markov data, the main job's defaults):

1. **Update error on the fp32 trajectory** (teacher forced, every config in one run): train with fp32 AdamW (the
   fp32 op ``zero_ext.ops.fused_adamw_``); every ``--probe-every`` steps quantize-dequantize the step's exp_avg and
   exp_avg_sq with each (map, block) and compare the update direction ``m_hat / (sqrt(v_hat) + eps)`` with the fp32
   one: relative L2 error, and the fraction of elements whose nonzero exp_avg_sq became 0 (their update is then
   ``m_hat / eps``: the failure mode of a map without enough range near 0).
2. **Simulated 8-bit AdamW** (closed loop, one run per config): the moments live only as codes + block scales;
   every step dequantizes them, does the fp32 update (the same op), requantizes with the new block absmax (what
   the int8 kernel does). Final loss (mean over fixed held-out batches) against the fp32 run's.

Parameters sit in one flat buffer, each starting 16-aligned (zero padding between them), as in the engine; blocks
are aligned to the buffer's start, so a block may hold the end of one parameter and the start of the next.

    PYTHONPATH=$PWD python bench/investigations/int8_moments.py --steps 300 \
        --out bench/investigations/int8_moments.json --md bench/investigations/int8_moments.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpt_model import GPT, GPTConfig, MarkovData  # noqa: E402

from zero_ext import ops  # noqa: E402
from zero_ext.update import blockwise_int8 as q8  # noqa: E402


def dynamic_map(
    signed: bool, total_bits: int = 8, exponent_bits: Optional[int] = None, zero: bool = True
) -> torch.Tensor:
    """The sorted dynamic quantization map (bitsandbytes' ``create_dynamic_map``) with ``2**total_bits`` values.

    Decade ``i`` (``i = 0 .. exponent_bits-1``) covers ``[10**(i+1-exponent_bits) * 0.1, 10**(i+1-exponent_bits)]``
    with the midpoints of a linear grid of ``2**(i + total_bits - 1 - exponent_bits)`` (signed, each sign) or twice
    that (unsigned) intervals; then 0 and 1. ``exponent_bits`` defaults to ``total_bits - 1``. ``zero=False``
    leaves 0 out (the "zero point" fix of Li et al. 2023 for the second moment: a small nonzero exp_avg_sq coded 0
    would make its update m/eps), which makes room for one more decade: ``dynamic_map(False, 7, 7, zero=False)``
    has the 8-bit unsigned map's 7 decades in 128 values."""
    non_sign_bits = total_bits - 1
    exponent_bits = non_sign_bits if exponent_bits is None else exponent_bits
    data: list[float] = []
    for i in range(exponent_bits):
        items = (
            2 ** (i + non_sign_bits - exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - exponent_bits + 1) + 1
        )
        bounds = torch.linspace(0.1, 1.0, items, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        decade = 10.0 ** (i + 1 - exponent_bits) * means
        data += decade.tolist() + ((-decade).tolist() if signed else [])
    extra = 2 ** (non_sign_bits - exponent_bits) - 1
    if extra > 0:  # bitsandbytes' "additional items": a finer grid of the top decade
        bounds = torch.linspace(0.1, 1.0, extra + 1, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += means.tolist() + ((-means).tolist() if signed else [])
    data += [0.0, 1.0] if zero else [1.0]
    if len(data) != 2**total_bits:
        raise ValueError(f"dynamic_map: {len(data)} values for {total_bits} bits")
    return torch.tensor(sorted(data), dtype=torch.float64).to(torch.float32)


def with_minus_one(qmap: torch.Tensor) -> torch.Tensor:
    """A signed map whose smallest positive value gives way to -1. bitsandbytes' signed map has +1 but not -1, so
    a block whose largest-magnitude element is negative decodes it as -0.993 x absmax, and quantizing the decoded
    block again finds a smaller absmax and moves every code of the block: a checkpoint (which holds the moments
    dequantized) would not load back into the same codes. With -1 a block's absmax element decodes to +-scale
    exactly, so ``quantize(dequantize(codes, scales))`` gives back ``codes, scales`` and a checkpoint resumes
    bitwise (tests/precision/test_moment_dtype.py). zero_ext's exp_avg map until 2026-11. The value given up, 5.5e-7, is the smallest positive one:
    positive values below 1.9e-6 x absmax round to 0 or 3.25e-6 instead."""
    smallest = qmap[qmap > 0].min()
    return torch.cat([qmap[qmap != smallest], torch.tensor([-1.0])]).sort().values


def linear_map(signed: bool, total_bits: int = 8) -> torch.Tensor:
    """A linear grid over [-1, 1] (signed; ``2**total_bits - 1`` values, 0 included, padded with one more 0) or
    [0, 1] (unsigned): the baseline the dynamic maps are measured against."""
    n = 2**total_bits
    if signed:
        grid = torch.linspace(-1.0, 1.0, n - 1, dtype=torch.float64)
        grid = torch.cat([grid, torch.zeros(1, dtype=torch.float64)]).sort().values
    else:
        grid = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    return grid.to(torch.float32)


# v maps: bitsandbytes' 8-bit unsigned dynamic map, the 7-bit nonnegative one (bit 7 free for the tie bit), linear.
V_MAPS = {
    "dyn8u": dynamic_map(False, 8),
    "dyn7": dynamic_map(False, 7, 6),
    "dyn7nz": dynamic_map(False, 7, 7, zero=False),
    "dyn8unz": dynamic_map(False, 8, 8, zero=False),
    "linear8u": linear_map(False, 8),
    "e5m2nz": q8.unsigned_minifloat_map(2),
    "e4m3nz": q8.unsigned_minifloat_map(3),
    "e3m4nz": q8.unsigned_minifloat_map(4),
}
M_MAPS = {
    "dyn8s": dynamic_map(True, 8),
    "linear8s": linear_map(True, 8),
    "e4m3s": q8.signed_minifloat_map(3),
    "e3m4s": q8.signed_minifloat_map(4),
    "e2m5s": q8.signed_minifloat_map(5),
}
BLOCKS = (64, 128, 256, 2048)
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def flat_layout(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[int], int]:
    params = list(model.parameters())
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off += -(-p.numel() // 16) * 16
    return params, offsets, -(-off // 2048) * 2048  # whole blocks of every size measured


def qdq(x: torch.Tensor, block: int, qmap: torch.Tensor) -> torch.Tensor:
    codes, scales = q8.quantize(x, block, qmap)
    return q8.dequantize(codes, scales, block, qmap)


def direction(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    bc1, bc2 = 1 - HP["beta1"] ** step, 1 - HP["beta2"] ** step
    return (m / bc1) / ((v / bc2).sqrt() + HP["eps"])


class Trainer:
    """The GPT on a flat fp32 master; ``moments`` = None (fp32) or (m map, v map, block) for the simulated int8."""

    def __init__(self, args, moments=None):
        torch.manual_seed(args.seed)
        self.cfg = GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
        self.model = GPT(self.cfg)
        self.data = MarkovData(args.vocab, args.seq_len, seed=args.seed)
        self.batch = args.batch
        self.params, self.offsets, n = flat_layout(self.model)
        self.master = torch.zeros(n)
        self.grad = torch.zeros(n)
        for p, o in zip(self.params, self.offsets):
            self.master[o : o + p.numel()] = p.detach().reshape(-1)
            p.data = self.master[o : o + p.numel()].view_as(p)
        self.moments = moments
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        if moments is not None:
            self.m_state = q8.quantize(self.m, moments[2], moments[0])
            self.v_state = q8.quantize(self.v, moments[2], moments[1])
        self.step_count = 0

    def train_step(self) -> float:
        x, y = self.data.batch(self.step_count, self.batch, 0, 1)
        for p in self.params:
            p.grad = None
        loss = self.model(x, y)
        loss.backward()
        self.grad.zero_()
        for p, o in zip(self.params, self.offsets):
            self.grad[o : o + p.numel()] = p.grad.reshape(-1)
        self.step_count += 1
        if self.moments is not None:
            mmap, vmap, block = self.moments
            self.m = q8.dequantize(*self.m_state, block, mmap)
            self.v = q8.dequantize(*self.v_state, block, vmap)
        ops.fused_adamw_(self.master, self.grad, self.m, self.v, step=self.step_count, **HP)
        if self.moments is not None:
            self.m_state = q8.quantize(self.m, block, mmap)
            self.v_state = q8.quantize(self.v, block, vmap)
        return float(loss)

    @torch.no_grad()
    def eval_loss(self, batches: int = 8) -> float:
        return sum(float(self.model(*self.data.batch(10**6 + i, self.batch, 0, 1))) for i in range(batches)) / batches


def teacher_forced(args) -> dict:
    t = Trainer(args)
    configs = [
        (mn, vn, b)
        for b in BLOCKS
        for mn, vn in (
            ("dyn8s", "dyn8u"),
            ("dyn8s", "dyn7"),
            ("dyn8s", "dyn7nz"),
            ("dyn8s", "dyn8unz"),
            ("linear8s", "linear8u"),
            ("e4m3s", "e5m2nz"),
            ("e4m3s", "e4m3nz"),
            ("e3m4s", "e5m2nz"),
            ("dyn8s", "e5m2nz"),
            ("e4m3s", "dyn7nz"),
            ("e3m4s", "e4m3nz"),
            ("e3m4s", "e3m4nz"),
            ("e2m5s", "e4m3nz"),
            ("e2m5s", "e5m2nz"),
            ("e4m3s", "e3m4nz"),
            ("e3m4s", "dyn7nz"),
            ("e2m5s", "dyn7nz"),
            ("dyn8s", "e4m3nz"),
            ("dyn8s", "e3m4nz"),
        )
    ]
    err = {c: [] for c in configs}
    zeroed = {c: [] for c in configs}
    stalled = {c: [] for c in configs}
    for s in range(1, args.steps + 1):
        t.train_step()
        if s % args.probe_every and s != 1:
            continue
        ref = direction(t.m, t.v, s)
        for mn, vn, b in configs:
            m_dq, v_dq = qdq(t.m, b, M_MAPS[mn]), qdq(t.v, b, V_MAPS[vn])
            got = direction(m_dq, v_dq, s)
            err[(mn, vn, b)].append(float((got - ref).norm() / ref.norm()))
            # elements that move (a tenth of a full Adam step or more) but would move less than a tenth as far
            moving = ref.abs() >= 0.1
            stalled[(mn, vn, b)].append(
                float((moving & (got.abs() < 0.1 * ref.abs())).sum()) / max(1, int(moving.sum()))
            )
            zeroed[(mn, vn, b)].append(float(((v_dq == 0) & (t.v > 0)).sum()) / max(1, int((t.v > 0).sum())))
        print(f"probe step {s}", flush=True)
    return {
        f"{mn}/{vn}/{b}": {
            "m_map": mn,
            "v_map": vn,
            "block": b,
            "update_rel_err_median": sorted(err[(mn, vn, b)])[len(err[(mn, vn, b)]) // 2],
            "update_rel_err_max": max(err[(mn, vn, b)]),
            "update_rel_err_last": err[(mn, vn, b)][-1],
            "v_zeroed_frac_max": max(zeroed[(mn, vn, b)]),
            "stalled_frac_max": max(stalled[(mn, vn, b)]),
        }  # fmt: skip
        for (mn, vn, b) in configs
    }


def closed_loop(args, name: str) -> dict:
    moments = (
        None if name == "fp32" else (M_MAPS[name.split("/")[0]], V_MAPS[name.split("/")[1]], int(name.split("/")[2]))
    )
    t = Trainer(args, moments)
    losses, evals, t0 = [], {}, time.perf_counter()
    for s in range(1, args.steps + 1):
        losses.append(t.train_step())
        if s % args.eval_every == 0 or s == args.steps:
            evals[s] = t.eval_loss()
    print(f"{name}: eval {evals[args.steps]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"eval_loss": evals, "train_loss": losses, "final_eval_loss": evals[args.steps],
            "final_train_loss_last20": sum(losses[-20:]) / 20}  # fmt: skip


def markdown(res: dict, args, command: str) -> str:
    lines = [
        "# int8 AdamW moments: maps x block sizes on the benchmark GPT",
        "",
        "Commands (each part of the measurement, run side by side into one JSON; then `--part md` wrote this file):",
        "",
        *sorted({f"    {v}" for k, v in res.items() if k.startswith("command_") and k != "command_num_params"}),
        "",
        f"torch {torch.__version__}, {res['num_params']:,} params, {args.steps} steps, batch {args.batch} x "
        f"{args.seq_len}, lr {HP['lr']}, betas ({HP['beta1']}, {HP['beta2']}), eps {HP['eps']}, wd "
        f"{HP['weight_decay']}, seed {args.seed}; CPU, one thread.",
        "",
        "## Simulated 8-bit AdamW (closed loop): final held-out loss vs fp32",
        "",
        "| config (m map / v map / block) | bytes per moment element | final eval loss | gap vs fp32 |",
        "|---|---|---|---|",
    ]
    base = res["closed_loop"]["fp32"]["final_eval_loss"]
    for name, r in res["closed_loop"].items():
        b = "4" if name == "fp32" else f"{1 + 4 / int(name.split('/')[2]):.4f}"
        gap = (r["final_eval_loss"] - base) / base * 100
        lines.append(f"| {name} | {b} | {r['final_eval_loss']:.4f} | {gap:+.2f} % |")
    steps = list(res["closed_loop"]["fp32"]["eval_loss"])
    lines += ["", "Held-out loss along the run (gap vs fp32 at the same step, %):", "",
              "| config | " + " | ".join(steps) + " |", "|---|" + "---|" * len(steps)]  # fmt: skip
    for name, r in res["closed_loop"].items():
        gaps = [
            (r["eval_loss"][s] - res["closed_loop"]["fp32"]["eval_loss"][s])
            / res["closed_loop"]["fp32"]["eval_loss"][s]
            * 100
            for s in steps
        ]
        lines.append(f"| {name} | " + " | ".join(f"{g:+.2f}" for g in gaps) + " |")
    lines += [
        "",
        "## Update direction error on the fp32 trajectory (teacher forced)",
        "",
        f"Probed at step 1 and every {args.probe_every} steps. Relative L2 error of m_hat/(sqrt(v_hat)+eps) after "
        "quantize-dequantize of both moments; `v zeroed` = largest fraction of nonzero exp_avg_sq elements coded 0; "
        "`stalled` = largest fraction of the elements that move (|direction| >= 0.1) whose quantized direction is "
        "under a tenth of theirs (an exp_avg coded 0, or an exp_avg_sq raised to its map's smallest value).",
        "",
        "| m map | v map | block | rel err median | rel err max | rel err last | v zeroed (max) | stalled (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["teacher_forced"].values():
        lines.append(
            f"| {r['m_map']} | {r['v_map']} | {r['block']} | {r['update_rel_err_median']:.4f} | "
            f"{r['update_rel_err_max']:.4f} | {r['update_rel_err_last']:.4f} | {r['v_zeroed_frac_max']:.2e} | "
            f"{r.get('stalled_frac_max', float('nan')):.2e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--part", default="all", help="all | teacher | md (only rewrite --md) | a comma list of closed-loop configs"
    )
    p.add_argument("--out", default="bench/investigations/int8_moments.json")
    p.add_argument("--md", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    command = "PYTHONPATH=$PWD python " + " ".join(sys.argv)
    n = sum(
        p.numel() for p in GPT(GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)).parameters()
    )

    def save(key, name, value):  # re-read first: parts of one measurement may run side by side into one file
        res = json.load(open(args.out)) if os.path.exists(args.out) else {"closed_loop": {}}
        res["num_params"], res["command_" + (name or key)] = n, command
        if name is None:
            res[key] = value
        else:
            res.setdefault(key, {})[name] = value
        json.dump(res, open(args.out, "w"), indent=1)
        return res

    res = save("num_params", None, n)
    if args.part in ("all", "teacher"):
        res = save("teacher_forced", None, teacher_forced(args))
    if args.part not in ("teacher", "md"):
        names = (["fp32"] + [f"dyn8s/{v}/{b}" for v in ("dyn8u", "dyn7") for b in BLOCKS] + ["linear8s/linear8u/256"]
                 if args.part == "all" else args.part.split(","))  # fmt: skip
        for name in names:
            res = save("closed_loop", name, closed_loop(args, name))
    if args.md and "teacher_forced" in res and "fp32" in res.get("closed_loop", {}):
        open(args.md, "w").write(markdown(res, args, command))


if __name__ == "__main__":
    main()
