"""Step time and per-rank model-state memory: ZeroAdamW stages 1, 2, 3 against DDP + torch AdamW(fused=True), and
against PyTorch's own sharded peers (FSDP2, ZeroRedundancyOptimizer) and a naive per-parameter ZeRO-3.

    python bench/bench_engine_step.py                    # CPU: 2 gloo processes
    python bench/bench_engine_step.py --device cuda      # GPU machine: every visible GPU, NCCL

Every contender trains the same GPT (bench/gpt_model.py, built by harness.build or peers.Peer) from the same weights
on the same batches at the same world size, all inside ONE process-group launch, interleaved round-robin: a turn of
--steps-per-turn steps per contender, --rounds times, after --warmup-rounds rounds that are not counted, so load
swings hit all contenders alike. Step time is the slowest rank's (forward + backward + clip + optimizer step +
zero_grad). Before the rounds every contender runs two untimed steps; the second measures its model state.

Two comparisons, run interleaved together:
  fp32   apples to apples, no autocast: DDP + AdamW(fused) on fp32 params vs ZeroAdamW on fp32 params
         (their own master: 4 + 4 + 8 bytes/param in the formula).
  mixed  the recipes users compare: DDP fp32 params + bf16 autocast (the main job's ``ddp``) vs ZeroAdamW with
         bf16 params + bf16 autocast (``zero1``/``zero2``/``zero3``, fp32 master inside), and the peers
         (bench/peers.py: FSDP2 with bf16 param / fp32 reduce mixed precision, with and without resharding after
         forward; DDP + ZeroRedundancyOptimizer; the naive ZeRO-3 of bench/naive_zero3.py), all under bf16 autocast.
Everyone clips the global gradient norm at 1.0.

Targets: ZeroAdamW stages 1 and 2: median step time <= 1.03x DDP's in the same comparison; stage 3 (bf16):
<= 1.15x DDP's and below FSDP2's (fully_shard, resharding after forward); persistent model state per rank
(memory_report()) == the ZeRO formula for this rank's share + declared padding + staging pool + fp32 grad shard,
exactly, and the share within the padding of zero_ext.memory.estimate; stage 3's persistent model state <= FSDP2's
+ stage 3's declared window (window_bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import peers  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from engine_step_report import report  # noqa: E402
from gpt_model import MarkovData, add_model_args, model_config, num_params  # noqa: E402
from harness import RunConfig, build, forward_backward, model_state  # noqa: E402

# name -> (comparison, recipe, param dtype label); recipes: harness.RECIPES (+ "zero3_keep") or peers.PEERS
CONTENDERS = {
    "ddp_fp32": ("fp32", "ddp", "fp32"),
    "zero1_fp32": ("fp32", "zero1", "fp32"),
    "zero2_fp32": ("fp32", "zero2", "fp32"),
    "zero3_fp32": ("fp32", "zero3", "fp32"),
    "fsdp2_fp32": ("fp32", "fsdp2_fp32", "fp32"),
    "ddp_amp": ("mixed", "ddp", "fp32 + bf16 autocast"),
    "zero1_bf16": ("mixed", "zero1", "bf16 + bf16 autocast"),
    "zero2_bf16": ("mixed", "zero2", "bf16 + bf16 autocast"),
    "zero3_bf16": ("mixed", "zero3", "bf16 + bf16 autocast"),
    "zero3_bf16_keep": ("mixed", "zero3_keep", "bf16 + bf16 autocast"),
    "fsdp2": ("mixed", "fsdp2", "fp32 sharded, bf16 compute"),
    "fsdp2_keep": ("mixed", "fsdp2_keep", "fp32 sharded, bf16 compute"),
    "zero_redundancy": ("mixed", "zero_redundancy", "fp32 + bf16 autocast"),
    "naive_zero3": ("mixed", "naive_zero3", "fp32 shards, bf16 gathers"),
}
LABELS = {
    "ddp_fp32": "DDP + AdamW(fused), fp32",
    "zero1_fp32": "ZeroAdamW stage 1, fp32 params",
    "zero2_fp32": "ZeroAdamW stage 2, fp32 params",
    "zero3_fp32": "ZeroAdamW stage 3, fp32 params",
    "ddp_amp": "DDP + AdamW(fused), fp32 params, bf16 autocast",
    "zero1_bf16": "ZeroAdamW stage 1, bf16 params, bf16 autocast",
    "zero2_bf16": "ZeroAdamW stage 2, bf16 params, bf16 autocast",
    "zero3_bf16": "ZeroAdamW stage 3, bf16 params, bf16 autocast",
    "zero3_bf16_keep": "ZeroAdamW stage 3, reshard_after_forward=False, bf16 params, bf16 autocast",
    **{k: v for k, v in peers.LABELS.items()},
}
DEFAULT = [n for n in CONTENDERS if n not in ("zero3_fp32", "fsdp2_fp32")]


class Contender:
    """One recipe of one comparison, built once; ``turn`` times a few steps of it."""

    def __init__(self, name: str, cfg: RunConfig, device: torch.device):
        self.name, self.device = name, device
        comparison, recipe, _ = CONTENDERS[name]
        self.peer = None
        if recipe in peers.PEERS:
            self.cfg = cfg
            self.peer = peers.Peer(recipe, cfg, cfg.model, device)
            self.model = self.peer.model
        else:
            fp32 = comparison == "fp32"
            self.cfg = RunConfig(**{**cfg.__dict__, "recipe": recipe.removesuffix("_keep"),
                                    "param_dtype": "float32" if fp32 else "bfloat16", "autocast": not fp32,
                                    "reshard_after_forward": not recipe.endswith("_keep")})  # fmt: skip
            self.model, self.net, self.opt = build(self.cfg, cfg.model, device)
        self.call = None  # forward's callable when compiled: the DDP wrapper, the FSDP2 root, ZeroAdamW's model
        if cfg.compile_backend:
            if self.peer is not None:
                self.peer.call = torch.compile(self.peer.net, backend=cfg.compile_backend)
            else:
                self.call = torch.compile(self.net, backend=cfg.compile_backend)
        self.memory = None  # model state after the measured step, grads still allocated
        self.steps = 0
        self.losses: list[torch.Tensor] = []  # this rank's loss at every step (all contenders see the same batches)
        self.comm_s: list[float] = []  # naive ZeRO-3: seconds blocked in collectives, step by step

    def turn(self, batches: list, per_turn: int) -> list[float]:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        return [harness.timed(lambda: self.step(*batches[self.steps % len(batches)]), sync) for _ in range(per_turn)]

    def step(self, x, y, measure: bool = False) -> None:
        self.steps += 1
        if self.peer is not None:
            before = self.peer.naive.comm_s if self.peer.naive is not None else 0.0
            loss, led = self.peer.step(x, y, measure)
            if self.peer.naive is not None:
                self.comm_s.append(self.peer.naive.comm_s - before)
        else:
            loss = forward_backward(self.cfg, self.model, self.net, x, y, self.device, self.call).detach()
            self.opt.step()
            led = model_state(self.model, self.net, self.opt) if measure else None
            self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss)
        if measure:
            self.memory = led

    def finish(self) -> dict:
        """What the run records beyond step times: stage 3's window peak over every step, the naive ZeRO-3's
        time blocked in collectives."""
        out = {"losses_rank0": [float(v) for v in self.losses]}
        if self.peer is None and self.cfg.recipe == "zero3":
            out["window_peak_all_steps"] = self.opt.memory_report().window_peak
            out["comm_elements"] = self.opt.comm_stats()
        if self.peer is not None and self.peer.naive is not None:
            counted = self.comm_s[2:] or self.comm_s  # after the two untimed steps
            out["naive"] = {"comm_s_median_per_step": statistics.median(counted), "comm_s_per_step": self.comm_s,
                            "collectives_per_step": self.peer.naive.collectives // self.steps}  # fmt: skip
        return out


def bench(
    rank: int, world: int, device: torch.device, cfg: RunConfig, names: list, rounds: int, warmup: int, per_turn: int
) -> dict:
    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [tuple(t.to(device) for t in data.batch(s, cfg.global_batch, rank, world)) for s in range(2 * per_turn)]
    contenders = {n: Contender(n, cfg, device) for n in names}
    for ct in contenders.values():  # untimed: one step, then one that measures the model state
        ct.step(*batches[0])
        ct.step(*batches[1], measure=True)
    turns = harness.round_robin({n: (lambda ct=ct: ct.turn(batches, per_turn)) for n, ct in contenders.items()},
                                warmup, rounds, before=dist.barrier)  # fmt: skip
    psi = num_params(contenders[names[0]].model)
    out = {"threads_per_rank": torch.get_num_threads(), "num_params": psi, "runs": {}}
    for name, ct in contenders.items():
        t = torch.tensor(turns[name], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time, step by step
        ledgers = [None] * world
        dist.all_gather_object(ledgers, ct.memory)
        out["runs"][name] = {"step_times_s": t.cpu().tolist(), "memory_by_rank": ledgers, **ct.finish()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--world-size", type=int, default=None, help="default: 2 on CPU, every GPU on CUDA")
    p.add_argument("--contenders", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=8, help="counted rounds of the round-robin")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--steps-per-turn", type=int, default=3)
    p.add_argument("--batch-per-rank", type=int, default=4)
    add_model_args(p)
    p.add_argument("--bucket-size", type=int, default=None, help="ZeroAdamW bucket size (default: the engine's)")
    p.add_argument(
        "--compile",
        default=None,
        choices=["eager", "inductor"],
        help="torch.compile every contender's model with this backend (the two untimed steps compile)",
    )
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default: engine_step_<device>)")
    args = p.parse_args(argv)
    device = harness.resolve_device(args.device)
    world = args.world_size or harness.default_world(device)
    names = args.contenders.split(",")
    for n in names:
        if n not in CONTENDERS:
            p.error(f"unknown contender {n!r}; expected some of {list(CONTENDERS)}")
    for comp in {CONTENDERS[n][0] for n in names}:
        if not any(CONTENDERS[n][0] == comp and n.startswith("ddp") for n in names):
            p.error(f"comparison {comp!r} needs its DDP baseline among --contenders")
    model = model_config(args)
    cfg = RunConfig(model=model, global_batch=args.batch_per_rank * world, bucket_size=args.bucket_size,
                    compile_backend=args.compile)  # fmt: skip

    meta = harness.meta(torch.device(device))  # at the start: the commit that ran
    result = harness.launch(bench, world, device, cfg, names, args.rounds, args.warmup_rounds, args.steps_per_turn)
    body, verdicts, ok = report(result, names, CONTENDERS, LABELS)
    psi = result["num_params"]
    notes = [
        f"world size {world} ({'gloo' if device == 'cpu' else 'NCCL'}), {result['threads_per_rank']} torch "
        f"thread(s) per rank; Psi = {psi:,} params (d_model {args.d_model}, {args.layers} layers, {args.heads} "
        f"heads, vocab {args.vocab}, seq {args.seq_len}); {args.batch_per_rank} x {args.seq_len} tokens per rank "
        f"per step; ZeroAdamW bucket size {args.bucket_size or 'engine default'}; DDP defaults (25 MB buckets, "
        "gradient_as_bucket_view=False)"
        + (
            f"; every model torch.compile'd (backend {args.compile!r}; compiled during the untimed steps)."
            if args.compile
            else "."
        ),
        f"interleaved round-robin in one launch: {args.warmup_rounds} warm-up round(s), then {args.rounds} rounds "
        f"x {args.steps_per_turn} steps per contender; times are the slowest rank's per step.",
        "vs DDP (medians): median step time / the DDP median of the same comparison (the targets' statistic); "
        "per-round ratios: the same from each round's medians (cancels slow load drifts), median [min-max].",
        "model state (persistent, after the optimizer step, grads still allocated): ZeroAdamW from memory_report(); "
        "DDP from its params, .grad, AdamW state and DDP's own gradient buckets; FSDP2 from the local shards of its "
        "DTensor params, grads and AdamW state; ZeroRedundancyOptimizer: full params + grads + DDP buckets + the "
        "local optimizer's state; naive ZeRO-3: its fp32 shards, their grads and AdamW state. window: transient "
        "full params (ZeroAdamW stage 3: memory_report() window_bound / window_peak; FSDP2: unsharded params + "
        "all-gather buffers sampled at every module hook of the measured step; naive: exact).",
    ]
    text = "\n".join([body, "", *[f"- {v}" for v in verdicts], *[f"- {n}" for n in notes]])
    print(text)
    name = args.name or f"engine_step_{device}"
    payload = {"world_size": world, "config": {k: v for k, v in vars(args).items() if k != "out_dir"}, **result}
    payload.update(ok)
    written = harness.write_results(name, meta, payload, text, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
