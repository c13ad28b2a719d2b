"""Model-state bytes per GPU at N = 8 x 8 (8 nodes of 8 GPUs): ZeroAdamW on an HSDP mesh, with its optimizer state
sharded over all 64 ranks (the default) or replicated across the 8 nodes (``replicate_state=True``), against the 1-D
layout over 64, FSDP2's HSDP, DeepSpeed ZeRO-3, MiCS and ZeRO++'s hpZ, for 7B, 30B and 70B parameters. Mixed-precision
AdamW: bf16 params and gradients, an fp32 master and two fp32 moments (ZeRO's 2 + 2 + 12 bytes per parameter).
Formulas, not measurements (``zero_ext.memory.estimate`` for ZeroAdamW, each peer's from its code or documentation,
cited in the result file); activations and transient gather buffers are not counted.

    python bench/bench_hsdp_memory.py [--nodes 8 --gpus-per-node 8 --sizes 7,30,70] [--out-dir bench/results]

Check: ZeroAdamW's default (state sharded over R x S) is below FSDP2's HSDP per GPU at every stage-3 row.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from harness import RESULTS, markdown_table, meta, write_results  # noqa: E402

from zero_ext import memory  # noqa: E402

GIB = 2**30

SOURCES = """Sources of the formulas (Psi parameters, R replicas (nodes) x S ranks per shard group (GPUs per node), N = R x S;
bytes per parameter, ZeRO's accounting of mixed-precision Adam: 2 bf16 param + 2 bf16 grad + 12 fp32 master and moments):

- **ZeroAdamW** (`zero_ext.memory.estimate(psi, N, stage, mesh=(R, S), replicate_state=...)`; the engine's layout in
  `zero_ext/comm/hsdp.py`): stage 3 on the mesh keeps each rank's bf16 chunk of the parameters, 1/S of them (the
  shard group's gathers start from it: they never leave the node), 2 / S; the reduced gradients and the 12-byte state
  are sharded over D: D = R x S by default (the shard group's reduce-scatter, then the replicas' of the 1/S chunk;
  each rank updates 1/(R x S) and the replicas all-gather it), D = S with `replicate_state=True` (where the bf16
  shard is not kept: each gather rounds the fp32 master): 2 / S + (2 + 12) / D. "As kept" is `engine=True`, what
  `memory_report()` counts before padding: ZeroAdamW reduces into an fp32 gradient shard (4 / D instead of 2 / D).
- **FSDP2 HSDP** (`fully_shard(model, mesh=init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard")),
  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`): every parameter is a
  DTensor placed `(Replicate(), Shard(0))` on the 2-D mesh (torch `distributed/fsdp/_fully_shard/_fsdp_param.py`,
  `_init_sharded_param` / `_spmd_placements`), so the fp32 sharded parameter (the master, 4), its fp32 sharded
  gradient (4) and AdamW's two moments (8), which follow the parameter's placement, are sharded over S and
  replicated R times; gradients are reduce-scattered over the shard group, then all-reduced over the replicate
  group (`_fsdp_collectives.py`, `foreach_reduce`): 16 / S.
- **DeepSpeed ZeRO-3** over all N ranks (ZeRO paper, Rajbhandari et al. 2019, Table 1's stage 3; DeepSpeed's
  `zero_optimization.stage: 3`): (2 + 2 + 12) / N.
- **MiCS** (Zhang et al., VLDB 2022; DeepSpeed `zero_optimization.mics_shard_size: S`): every model state sharded
  inside a partition group of S ranks and replicated across the R groups: (2 + 2 + 12) / S.
- **ZeRO++ hpZ** (Wang et al. 2023; DeepSpeed `zero_hpz_partition_size: S`, deepspeed.ai/tutorials/zeropp): ZeRO-3
  over N plus a secondary bf16 copy of the parameters sharded within the node for backward's gathers:
  (2 + 2 + 12) / N + 2 / S.
"""


def rows_for(psi: int, r: int, s: int) -> list[tuple[str, str, float]]:
    """(layout, how the state is spread, bytes per GPU) for each contender at ``psi`` parameters."""
    n = r * s
    est = memory.estimate
    return [
        ("ZeroAdamW stage 3, mesh (default)", f"state over {n}", est(psi, n, 3, mesh=(r, s))),
        ("ZeroAdamW stage 3, mesh (default), as kept", f"state over {n}", est(psi, n, 3, mesh=(r, s), engine=True)),
        ("ZeroAdamW stage 2, mesh (default)", f"state over {n}", est(psi, n, 2, mesh=(r, s))),
        ("ZeroAdamW stage 1, mesh (default)", f"state over {n}", est(psi, n, 1, mesh=(r, s))),
        (
            "ZeroAdamW stage 3, mesh, replicate_state=True",
            f"state over {s}, x{r}",
            est(psi, n, 3, mesh=(r, s), replicate_state=True),
        ),  # fmt: skip
        ("ZeroAdamW stage 3, 1-D over N", f"state over {n}", est(psi, n, 3)),
        ("FSDP2 HSDP (fully_shard, 2-D mesh)", f"all over {s}, x{r}", 16 * psi / s),
        ("DeepSpeed ZeRO-3 (all N)", f"all over {n}", 16 * psi / n),
        (f"DeepSpeed MiCS (mics_shard_size={s})", f"all over {s}, x{r}", 16 * psi / s),
        (
            f"DeepSpeed ZeRO++ hpZ (zero_hpz_partition_size={s})",
            f"all over {n} + bf16 over {s}",
            16 * psi / n + 2 * psi / s,
        ),  # fmt: skip
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--sizes", default="7,30,70", help="billions of parameters")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--name", default=None, help="result file stem (default hsdp_memory_<R>x<S>)")
    args = ap.parse_args(argv)
    r, s = args.nodes, args.gpus_per_node
    name = args.name or f"hsdp_memory_{r}x{s}"
    info = meta(torch.device("cpu"))
    info["device"] = "formulas (no device)"
    sizes = [float(x) for x in args.sizes.split(",")]
    psis = [int(b * 1e9) for b in sizes]
    table: dict[str, dict] = {}
    for psi in psis:
        for label, spread, nbytes in rows_for(psi, r, s):
            entry = table.setdefault(label, {"spread": spread, "bytes_per_param": nbytes / psi, "gib": {}})
            entry["gib"][f"{psi / 1e9:g}B"] = nbytes / GIB
    fsdp2 = table["FSDP2 HSDP (fully_shard, 2-D mesh)"]["bytes_per_param"]
    ours = table["ZeroAdamW stage 3, mesh (default)"]["bytes_per_param"]
    kept = table["ZeroAdamW stage 3, mesh (default), as kept"]["bytes_per_param"]
    ok = ours < fsdp2 and kept < fsdp2
    head = ["layout", "model states spread over", "B/param", *(f"{b:g}B (GiB/GPU)" for b in sizes)]
    rows = [[label, e["spread"], f"{e['bytes_per_param']:.4g}", *(f"{g:.2f}" for g in e["gib"].values())]
            for label, e in table.items()]  # fmt: skip
    body = (
        f"Model-state bytes per GPU at N = {r} x {s} = {r * s} GPUs ({r} nodes of {s}; mesh (R, S) = ({r}, {s})), "
        "bf16 params + fp32 master + AdamW, GiB = 2^30 bytes.\n\n"
        + markdown_table(head, rows)
        + f"\n\nZeroAdamW's default (state sharded over {r * s}) below FSDP2 HSDP per GPU: "
        f"{ours:.4g} B/param ({kept:.4g} as kept) vs {fsdp2:.4g}: {'PASS' if ok else 'FAIL'}\n\n" + SOURCES
    )
    payload = {"nodes": r, "gpus_per_node": s, "sizes": psis, "layouts": table, "default_below_fsdp2_hsdp": ok}
    write_results(name, info, payload, body, args.out_dir)
    print(markdown_table(head, rows))
    print(f"wrote {args.out_dir}/{name}.json, .md; default below FSDP2 HSDP: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
