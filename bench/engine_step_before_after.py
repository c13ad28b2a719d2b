"""Engine step time before and after an engine change, side by side on one machine.

    git worktree add ../before <commit> && (cd ../before && python setup.py build_ext --inplace)
    python bench/engine_step_before_after.py --before ../before --pairs 3
    python bench/engine_step_before_after.py --before ../before --contenders ddp_fp32,zero3_fp32 --worlds 2

Runs each tree's own ``bench/bench_engine_step.py`` (its engine on ``PYTHONPATH``) alternately, before then
after, ``--pairs`` times at each world size, with stages 1 and 2 on fp32 parameters and DDP + fused AdamW on
fp32 parameters (apples to apples: the engine's own cost, not autocast's; on a CPU without AVX-512 torch's bf16
matmul is ~11x slower than fp32 and would drown the engine in GEMM time). Each run's
ratio to DDP is taken within that run (DDP runs interleaved with the contenders in the same launch), so load
swings between runs cancel; the pairs interleave the two trees so a slow minute hits both. Writes
``engine_step_before_after.{json,md}`` with every run's ratios, the two commits and, per contender and world
size, the median ratio of each tree and their difference. A difference beyond the spread of the pairs is a
regression (issue 9's rule: speed unchanged or better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import torch

CONTENDERS = "ddp_fp32,zero1_fp32,zero2_fp32"  # --contenders: any of bench_engine_step's fp32 ones, with ddp_fp32


def tree_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + ("-dirty" if dirty else "")


def run_tree(tree: Path, world: int, rounds: int, contenders: str, out_dir: Path, tag: str) -> dict:
    """One launch of ``tree``'s engine-step benchmark; returns its result JSON."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "bench" / "bench_engine_step.py"), "--world-size", str(world),
           "--rounds", str(rounds), "--contenders", contenders, "--out-dir", str(out_dir), "--name", tag]  # fmt: skip
    # The benchmark exits 1 when a contender misses its target; the run is still a measurement.
    subprocess.run(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    path = out_dir / f"{tag}.json"
    if not path.exists():
        raise RuntimeError(f"{' '.join(cmd)} wrote no {path.name}")
    return json.loads(path.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, type=Path, help="a built checkout of the earlier commit")
    p.add_argument("--after", type=Path, default=harness.REPO, help="default: this checkout")
    p.add_argument("--pairs", type=int, default=3, help="before/after launches per world size")
    p.add_argument("--rounds", type=int, default=10, help="--rounds of each launch")
    p.add_argument("--worlds", default="2,1")
    p.add_argument("--contenders", default=CONTENDERS, help="bench_engine_step contenders; ddp_fp32 is the baseline")
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default="engine_step_before_after", help="result file stem")
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    names = [n for n in args.contenders.split(",") if n != "ddp_fp32"]
    if not names:
        p.error("--contenders needs one contender besides the ddp_fp32 baseline")
    baseline = dict.fromkeys(names, "ddp_fp32")
    contenders = ",".join(["ddp_fp32", *names])
    worlds = [int(w) for w in args.worlds.split(",")]
    meta = harness.meta(torch.device("cpu"))  # the load the runs began with
    runs: dict[str, dict[str, list]] = {str(w): {"before": [], "after": []} for w in worlds}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for i in range(args.pairs):
                for which, tree in trees.items():
                    res = run_tree(tree, world, args.rounds, contenders, Path(tmp), f"{which}_{world}_{i}")
                    # Both trees' result files carry each contender's median step (the ratio's key differs).
                    medians = {n: r["stats"]["median_s"] for n, r in res["runs"].items()}
                    ratios = {n: medians[n] / medians[base] for n, base in baseline.items()}
                    runs[str(world)][which].append({"ratio_vs_ddp": ratios, "median_s": medians})
                    print(f"N={world} pair {i} {which}: " + ", ".join(f"{n} {ratios[n]:.3f}" for n in baseline))

    summary, rows = {}, []
    for world in worlds:
        for name, base in baseline.items():
            got = {w: [r["ratio_vs_ddp"][name] for r in runs[str(world)][w]] for w in trees}
            before, after = statistics.median(got["before"]), statistics.median(got["after"])
            spread = max(max(v) - min(v) for v in got.values())
            summary[f"{name}@{world}"] = {"before": before, "after": after, "change": after / before - 1,
                                          "spread": spread, "runs": got}  # fmt: skip
            rows.append([world, name, base, f"{before:.3f}", f"{after:.3f}", f"{100 * (after / before - 1):+.1f} %",
                         " ".join(f"{x:.3f}" for x in got["before"]), " ".join(f"{x:.3f}" for x in got["after"])])  # fmt: skip
    commits = {w: tree_commit(t) for w, t in trees.items()}
    body = (
        f"Before: `{commits['before']}`, after: `{commits['after']}`; {args.pairs} launches of each tree's "
        f"`bench_engine_step.py --rounds {args.rounds}` per world size, alternating before/after. Ratio = the "
        "contender's median step over its DDP baseline's in the same launch; the table gives the median over the "
        "launches and every launch's ratio.\n\n"
        + harness.markdown_table(
            ["N", "contender", "baseline", "before", "after", "change", "before (each launch)", "after (each launch)"],
            rows,
        )
    )
    harness.write_results(args.name, meta, {"commits": commits, "summary": summary, "runs": runs}, body, args.out_dir)
    print(body)


if __name__ == "__main__":
    main()
