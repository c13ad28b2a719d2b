"""fused_adamw_'s default CPU path (bf16 grad -> fp32 master/m/v -> bf16 param_out) before and after a kernel
change, side by side, and what the precision modes of issue 24 cost on the after tree.

    python bench/investigations/fused_adamw_before_after.py --before /work/main --pairs 5

Each pair launches one child per tree (its own ``zero_ext`` on PYTHONPATH), before then after, alternately. A child
times, interleaved round-robin in one process, zero_ext's default step and torch.optim.AdamW(fused=True) on the same
size: zero_ext's time divided by torch's in the same child is the figure compared, so a load swing between children
(other processes share the cores) cancels. Each pair also launches a third child on the after tree that times the modes
it has (param_remainders, bf16 moments, both) against its own default step, so they do not change the comparison's
children. Writes bench/results/fused_adamw_before_after.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def child(numel: int, reps: int, modes: bool) -> dict:
    import harness
    import torch

    from zero_ext import ops

    gen = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=gen)
    grad = (torch.randn(numel, generator=gen) * 1e-2).to(torch.bfloat16)
    step = [0]

    def make(moment_dtype=torch.float32, remainders=False):
        m, v = torch.zeros(numel, dtype=moment_dtype), torch.zeros(numel, dtype=moment_dtype)
        if remainders:
            from zero_ext.update import master_split

            param, remainder, _ = master_split.split(init)
            first, kw = param, dict(remainder=remainder)
        else:
            first, kw = init.clone(), dict(param_out=torch.empty(numel, dtype=torch.bfloat16))
        if moment_dtype != torch.float32:
            kw.update(rounding_seed=1, element_offset=0)

        def run():
            step[0] += 1
            ops.fused_adamw_(first, grad, m, v, step=step[0], **kw, **HYPER)

        return run

    p = init.clone().requires_grad_()
    p.grad = grad.float()
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    contenders = {"zero_ext": make(), "torch_fused": opt.step}
    if modes:
        contenders.update(
            remainders=make(remainders=True),
            bf16_moments=make(torch.bfloat16),
            bf16_moments_remainders=make(torch.bfloat16, remainders=True),
        )
    timed = {name: (lambda fn=fn: harness.timed(fn)) for name, fn in contenders.items()}
    times = harness.round_robin(timed, 3, reps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return dict(medians_s=medians, isa=ops.cpu_isa(), threads=torch.get_num_threads())


def run_tree(tree: Path, numel: int, reps: int, modes: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--numel", str(numel), "--reps", str(reps)]
    out = subprocess.run(cmd + (["--modes"] if modes else []), env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="a checkout with its extension built (the baseline); required")
    p.add_argument("--after", default=str(HERE.parent.parent), help="default: this checkout")
    p.add_argument("--numel", type=int, default=2**24)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.numel, args.reps, args.modes)))
        return 0
    if not args.before:
        p.error("--before is required")

    import harness
    import torch

    before, after = Path(args.before).resolve(), Path(args.after).resolve()
    meta = harness.meta(torch.device("cpu"))
    commits = {}
    for tag, tree in (("before", before), ("after", after)):
        commits[tag] = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()  # fmt: skip
    runs = []
    for k in range(args.pairs):
        for tag, tree in (("before", before), ("after", after), ("after_modes", after)):
            r = run_tree(tree, args.numel, args.reps, modes=tag == "after_modes")
            r.update(tree=tag, pair=k)
            runs.append(r)
            med = r["medians_s"]
            print(f"pair {k} {tag}: zero_ext {med['zero_ext'] * 1e3:.2f} ms, torch fused "
                  f"{med['torch_fused'] * 1e3:.2f} ms, ratio {med['zero_ext'] / med['torch_fused']:.3f}", flush=True)  # fmt: skip

    def ratios(tag, name="zero_ext", over="torch_fused"):
        return [r["medians_s"][name] / r["medians_s"][over] for r in runs if r["tree"] == tag]

    rb, ra = ratios("before"), ratios("after")
    summary = dict(
        before_median=statistics.median(rb),
        after_median=statistics.median(ra),
        after_over_before=statistics.median(ra) / statistics.median(rb),
        before_range=[min(rb), max(rb)],
        after_range=[min(ra), max(ra)],
    )
    modes = {name: statistics.median(ratios("after_modes", name, "zero_ext"))
             for name in ("remainders", "bf16_moments", "bf16_moments_remainders")}  # fmt: skip
    lines = [
        f"- command: `{meta['command']}`; {args.pairs} pairs, {args.reps} reps each (+3 warm-up), "
        f"{args.numel} elements, ISA {runs[-1]['isa']}, {runs[-1]['threads']} threads",
        f"- before {commits['before']} ({before}), after {commits['after']} ({after})",
        "",
        "zero_ext default step (bf16 grad, fp32 master/m/v, bf16 param_out) / torch AdamW(fused=True), same child:",
        "",
        harness.markdown_table(
            ["tree", "median ratio", "min-max", "per run"],
            [
                [t, f"{statistics.median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}", " ".join(f"{x:.3f}" for x in v)]
                for t, v in (("before", rb), ("after", ra))
            ],
        ),  # fmt: skip
        "",
        f"after / before: **{summary['after_over_before']:.3f}**",
        "",
        "After tree, each mode's time / the default step's time in the same child (median over the modes children;"
        " param_out is written by the default step and the bf16-moment step, the remainder modes write the parameter"
        " in place):",
        "",
        harness.markdown_table(["mode", "time vs default"], [[k, f"{v:.3f}"] for k, v in modes.items()]),
    ]
    payload = dict(runs=runs, summary=summary, modes_vs_default=modes, commits=commits, numel=args.numel)
    written = harness.write_results("fused_adamw_before_after", meta, payload, "\n".join(lines))
    print("\n".join(lines))
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
