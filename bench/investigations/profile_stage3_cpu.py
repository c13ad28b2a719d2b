"""Where does ZeroAdamW stage 3's step time go on CPU (gloo)? Stage 3 against stage 2, step by step, then profiled.

    python bench/investigations/profile_stage3_cpu.py                   # 2 gloo ranks, the main job's GPT
    python bench/investigations/profile_stage3_cpu.py --world-size 1    # one rank: no communication, the bookkeeping
    python bench/investigations/profile_stage3_cpu.py --precision fp32  # fp32 params, no autocast (no fast bf16)

Stage 2 and stage 3 (bf16 params + bf16 autocast, or fp32 params with ``--precision fp32``; harness.build, the same weights and batches; stage 3 with and
without resharding after forward) live in one launch:

1. timing, no profiler: --steps steps of each, interleaved step by step (the slowest rank's time); the extra time
   of stage 3 over stage 2 is the cost of sharding the parameters (gathers, hooks, checks);
2. profile: cProfile on rank 0 over --steps more steps of each (the other ranks run the same steps unprofiled),
   attributed per function: engine functions by file, the collectives' waits, and torch's own ops. cProfile's
   overhead inflates Python-heavy code, so the profile says *where* stage 3 spends its extra time (the ranking,
   the per-call counts), and the timing says *how much*.

Results: results/profile_stage3_cpu.{md,json} (``--name`` to change).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness, gpt_model

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt_model import MarkovData, add_model_args, model_config  # noqa: E402
from harness import RunConfig, build, forward_backward  # noqa: E402

CONTENDERS = {"zero2": dict(recipe="zero2"), "zero3": dict(recipe="zero3"),
              "zero3_keep": dict(recipe="zero3", reshard_after_forward=False)}  # fmt: skip
ENGINE = os.sep + "zero_ext" + os.sep
TORCH = os.sep + "site-packages" + os.sep + "torch" + os.sep


def _where(key: tuple) -> str:
    """A profiled function's group: an engine file, torch's Python by package (module hooks, autograd.Function,
    pytree, the torch.compiler.disable wrappers in torch/_dynamo, profiler ranges), the autograd engine, the
    collectives' C++ calls and waits, or the other C++ calls (the compute kernels)."""
    file, _, name = key
    if ENGINE in file:
        return "zero_ext/" + file.rsplit(ENGINE, 1)[1]  # the last one: a checkout may itself be named zero_ext
    if TORCH in file:
        parts = file.split(TORCH, 1)[1].split(os.sep)
        return "torch Python: torch/" + "/".join(parts[:2] if len(parts) > 2 else parts[:1])
    if file == "~" and "c10d" in name:
        return "C++: collectives (launch + wait)"
    if "run_backward" in name:
        return "C++: autograd engine (backward kernels; Python hooks excluded)"
    if file == "~":
        return "C++: forward ops, optimizer kernels, other builtins"
    return "other Python (" + os.path.basename(file) + ")" if "bench" not in file else "bench/ (this script, harness)"


def coarse(group: str) -> str:
    """The summary table's rows: stage 3's own hooks and checks, the rest of the engine, torch's Python, C++ calls."""
    if group in ("zero_ext/engine/param_gather.py", "zero_ext/state/sharded_params.py"):
        return "zero_ext stage-3 hooks and checks (param_gather.py, sharded_params.py)"
    if group.startswith("zero_ext/"):
        return "zero_ext, the rest (reducer, grads, staging, comm, step, ...)"
    if group.startswith("torch Python"):
        return "torch Python (module hook dispatch, autograd.Function, tensor hooks, pytree, compiler.disable, ...)"
    return group if group.startswith("C++") else "other Python (bench, stdlib)"


def profile_steps(step, steps: int) -> dict:
    """cProfile over ``steps`` calls of ``step``; per-step seconds by group and the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    groups: dict[str, float] = defaultdict(float)
    funcs = []
    for key, (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():
        groups[_where(key)] += tottime / steps
        label = f"{os.path.basename(key[0]) or '~'}:{key[1]}({key[2]})"
        funcs.append({"function": label, "calls_per_step": ncalls / steps, "own_ms": 1e3 * tottime / steps,
                      "cum_ms": 1e3 * cumtime / steps})  # fmt: skip
    funcs.sort(key=lambda f: -f["own_ms"])
    return {"total_ms": 1e3 * st.total_tt / steps, "groups_ms": {k: 1e3 * v for k, v in groups.items()},
            "functions": funcs[:200]}  # fmt: skip


def run(rank: int, world: int, device: torch.device, cfg: RunConfig, steps: int, warmup: int) -> dict:
    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [tuple(t.to(device) for t in data.batch(s, cfg.global_batch, rank, world)) for s in range(4)]
    built = {}
    for name, kw in CONTENDERS.items():
        rc = RunConfig(**{**cfg.__dict__, **kw})
        built[name] = (rc, *build(rc, c, device))
    count = defaultdict(int)

    def step(name):
        rc, model, net, opt = built[name]
        x, y = batches[count[name] % len(batches)]
        count[name] += 1
        forward_backward(rc, model, net, x, y, device)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        for name in built:
            step(name)
    times = {name: [] for name in built}
    for _ in range(steps):  # interleaved step by step, no profiler
        for name in built:
            dist.barrier()
            times[name].append(harness.timed(lambda: step(name)))
    out = {"times_s": {}, "profile": {}, "comm": {}}
    for name in built:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["times_s"][name] = t.tolist()
        dist.barrier()
        if rank == 0:
            out["profile"][name] = profile_steps(lambda: step(name), steps)
        else:
            for _ in range(steps):
                step(name)
        out["comm"][name] = built[name][3].comm_stats()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps, then as many profiled, per contender")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: bf16 params + bf16 autocast; fp32: fp32 params, no autocast (a CPU without a fast "
                        "bf16 matmul spends seconds per bf16 step, which hides stage 3's own costs)")  # fmt: skip
    add_model_args(p)
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default="profile_stage3_cpu")
    args = p.parse_args(argv)
    fp32 = dict(param_dtype="float32", autocast=False) if args.precision == "fp32" else {}
    cfg = RunConfig(model=model_config(args), global_batch=args.batch_per_rank * args.world_size, **fp32)
    meta = harness.meta(torch.device("cpu"))
    res = harness.launch(run, args.world_size, "cpu", cfg, args.steps, args.warmup)

    stats = {n: harness.summary(t) for n, t in res["times_s"].items()}
    base = stats["zero2"]["median_s"]
    rows = [[n, f"{s['median_s'] * 1e3:.1f}", f"{s['q1_s'] * 1e3:.1f}-{s['q3_s'] * 1e3:.1f}",
             f"{(s['median_s'] - base) * 1e3:+.1f}", f"{s['median_s'] / base:.3f}x"] for n, s in stats.items()]  # fmt: skip
    coarse_ms = {n: defaultdict(float) for n in CONTENDERS}
    for n, prof in res["profile"].items():
        for g, ms in prof["groups_ms"].items():
            coarse_ms[n][coarse(g)] += ms
    order = sorted(coarse_ms["zero3"], key=lambda g: -(coarse_ms["zero3"][g] - coarse_ms["zero2"].get(g, 0.0)))
    prof_rows = [[g, *(f"{coarse_ms[n].get(g, 0.0):.1f}" for n in CONTENDERS),
                  f"{coarse_ms['zero3'][g] - coarse_ms['zero2'].get(g, 0.0):+.1f}"] for g in order]  # fmt: skip
    prof_rows.append(["total (profiled)", *(f"{res['profile'][n]['total_ms']:.1f}" for n in CONTENDERS),
                      f"{res['profile']['zero3']['total_ms'] - res['profile']['zero2']['total_ms']:+.1f}"])  # fmt: skip
    # where the extra goes, function by function: stage 3's own time per step minus stage 2's
    z2 = {f["function"]: f for f in res["profile"]["zero2"]["functions"]}
    extra = sorted(res["profile"]["zero3"]["functions"],
                   key=lambda f: -(f["own_ms"] - z2.get(f["function"], {}).get("own_ms", 0.0)))  # fmt: skip
    top = [[f["function"], f"{z2.get(f['function'], {}).get('calls_per_step', 0):.0f} -> {f['calls_per_step']:.0f}",
            f"{f['own_ms'] - z2.get(f['function'], {}).get('own_ms', 0.0):+.2f}", f"{f['own_ms']:.2f}",
            f"{f['cum_ms']:.2f}"] for f in extra[:15]]  # fmt: skip
    body = "\n".join([
        f"- world size {args.world_size} (gloo), Psi from the GPT of d_model {args.d_model}, {args.layers} layers, "
        f"vocab {args.vocab}; {args.precision} params{' + bf16 autocast' if args.precision == 'bf16' else ''}; "
        f"{args.batch_per_rank} x {args.seq_len} tokens per rank; engine default buckets; "
        f"{args.warmup} warm-up steps, {args.steps} timed steps interleaved, then {args.steps} profiled steps each",
        "", "## Step time, no profiler (slowest rank, interleaved)", "",
        harness.markdown_table(["contender", "median ms", "IQR ms", "vs zero2 ms", "vs zero2"], rows),
        "", "## cProfile on rank 0: own time per step by where it is spent (ms)", "",
        harness.markdown_table(["where", *CONTENDERS, "zero3 - zero2"], prof_rows),
        "", "## zero3: the functions whose own time per step grew most over zero2's (cProfile, rank 0)", "",
        harness.markdown_table(["function", "calls/step zero2 -> zero3", "own ms/step vs zero2", "own ms/step",
                                "cumulative ms/step"], top),
    ])  # fmt: skip
    print(body)
    written = harness.write_results(args.name, meta, {"config": vars(args), **res, "stats": stats}, body,
                                    args.out_dir)  # fmt: skip
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
