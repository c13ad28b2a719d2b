"""Bytes per rank per step that cross nodes, by layout: the 1-D layout over two (or three) emulated nodes against
2-D meshes with the state sharded over every rank (default) or replicated over the nodes (FSDP2 HSDP), at stages 1,
2 and 3, on gloo ranks of this machine. The bytes are the engine's own counts (``opt.comm_stats()``: ring wire
bytes, (g-1)/g of each collective's buffer, by the group it runs on; a group spanning nodes counts as inter-node;
LOCAL_WORLD_SIZE says the ranks per node, as torchrun does), taken over one step after two warm-up steps (stage 3
learns its gather order in the first).

    python bench/hsdp_traffic.py [--out-dir bench/results]

Writes ``hsdp_traffic.{json,md}``. The model is the main job's GPT (3.3M parameters); the counts do not depend on
the machine."""

from __future__ import annotations

import argparse
import os

import torch
from gpt_model import GPT, GPTConfig, num_params
from harness import RESULTS, launch, markdown_table, meta, write_results

import zero_ext

LAYOUTS = [  # (world, ranks per node, mesh shape or None: the 1-D layout, replicate_state)
    (4, 2, None, False), (4, 2, (2, 2), False), (4, 2, (2, 2), True),
    (6, 3, None, False), (6, 3, (2, 3), False), (6, 3, (2, 3), True),
    (6, 2, None, False), (6, 2, (3, 2), False), (6, 2, (3, 2), True),
]  # fmt: skip


def _one_step(rank, world, device, shape, replicate_state, stage, per_node):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    mesh = None if shape is None else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    kw = dict(mesh=mesh, replicate_state=replicate_state) if mesh is not None else {}
    opt = zero_ext.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, module=model, **kw)
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(rank))

    def step():
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    before = opt.comm_stats()
    step()
    after = opt.comm_stats()
    opt.close()
    return {k: after[k] - before[k] for k in after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    psi = num_params(GPT(GPTConfig()))
    rows, records = [], []
    for stage in (1, 2, 3):
        flat = {}
        for world, per_node, shape, replicated in LAYOUTS:
            stats = launch(_one_step, world, "cpu", shape, replicated, stage, per_node)
            if shape is None:
                flat[(world, per_node)] = stats["inter_node_bytes"]
            base = flat[(world, per_node)]
            label = "1-D" if shape is None else f"{shape[0]} x {shape[1]}" + (" replicated" if replicated else "")
            ratio = stats["inter_node_bytes"] / base if base else float("nan")
            rows.append(
                [
                    stage,
                    f"{world} ({world // per_node} x {per_node})",
                    label,
                    stats["inter_node_bytes"],
                    stats["intra_node_bytes"],
                    f"{ratio:.3f}",
                ]
            )
            records.append(dict(stage=stage, world=world, mesh=shape, replicate_state=replicated,
                                inter_node_bytes=stats["inter_node_bytes"], intra_node_bytes=stats["intra_node_bytes"],
                                inter_vs_1d=ratio, stats=stats))  # fmt: skip
            print(rows[-1], flush=True)
    body = (
        f"GPT of {psi / 1e6:.2f}M parameters (fp32 parameters and gradients, reduce_dtype fp32), one step after two "
        "warm-up steps; wire bytes per rank (ring: (g-1)/g of each collective's buffer). `inter / 1-D`: against the "
        "1-D layout over the same nodes (its one group spans them, so all of its bytes cross nodes).\n\n"
        + markdown_table(
            ["stage", "ranks (nodes x per node)", "layout", "inter-node bytes", "intra-node bytes", "inter / 1-D"], rows
        )
    )
    write_results("hsdp_traffic", meta(torch.device("cpu")), {"params": psi, "rows": records}, body, args.out_dir)


if __name__ == "__main__":
    main()
