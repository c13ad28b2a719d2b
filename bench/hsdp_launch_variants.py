"""Whether launching them differently makes a 2 x 2 mesh's collectives as fast as the 1-D layout's on this machine:
the bare collectives of one stage-2 step of the cluster bench's model (4 buckets of bf16 gradients and parameters),
without the engine, launched four ways, interleaved:

- ``sequential``: each collective waited for before the next is issued (the engine's mesh on CPU issues a second
  level when the next bucket's first level is issued, having waited for the previous one's first level);
- ``pipelined``: every bucket's first level issued at once, each second level issued as soon as its first level
  finished (in order): what a thread issuing second levels, or the CUDA streams, would do;
- ``coalesced``: the four buckets' inter-node reduce-scatters as one all-to-all, and their inter-node all-gathers as
  one all-gather (the mesh only: 10 collectives a step instead of 16; 1-D has 8);
- ``pipelined + coalesced``: both.

Each collective is what the engine's gloo communicator issues: a reduce-scatter is one all-to-all of the bucket
then a local sum in fp32 (the mesh's node sums cross nodes in fp32), an all-gather one ``all_gather_into_tensor``.
Four gloo ranks on this machine (no shaped link: the "unshaped" column of bench_hsdp_cluster.py), the mesh's shard
groups {0, 1}, {2, 3} and replicas {0, 2}, {1, 3}. Bytes each rank hands to gloo per step are listed: the mesh's
fp32 node sums make its total larger than 1-D's though fewer of them cross nodes.

    python bench/hsdp_launch_variants.py --out-dir bench/results      # writes hsdp_launch_variants.{md,json}
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

BUCKETS = 4


def variants(rank: int, numel: int) -> dict:
    """The contenders: name -> one step's collectives (returns nothing; every tensor allocated up front)."""
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, replica = shard[rank // 2], replica[rank % 2]
    bf16, fp32 = torch.bfloat16, torch.float32
    grads = [torch.randn(numel).to(bf16) for _ in range(BUCKETS)]
    received = [torch.empty(numel, dtype=bf16) for _ in range(BUCKETS)]
    chunks = [torch.empty(numel // 2, dtype=fp32) for _ in range(BUCKETS)]  # a node's sums, fp32
    chunks_in = [torch.empty(numel // 2, dtype=fp32) for _ in range(BUCKETS)]
    slices = [torch.empty(numel // 4, dtype=fp32) for _ in range(BUCKETS)]
    params = [torch.empty(numel, dtype=bf16) for _ in range(BUCKETS)]
    param_slices = [torch.randn(numel // 4).to(bf16) for _ in range(BUCKETS)]
    param_chunks = [torch.empty(numel // 2, dtype=bf16) for _ in range(BUCKETS)]
    all_send = torch.empty(BUCKETS * numel // 2, dtype=fp32)  # coalesced: per destination, every bucket's part
    all_received = torch.empty_like(all_send)
    all_chunks = torch.empty(BUCKETS * numel // 2, dtype=bf16)

    def sum_into(out, parts, g):
        torch.sum(parts.view(g, -1).to(fp32), 0, out=out)

    def rs_1d(b):
        return dist.all_to_all_single(received[b], grads[b], async_op=True)

    def one_d_sequential():
        for b in range(BUCKETS):
            rs_1d(b).wait()
            sum_into(slices[b][: numel // 4], received[b], 4)
        for b in range(BUCKETS):
            dist.all_gather_into_tensor(params[b], param_slices[b])

    def one_d_pipelined():
        works = [rs_1d(b) for b in range(BUCKETS)]
        for b, w in enumerate(works):
            w.wait()
            sum_into(slices[b], received[b], 4)
        works = [dist.all_gather_into_tensor(params[b], param_slices[b], async_op=True) for b in range(BUCKETS)]
        for w in works:
            w.wait()

    def node_level(b):
        return dist.all_to_all_single(received[b], grads[b], group=shard, async_op=True)

    def node_sum(b):
        sum_into(chunks[b], received[b], 2)

    def across(b):
        return dist.all_to_all_single(chunks_in[b], chunks[b], group=replica, async_op=True)

    def across_coalesced():
        for b in range(BUCKETS):  # destination-major: replica r's parts of every bucket together
            all_send.view(2, BUCKETS, -1)[:, b] = chunks[b].view(2, -1)
        dist.all_to_all_single(all_received, all_send, group=replica)
        for b in range(BUCKETS):
            sum_into(slices[b], all_received.view(2, BUCKETS, -1)[:, b].reshape(-1), 2)

    def gather_across(b):
        return dist.all_gather_into_tensor(param_chunks[b], param_slices[b], group=replica, async_op=True)

    def gather_across_coalesced():
        mine = torch.cat(param_slices)
        dist.all_gather_into_tensor(all_chunks, mine, group=replica)
        for b in range(BUCKETS):
            param_chunks[b].view(2, -1).copy_(all_chunks.view(2, BUCKETS, -1)[:, b])

    def gather_node(b):
        return dist.all_gather_into_tensor(params[b], param_chunks[b], group=shard, async_op=True)

    def gather_sequential():  # the mesh's parameter all-gather, two levels, each waited for before the next
        for b in range(BUCKETS):
            gather_across(b).wait()
            gather_node(b).wait()

    def gather_pipelined():  # every first level at once, each second level as its first finishes
        firsts = [gather_across(b) for b in range(BUCKETS)]
        seconds = []
        for b, w in enumerate(firsts):
            w.wait()
            seconds.append(gather_node(b))
        for w in seconds:
            w.wait()

    def mesh_sequential():
        for b in range(BUCKETS):
            node_level(b).wait()
            node_sum(b)
            across(b).wait()
            sum_into(slices[b], chunks_in[b], 2)
        gather_sequential()

    def mesh_pipelined():
        firsts = [node_level(b) for b in range(BUCKETS)]
        seconds = []
        for b, w in enumerate(firsts):
            w.wait()
            node_sum(b)
            seconds.append(across(b))
        for b, w in enumerate(seconds):
            w.wait()
            sum_into(slices[b], chunks_in[b], 2)
        gather_pipelined()

    def mesh_coalesced():
        for b in range(BUCKETS):
            node_level(b).wait()
            node_sum(b)
        across_coalesced()
        gather_across_coalesced()
        for b in range(BUCKETS):
            gather_node(b).wait()

    def mesh_pipelined_coalesced():
        firsts = [node_level(b) for b in range(BUCKETS)]
        for b, w in enumerate(firsts):
            w.wait()
            node_sum(b)
        across_coalesced()
        gather_across_coalesced()
        for w in [gather_node(b) for b in range(BUCKETS)]:
            w.wait()

    order = torch.tensor([(g % 2) * 2 + g // 2 for g in range(4)])  # process g's slice in the mesh's layout
    permuted = [torch.empty(numel, dtype=bf16) for _ in range(BUCKETS)]

    def flat(b):  # the mesh's reduce-scatter as one all-to-all over the 4 ranks, in the mesh's slice order
        torch.index_select(grads[b].view(4, -1), 0, order, out=permuted[b].view(4, -1))
        return dist.all_to_all_single(received[b], permuted[b], async_op=True)

    def mesh_flat_sequential():
        for b in range(BUCKETS):
            flat(b).wait()
            sum_into(slices[b], received[b], 4)
        gather_sequential()

    def mesh_flat_pipelined():
        works = [flat(b) for b in range(BUCKETS)]
        for b, w in enumerate(works):
            w.wait()
            sum_into(slices[b], received[b], 4)
        gather_pipelined()

    return {"1d sequential": one_d_sequential, "1d pipelined": one_d_pipelined, "mesh sequential": mesh_sequential,
            "mesh pipelined": mesh_pipelined, "mesh coalesced": mesh_coalesced,
            "mesh pipelined + coalesced": mesh_pipelined_coalesced, "mesh, flat reduce-scatter, sequential":
            mesh_flat_sequential, "mesh, flat reduce-scatter, pipelined": mesh_flat_pipelined}  # fmt: skip


def handed_to_gloo(numel: int) -> dict:
    """Bytes one rank sends per step (to other ranks), inside its node and across nodes."""
    e = BUCKETS * numel
    # 1-D: the all-to-all sends a quarter of the bf16 bucket to each of the 3 others (1 in the node, 2 across); the
    # ring all-gather passes 3/4 of the bf16 parameters, one hop to the next rank (node-crossing on 2 of 4 hops)
    one_d = {"intra": e * 2 / 4 + e * 2 * 3 / 4 / 2, "inter": e * 2 * 2 / 4 + e * 2 * 3 / 4 / 2}
    # mesh: half the bf16 bucket to the node's other rank, half the fp32 node sums (e/2 elements) to the other node;
    # the parameters: the bf16 slice (e/4) to the other node, the bf16 chunk (e/2) to the node's other rank
    mesh = {"intra": e * 2 / 2 + e / 2 * 2, "inter": e / 2 * 4 / 2 + e / 4 * 2}
    # the flat reduce-scatter: 1-D's all-to-all (a quarter of the bf16 bucket to each peer), the mesh's all-gather
    flat = {"intra": e * 2 / 4 + e / 2 * 2, "inter": e * 2 * 2 / 4 + e / 4 * 2}
    return {"1d": one_d, "mesh": mesh, "mesh, flat reduce-scatter": flat}


def rank_main(rank: int, world: int, device, numel: int, warmup: int, reps: int) -> dict:
    torch.set_num_threads(1)
    contenders = variants(rank, numel)

    def timed(fn):
        def call():
            start = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - start

        return call

    runs = harness.round_robin({k: timed(f) for k, f in contenders.items()}, warmup, reps, before=dist.barrier)
    gathered = [None] * world
    dist.all_gather_object(gathered, runs)
    return gathered


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-m", type=float, default=2.0, help="millions of parameters, in 4 buckets")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--name", default="hsdp_launch_variants")
    args = p.parse_args(argv)
    numel = int(args.params_m * 1e6 / BUCKETS) // 4 * 4
    meta_ = harness.meta(torch.device("cpu"))
    gathered = harness.launch(rank_main, 4, "cpu", numel, args.warmup, args.reps)
    rank0 = gathered[0]
    base = harness.summary(rank0["1d pipelined"])["median_s"]
    rows, table = [], []
    for name, times in rank0.items():
        s = harness.summary(times)
        rows.append({"variant": name, **s})
        table.append([name, f"{s['median_s'] * 1e3:.1f} [{s['q1_s'] * 1e3:.1f}, {s['q3_s'] * 1e3:.1f}]",
                      f"{s['median_s'] / base:.2f}x"])  # fmt: skip
    sent = handed_to_gloo(numel)
    body = "\n".join(
        [
            f"The bare collectives of one stage-2 step, {BUCKETS} buckets of {numel:,} bf16 elements "
            f"({args.params_m:g}M parameters), 4 gloo ranks on this machine ({harness.cores()} cores), as 1-D or as "
            f"the 2 x 2 mesh; {args.reps} rounds after {args.warmup} warm-up, every variant once per round in turn, "
            "each timed to a barrier (rank 0's times). See the script's docstring for the variants.",
            "",
            harness.markdown_table(["variant", "ms per step, median [q1, q3]", "/ 1d pipelined"], table),
            "",
            "Bytes one rank hands to gloo per step (MiB, sent to other ranks): "
            + "; ".join(
                f"{k}: {v['intra'] / 2**20:.2f} inside the node, {v['inter'] / 2**20:.2f} across"
                for k, v in sent.items()
            ),  # fmt: skip
        ]
    )
    print(body)
    payload = {"numel_per_bucket": numel, "buckets": BUCKETS, "rows": rows, "ranks": gathered, "bytes": sent}
    for path in harness.write_results(args.name, meta_, payload, body, args.out_dir):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
