"""How much does a process's resident memory grow with offload="nvme", past the fp32 grad shard and the window?

    python bench/investigations/nvme_rss_growth.py
    python bench/investigations/nvme_rss_growth.py --trees /path/to/earlier/checkout,.   # before / after

Issue 23's case: one 64M-element bf16 parameter (an ``nn.Embedding(65536, 1024)``), one rank, stage 2,
``offload="nvme"``, two steps. Each run is a fresh process (resident memory is per process): the growth is its
VmHWM (the most it has had resident) less the VmHWM of the same forward and backward without the optimizer, less
the grad shard and the window; "kept by construction" is VmRSS after building the optimizer less before it, less the
grad shard. Runs alternate between the trees (each checkout's ``zero_ext`` on ``PYTHONPATH``, its commit recorded)
and between bucket sizes, in one session. Results: results/nvme_rss_growth.{json,md} (``--name`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness

import harness  # noqa: E402
import torch  # noqa: E402

MIB = 2**20

CHILD = textwrap.dedent("""
    import json, sys, torch
    from zero_ext import ZeroAdamW

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    directory, bucket_size = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    table = torch.nn.Embedding(65536, 1024, dtype=torch.bfloat16)

    def train_step(opt=None):
        idx = torch.randint(0, 65536, (16,))
        table(idx).float().pow(2).mean().backward()
        if opt is not None:
            opt.step()
        table.zero_grad(set_to_none=True)

    train_step()
    bare, before = status("VmHWM"), status("VmRSS")
    opt = ZeroAdamW(table.parameters(), stage=2, offload="nvme", offload_dir=directory, bucket_size=bucket_size)
    built = status("VmRSS") - before
    for _ in range(2):
        train_step(opt)
    report = opt.memory_report()
    print(json.dumps(dict(
        grown=status("VmHWM") - bare, built=built, grad_shard=report.allocated["grad_shard"],
        window=report.buffers["window"].bound, buffers={k: b.nbytes for k, b in report.buffers.items()},
    )))
    opt.close()
""")


def commit_of(tree: str) -> str:
    rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return rev.stdout.strip() or "unknown"


def measure(tree: str, bucket_size: int) -> dict:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": tree}
    with tempfile.TemporaryDirectory(dir=tree) as directory:  # on the tree's disk, not /tmp
        # cwd=tree: ``python -c`` puts the working directory ahead of PYTHONPATH
        out = subprocess.run([sys.executable, "-c", CHILD, directory, str(bucket_size)], env=env, cwd=tree,
                             capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    bounded = sum(n for k, n in r["buffers"].items() if k != "window")
    return dict(
        tree=os.path.relpath(tree), commit=commit_of(tree), bucket_size=bucket_size,
        past=(r["grown"] - r["grad_shard"] - r["window"]) / MIB, bounded=bounded / MIB,
        built_past=(r["built"] - r["grad_shard"]) / MIB, raw=r,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", default=".", help="comma-separated checkouts to measure (alternating)")
    p.add_argument("--buckets", default="262144,524288,1048576,4194304", help="bucket sizes in elements")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--name", default="nvme_rss_growth")
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    args = p.parse_args()
    meta = harness.meta(torch.device("cpu"))
    trees = args.trees.split(",")
    rows = []
    for bucket_size in [int(b) for b in args.buckets.split(",")]:
        for _ in range(args.reps):
            for tree in trees:
                rows.append(measure(tree, bucket_size))
                print({k: v for k, v in rows[-1].items() if k != "raw"}, flush=True)
    table = harness.markdown_table(
        ["tree (commit)", "bucket_size", "RSS growth past grad shard + window MiB", "of it bounded buffers MiB",
         "kept by construction past the grad shard MiB"],
        [[f"{r['tree']} ({r['commit']})", r["bucket_size"], f"{r['past']:.1f}", f"{r['bounded']:.1f}",
          f"{r['built_past']:.1f}"] for r in rows],
    )  # fmt: skip
    body = (
        "One 64M-element bf16 parameter, one rank, stage 2, offload='nvme', two steps, each run a fresh process. "
        "Growth: VmHWM with the optimizer less VmHWM of the bare forward and backward, less the fp32 grad shard "
        "(256 MiB) and the window bound (128 MiB). Bounded buffers: memory_report().buffers besides the window "
        f"(landing ring, staging pool). Issue 23's must: growth within 32 MiB.\n\n{table}\n"
    )
    harness.write_results(args.name, meta, {"rows": rows}, body, args.out_dir)
    print(body)


if __name__ == "__main__":
    main()
