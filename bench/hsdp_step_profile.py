"""Where one step's time goes on each rank: ZeroAdamW on the 1-D layout against the 2 x 2 mesh (and the mesh with
int8 inter-node sums), 4 gloo ranks on this machine (no shaped link: what the engine itself costs per level), the
cluster bench's model (4 bf16 linear layers, stage 2 or 3). Per rank and contender: the step's wall time, the
torch.profiler ranges of the engine's collectives (``zero_ext::reduce_scatter`` etc.: launch calls), the time spent
blocked in gloo waits, and the ops that took the most host time.

    python bench/hsdp_step_profile.py --stage 2 --out-dir bench/results     # writes hsdp_step_profile_stage2.*
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import OUT  # noqa: E402

LAYERS = 4
KINDS = ("reduce_scatter", "all_gather", "all_reduce")
CONTENDERS = {"zero_1d": {}, "zero_mesh": {"mesh": True}, "zero_mesh_inter_int8": {"mesh": True, "int8": True}}


def profile_rank(rank: int, world: int, device, stage: int, params_m: float, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from zero_ext import ZeroAdamW

    torch.set_num_threads(1)
    dim = int((params_m * 1e6 / LAYERS) ** 0.5)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(rank)).bfloat16()
    out = {}
    for name, kw in CONTENDERS.items():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(LAYERS)])
        extra = {"mesh": mesh} if kw.get("mesh") else {}
        if kw.get("int8"):
            extra["inter_node_reduce_dtype"] = torch.int8
        opt = ZeroAdamW(m.parameters(), module=m, stage=stage, bucket_size=2**19, **extra)

        def step():
            m(x).float().pow(2).mean().backward()
            opt.step()
            opt.finish_sync()
            opt.zero_grad()

        for _ in range(2):  # warm-up
            step()
        walls = []
        for i in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            if i == steps - 1:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
            else:
                step()
            walls.append(time.perf_counter() - t0)
        rows = []
        for e in prof.key_averages():
            rows.append({"name": e.key, "count": e.count, "cpu_total_ms": e.cpu_time_total / 1e3,
                         "self_cpu_ms": e.self_cpu_time_total / 1e3})  # fmt: skip
        out[name] = {"walls_s": walls, "ops": rows, "buckets": sum(1 for _ in opt.sharded_state.buckets())}
        opt.close()
    return out


def summarize(per_rank: dict) -> str:
    lines = []
    for name in CONTENDERS:
        lines += [f"### {name}", ""]
        head = ["rank", "step s (median of the timed)", "buckets", "collective launches (count, ms)",
                "step() self ms (host blocked in waits)", "top host ops by self time (ms, count)"]  # fmt: skip
        rows = []
        for rank, res in sorted(per_rank.items()):
            r = res[name]
            ops = {o["name"]: o for o in r["ops"]}
            launches = [o for k, o in ops.items() if k.removeprefix("zero_ext::") in KINDS]
            blocked = sum(o["self_cpu_ms"] for k, o in ops.items() if k.startswith("Optimizer.step"))
            top = sorted(r["ops"], key=lambda o: -o["self_cpu_ms"])[:5]
            walls = sorted(r["walls_s"])
            rows.append([rank, f"{walls[len(walls) // 2]:.4f}", r["buckets"],
                         ", ".join(f"{o['name'].removeprefix('zero_ext::')} {o['count']} x, {o['cpu_total_ms']:.1f}"
                                   for o in launches),
                         f"{blocked:.1f}",
                         "; ".join(f"{o['name']} {o['self_cpu_ms']:.1f} ({o['count']})" for o in top)])  # fmt: skip
        lines += [harness.markdown_table(head, rows), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=[2, 3])
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    meta_ = harness.meta(torch.device("cpu"))
    out = {}

    def collect(rank, world, device, *a):
        res = profile_rank(rank, world, device, *a)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        return gathered

    gathered = harness.launch(collect, 4, "cpu", args.stage, args.params_m, args.steps)
    out = dict(enumerate(gathered))
    body = (
        f"One step per rank, stage {args.stage}, {args.params_m:g}M bf16 parameters in {LAYERS} linear layers, 4 gloo "
        "ranks on one machine (no shaped link), as 2 x 2 where meshed; the last of "
        f"{args.steps} timed steps profiled (torch.profiler, CPU). Collective launches: the engine's "
        "`zero_ext::{kind}` ranges (host time to issue them; gloo's transfers run in its own threads, and the "
        "mesh's second level starts inside the wait of the first); step() self time: the host inside "
        "`Optimizer.step` but in no op, i.e. blocked in gloo waits (the profiler records no op for them).\n\n"
        + summarize(out)
    )
    print(body)
    name = args.name or f"hsdp_step_profile_stage{args.stage}"
    for path in harness.write_results(name, meta_, {"ranks": out}, body, args.out_dir):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
