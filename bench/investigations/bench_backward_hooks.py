"""Host time the gradient hooks add to backward, per parameter: DDP against ZeroAdamW stages 1, 2 and 3.

    python bench/investigations/bench_backward_hooks.py                     # this checkout, 1 and 2 ranks, bf16, fp32
    python bench/investigations/bench_backward_hooks.py --before ../before  # and an earlier checkout, interleaved

A model of ``--blocks`` x (Linear(d, d) + LayerNorm(d)) = 4 x blocks small parameters (500 by default, ~140k
elements: the compute is small, so what each parameter's gradient costs on its way to the wire shows). Each launch
(``--world`` gloo ranks, one torch thread per rank, one parameter dtype) builds one model per contender from the
same weights and times them round-robin (a barrier before each call), every call one iteration (zero_grad,
forward, backward, step) with the backward timed on its own:

- ``plain``: no hooks, no communication (torch AdamW on the local gradients): what backward costs by itself;
- ``noop_hooks``: ``plain`` with a post-accumulate-grad hook doing nothing on every parameter (what calling
  Python from autograd costs per parameter: the floor of any hook-based engine);
- ``ddp``: DistributedDataParallel + torch AdamW, buckets as large as ZeroAdamW's;
- ``zero1`` / ``zero2`` / ``zero3``: ZeroAdamW at that stage (stage 3 with ``module=model``).

Per contender: the median backward and iteration (host wall time) with quartiles, and the host time added per
parameter, ``(median backward - median backward of plain or ddp) / parameters``, in microseconds. With
``--before`` each (world, dtype) launch runs once on the other checkout's engine (its ``zero_ext`` first on
``PYTHONPATH``, this script and harness unchanged) and once on this one, alternately, ``--pairs`` times, and the
result file puts the two engines' per-parameter costs side by side (each launch's differences are taken within the
launch, so load swings between launches cancel). Writes ``backward_hooks_cpu.{json,md}``.

Only ZeroAdamW's public API is used. Until it moved here (issue 22) this script also timed the engine's own hook
path by calling its private reducer (``--components``); the last file that wrote, results/backward_hooks_cpu.md, was
made by that version (``git show b23e9af:bench/bench_backward_hooks.py``).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: harness

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

CONTENDERS = ("plain", "noop_hooks", "ddp", "zero1", "zero2", "zero3")
BUCKET = 1 << 14  # elements per bucket, both engines (~9 buckets): the per-bucket costs are part of the picture


class Blocks(nn.Module):
    """``blocks`` residual Linear + LayerNorm layers: 4 parameters each, all small."""

    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _build(name: str, args, dtype: torch.dtype):
    import zero_ext

    torch.manual_seed(0)
    model = Blocks(args.blocks, args.width).to(dtype)
    if name in ("plain", "noop_hooks"):
        if name == "noop_hooks":  # the floor of any per-parameter Python hook: autograd calling into Python
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda _: None)
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "ddp":
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET * dtype.itemsize / 2**20)
        return model, net, torch.optim.AdamW(model.parameters(), lr=1e-3)
    stage = int(name[-1])
    extra = dict(module=model) if stage == 3 else {}
    opt = zero_ext.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_size=BUCKET, **extra)
    return model, model, opt


def _iteration(model, net, opt, x, clock) -> float:
    """zero_grad, forward, backward; returns the backward's seconds by ``clock``."""
    opt.zero_grad()
    loss = net(x).float().square().mean()
    start = clock()
    loss.backward()
    return clock() - start


def run_launch(rank: int, world: int, device, args_dict: dict) -> dict:
    """One launch's measurements on this rank (rank 0's are kept)."""
    import time

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    built = {name: _build(name, args, dtype) for name in args.contenders}
    x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(rank)).to(dtype)

    def contender(name):
        model, net, opt = built[name]

        def call():
            t0 = time.perf_counter()
            backward = _iteration(model, net, opt, x, time.perf_counter)
            opt.step()
            return backward, time.perf_counter() - t0

        return call

    out = harness.round_robin({n: contender(n) for n in args.contenders}, args.warmup, args.reps, dist.barrier)
    params = sum(1 for p in built[args.contenders[0]][0].parameters())
    return {
        "params": params,
        "numel": sum(p.numel() for p in built[args.contenders[0]][0].parameters()),
        "backward_s": {n: [b for b, _ in v] for n, v in out.items()},
        "iteration_s": {n: [i for _, i in v] for n, v in out.items()},
    }


def per_param_us(launch: dict, name: str, base: str, key: str = "backward_s", stat=statistics.median) -> float:
    t = launch[key]
    return (stat(t[name]) - stat(t[base])) / launch["params"] * 1e6


# ------------------------------------------------------------------------------------------------ driver
def child(args) -> None:
    """One launch on whatever ``zero_ext`` is first on the path; writes its JSON to ``--child-out``."""
    payload = {k: getattr(args, k) for k in ("blocks", "width", "rows", "warmup", "reps", "dtype", "contenders")}
    result = harness.launch(run_launch, args.world, "cpu", payload)
    Path(args.child_out).write_text(json.dumps(result))
    os._exit(0)


def run_child(tree: Path, world: int, dtype: str, args, tmp: Path, tag: str) -> dict:
    out = tmp / f"{tag}.json"
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-out", str(out), "--world", str(world),
           "--dtype", dtype, "--blocks", str(args.blocks), "--width", str(args.width), "--rows", str(args.rows),
           "--warmup", str(args.warmup), "--reps", str(args.reps)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, timeout=1800)
    return json.loads(out.read_text())


def tree_commit(tree: Path) -> str:
    """The tree's commit: a ``COMMIT`` file (a ``git archive`` export has no .git), else git's answer."""
    if (tree / "COMMIT").exists():
        return (tree / "COMMIT").read_text().strip()
    if tree == harness.REPO:
        return harness.git_commit()
    run = dict(capture_output=True, text=True)
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], **run).stdout.strip()


def summarize(launches: list[dict]) -> dict:
    """Per contender: median backward/iteration (ms) over launches, and µs/param vs plain and ddp (median of the
    launches' own differences, with their range)."""
    rows = {}
    for name in CONTENDERS:
        bwd = [statistics.median(run["backward_s"][name]) * 1e3 for run in launches]
        it = [statistics.median(run["iteration_s"][name]) * 1e3 for run in launches]
        vs_plain = [per_param_us(run, name, "plain") for run in launches]
        vs_ddp = [per_param_us(run, name, "ddp") for run in launches]
        fastest = [per_param_us(run, name, "plain", stat=min) for run in launches]
        iqr = [harness.summary(run["backward_s"][name]) for run in launches]
        rows[name] = {
            "backward_ms": statistics.median(bwd),
            "backward_iqr_ms": [
                statistics.median(s["q1_s"] for s in iqr) * 1e3,
                statistics.median(s["q3_s"] for s in iqr) * 1e3,
            ],  # fmt: skip
            "iteration_ms": statistics.median(it),
            "us_per_param_vs_plain": statistics.median(vs_plain),
            "us_per_param_vs_plain_range": [min(vs_plain), max(vs_plain)],
            "us_per_param_vs_ddp": statistics.median(vs_ddp),
            "us_per_param_vs_ddp_range": [min(vs_ddp), max(vs_ddp)],
            # from each contender's fastest backward of a launch: the least disturbed by other work on the machine
            "us_per_param_vs_plain_fastest": statistics.median(fastest),
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, help="a built checkout of the earlier commit, measured alternately")
    p.add_argument("--pairs", type=int, default=2, help="launches of each tree per (world, dtype)")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--blocks", type=int, default=125, help="4 parameters each")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--rows", type=int, default=8, help="batch rows per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default="backward_hooks_cpu")
    # one launch (the parent runs these)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.contenders = list(CONTENDERS)
    if args.child_out:
        return child(args)

    meta = harness.meta(torch.device("cpu"))
    trees = {"after": harness.REPO}
    if args.before is not None:
        trees = {"before": args.before.resolve(), "after": harness.REPO}
    commits = {tag: tree_commit(tree) for tag, tree in trees.items()}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            for dtype in args.dtypes.split(","):
                runs: dict[str, list] = {tag: [] for tag in trees}
                for pair in range(args.pairs):
                    for tag, tree in trees.items():
                        print(f"world {world} {dtype} {tag} launch {pair + 1}/{args.pairs}", flush=True)
                        runs[tag].append(run_child(tree, world, dtype, args, Path(tmp), f"{tag}{world}{dtype}{pair}"))
                results[f"{world}/{dtype}"] = {
                    "world": world, "dtype": dtype, "params": runs["after"][0]["params"],
                    "numel": runs["after"][0]["numel"],
                    **{tag: {"summary": summarize(r), "launches": r} for tag, r in runs.items()},
                }  # fmt: skip
    payload = {"config": {k: v for k, v in vars(args).items() if k not in ("before",)}, "commits": commits,
               "bucket_size": BUCKET, "results": results}  # fmt: skip
    payload["config"]["before"] = str(args.before) if args.before else None
    harness.write_results(args.name, meta, payload, markdown(payload, trees), args.out_dir)
    print(markdown(payload, trees))


def markdown(payload: dict, trees: dict) -> str:
    c = payload["config"]
    lines = [
        f"Model: {c['blocks']} x (Linear({c['width']}, {c['width']}) + LayerNorm({c['width']})), "
        f"{c['rows']} rows per rank; bucket {payload['bucket_size']} elements (DDP: the same bytes); one torch thread "
        f"per rank; {c['warmup']} warm-up + {c['reps']} timed iterations per launch, contenders round-robin with a "
        f"barrier before each; {c['pairs']} launch(es) per engine, "
        + ("before and after alternately" if "before" in trees else "this checkout only")
        + ".",  # fmt: skip
        "",
        "`µs/param` = (median backward − median backward of the baseline) / parameters, per launch; the tables give "
        "the median over launches and [min, max]; `fastest`: from each contender's fastest backward of a launch "
        "instead of its median (less disturbed by other work on the machine). Backward and iteration are host wall "
        "times (ms), medians. `plain`: no hooks; `noop_hooks`: a do-nothing Python hook per parameter.",
        "",
        "Engines: " + ", ".join(f"{tag} = `{sha}`" for tag, sha in payload["commits"].items()),
    ]
    tags = list(trees)
    lines += ["", "## Summary: host µs added per parameter (median over launches)", ""]
    head = ["ranks", "params", "contender"]
    head += [f"{t}: vs plain" for t in tags] + [f"{t}: vs plain, fastest" for t in tags]
    head += [f"{t}: vs DDP" for t in tags]
    rows = []
    for res in payload["results"].values():
        for name in CONTENDERS[1:]:
            s = {t: res[t]["summary"][name] for t in tags}
            rows.append([res["world"], res["dtype"], name]
                        + [f"{s[t]['us_per_param_vs_plain']:.1f}" for t in tags]
                        + [f"{s[t]['us_per_param_vs_plain_fastest']:.1f}" for t in tags]
                        + [f"{s[t]['us_per_param_vs_ddp']:.1f}" for t in tags])  # fmt: skip
    lines.append(harness.markdown_table(head, rows))
    for res in payload["results"].values():
        lines += ["", f"## {res['world']} rank(s), {res['dtype']} parameters ({res['params']} parameters, "
                  f"{res['numel']} elements)", ""]  # fmt: skip
        head = ["contender"]
        for tag in trees:
            head += [f"{tag}: backward ms [IQR]", f"{tag}: iteration ms", f"{tag}: µs/param vs plain [range]",
                     f"{tag}: µs/param vs DDP [range]"]  # fmt: skip
        rows = []
        for name in CONTENDERS:
            row = [name]
            for tag in trees:
                s = res[tag]["summary"][name]
                lo, hi = s["backward_iqr_ms"]
                rp, rd = s["us_per_param_vs_plain_range"], s["us_per_param_vs_ddp_range"]
                row += [f"{s['backward_ms']:.2f} [{lo:.2f}, {hi:.2f}]", f"{s['iteration_ms']:.2f}",
                        f"{s['us_per_param_vs_plain']:.1f} [{rp[0]:.1f}, {rp[1]:.1f}]",
                        f"{s['us_per_param_vs_ddp']:.1f} [{rd[0]:.1f}, {rd[1]:.1f}]"]  # fmt: skip
            rows.append(row)
        lines.append(harness.markdown_table(head, rows))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
