"""The 8 x 8 GPU predictions ``bench_hsdp_cluster.py --predict-only`` writes (``hsdp_prediction_8x8.*``).

- :func:`compressed_prediction`: the step time of a 7B model at 8 nodes x 8 H100 on 400 Gbit/s InfiniBand and on
  100 Gbit/s Ethernet, for 1-D over 64, the 8 x 8 mesh, and the mesh with bf16 and int8 inter-node sums. The
  collectives are ``zero_ext.comm_time.step_collectives``'; their times NCCL's ring algorithm's
  (``zero_ext.comm_time.step_link_load(..., algorithm="nccl")`` and ``collective_seconds``: a node's inter-node bytes
  share its NICs, the busiest rank's intra-node bytes go over NVLink at the same time, plus alpha per ring step);
  the step ``overlapped_step_seconds``: compute from stated flops, the gradient reduction hidden under backward's
  share of it, the parameter all-gather after the step exposed. The flat model's communication (every GPU's
  ``(g-1)/g`` through its own NIC: ``estimate_step``, the previous table) is listed beside it.
- :func:`h100_prediction`: the flat model's communication per step at 7B / 30B / 70B (kept as it was, the last table
  of the emulated cluster's result files).
"""

from __future__ import annotations

from zero_ext import comm_time
from zero_ext.comm_time import GBIT, GBYTE, Cluster, Link

H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM bf16 dense peak, flop/s
NVLINK = Link(450 * GBYTE, 3e-6)
LINKS = {"400 Gbit/s InfiniBand": Link(400 * GBIT, 10e-6), "100 Gbit/s Ethernet": Link(100 * GBIT, 25e-6)}
LAYOUTS = {"1-D over 64": dict(), "mesh 8 x 8": dict(mesh=(8, 8)),
           "mesh, bf16 inter-node": dict(mesh=(8, 8), replica_grad_bytes=2),
           "mesh, int8 inter-node": dict(mesh=(8, 8), replica_grad_bytes=1 + 4 / 64)}  # fmt: skip


def h100_prediction(params_b=(7, 30, 70), stages=(2, 3), buckets: int = 32) -> tuple[list[dict], str]:
    """The flat model at 8 nodes x 8 H100s: NVLink 450 GB/s (alpha 3 us) inside a node, a 400 Gb/s NIC per GPU (alpha
    10 us) between nodes; fp32 gradient reduction (ZeroAdamW's default reduce_dtype), bf16 parameters."""
    cluster = Cluster(8, 8, NVLINK, Link(400 * GBIT, 10e-6))
    rows, lines = [], []
    for b in params_b:
        for stage in stages:
            row = {"params_b": b, "stage": stage}
            for name, kw in (("1d", {}), ("mesh", {"mesh": (8, 8)}),
                             ("mesh_replicated", {"mesh": (8, 8), "replicate_state": True})):  # fmt: skip
                e = comm_time.estimate_step(int(b * 1e9), cluster, stage, buckets=buckets, **kw)
                row[name] = {"seconds": e.total_s, "inter_bytes": e.bytes_on(True), "intra_bytes": e.bytes_on(False),
                             "collectives": e.rows()}  # fmt: skip
            rows.append(row)
            cells = [f"{row[k]['seconds'] * 1e3:.0f} ms ({row[k]['inter_bytes'] / 1e9:.2f} GB)"
                     for k in ("1d", "mesh", "mesh_replicated")]  # fmt: skip
            ratio = row["1d"]["seconds"] / row["mesh"]["seconds"]
            lines.append(f"| {b}B | {stage} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    head = ("| params | stage | 1-D over 64 | mesh 8 x 8 (state over 64) | mesh 8 x 8, replicate_state | 1-D / mesh |\n"
            "|---|---|---|---|---|---|")  # fmt: skip
    text = (
        "The flat model's communication per step (`zero_ext.comm_time.estimate_step`: every GPU's (g-1)/g through its "
        "own NIC, nothing overlapped; in parentheses the inter-node wire bytes one GPU sends) at 8 nodes x 8 H100: "
        "NVLink 450 GB/s, alpha 3 us; a 400 Gb/s NIC per GPU, alpha 10 us; "
        f"{buckets} buckets, fp32 gradient reduction, bf16 parameters. An upper bound for the 1-D column: NCCL's "
        "rings leave a node once per channel (`hsdp_prediction_8x8.md` has the step time with NCCL's ring bytes).\n\n"
        + head + "\n" + "\n".join(lines)
    )  # fmt: skip
    return rows, text


def compute_seconds(num_params: float, tokens_per_gpu: int, mfu: float, peak: float = H100_BF16_DENSE_FLOPS) -> float:
    """Forward + backward of a dense model: 6 flops per parameter and token, at ``mfu`` of ``peak``."""
    return 6 * num_params * tokens_per_gpu / (peak * mfu)


def layout_step(num_params: int, cluster: Cluster, compute_s: float, stage: int, buckets: int, **kw) -> dict:
    """One layout's step at scale: each collective's NCCL-ring seconds and bytes, the step time, and the flat model's
    communication for comparison."""
    load = comm_time.step_link_load(num_params, cluster, stage, algorithm="nccl", buckets=buckets, **kw)
    nics = cluster.ranks_per_node if cluster.nics_per_node is None else cluster.nics_per_node
    colls, hideable, exposed = [], 0.0, 0.0
    for c, x in zip(load.collectives, load.crossings):
        seconds = comm_time.collective_seconds(c, x, cluster)
        alpha = cluster.inter.latency if c.inter_node else cluster.intra.latency
        colls.append({"kind": c.kind, "group": c.group, "size": c.size, "calls": c.calls, "nbytes_per_call": c.nbytes,
                      "node_bytes_per_direction": x.per_direction, "nic_bytes": x.per_direction / nics,
                      "nvlink_bytes_busiest_gpu": x.intra_rank_max, "latency_s": c.latency_steps * alpha,
                      "seconds": seconds, "why": c.why})  # fmt: skip
        if c.kind == "all_gather":  # the parameters, after the step: nothing left to hide it
            exposed += seconds
        else:  # the gradients' reduction, issued bucket by bucket during backward
            hideable += seconds
    flat = comm_time.estimate_step(num_params, cluster, stage, buckets=buckets, **kw)
    return {"compute_s": compute_s, "hideable_s": hideable, "exposed_s": exposed,
            "step_s": comm_time.overlapped_step_seconds(compute_s, hideable, exposed),
            "node_bytes_per_direction": load.per_direction, "nic_bytes": load.per_direction / nics,
            "flat_comm_s": flat.total_s, "flat_inter_bytes_per_gpu": flat.bytes_on(True),
            "collectives": colls}  # fmt: skip


def compressed_prediction(params_b: float = 7, stage: int = 2, buckets: int = 32, tokens=(8 * 4096, 4096),
                          mfu: float = 0.4) -> tuple[list[dict], str]:  # fmt: skip
    """The step time of a ``params_b``-billion model at 8 x 8 GPUs (NVLink 450 GB/s inside a node, a NIC per GPU of
    each of :data:`LINKS`) for each of :data:`LAYOUTS`, with ``tokens`` per GPU per step (the first the headline, the
    second a communication-heavier batch) at ``mfu`` of the H100's bf16 dense peak."""
    num_params = int(params_b * 1e9)
    rows = []
    for t in tokens:
        compute_s = compute_seconds(num_params, t, mfu)
        for link_name, link in LINKS.items():
            cluster = Cluster(8, 8, NVLINK, link)
            for name, kw in LAYOUTS.items():
                row = layout_step(num_params, cluster, compute_s, stage, buckets, **kw)
                rows.append({"tokens_per_gpu": t, "link": link_name, "layout": name, **row})
    return rows, prediction_text(rows, params_b, stage, buckets, tokens, mfu)


def prediction_text(rows: list[dict], params_b: float, stage: int, buckets: int, tokens, mfu: float) -> str:
    names = list(LAYOUTS)
    head = "| tokens / GPU | inter-node link | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names)
    lines = []
    for t in tokens:
        for link_name in LINKS:
            by = {r["layout"]: r for r in rows if r["tokens_per_gpu"] == t and r["link"] == link_name}
            cells = [f"**{r['step_s']:.3f} s** ({r['hideable_s'] * 1e3:.0f} + {r['exposed_s'] * 1e3:.0f} ms)"
                     for r in (by[n] for n in names)]  # fmt: skip
            lines.append(f"| {t:,} | {link_name} | " + " | ".join(cells) + " |")
    first = [r for r in rows if r["tokens_per_gpu"] == tokens[0]]
    basis_head = ("| inter-node link | layout | collective | group | calls x MB | node GB per direction (per NIC) | "
                  "NVLink GB, busiest GPU | latency ms | seconds (ms) |\n" + "|---" * 9 + "|")  # fmt: skip
    basis = []
    for r in first:
        for c in r["collectives"]:
            basis.append(f"| {r['link']} | {r['layout']} | {c['kind']} ({c['why']}) | {c['group']} x{c['size']} | "
                         f"{c['calls']} x {c['nbytes_per_call'] / 1e6:.1f} | {c['node_bytes_per_direction'] / 1e9:.2f} "
                         f"({c['nic_bytes'] / 1e9:.2f}) | {c['nvlink_bytes_busiest_gpu'] / 1e9:.2f} | "
                         f"{c['latency_s'] * 1e3:.1f} | {c['seconds'] * 1e3:.1f} |")  # fmt: skip
    flat_head = "| inter-node link | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    flat = []
    for link_name in LINKS:
        by = {r["layout"]: r for r in first if r["link"] == link_name}
        flat.append(f"| {link_name} | " + " | ".join(f"{by[n]['flat_comm_s'] * 1e3:.0f} ms "
                                                      f"({by[n]['flat_inter_bytes_per_gpu'] / 1e9:.2f} GB)"
                                                      for n in names) + " |")  # fmt: skip
    compute = {t: next(r["compute_s"] for r in rows if r["tokens_per_gpu"] == t) for t in tokens}
    return "\n".join([
        f"Predicted step time of a {params_b:g}B model, stage {stage}, at 8 nodes x 8 H100 (one NIC per GPU; NVLink "
        "450 GB/s, alpha 3 us inside a node; 400 Gbit/s InfiniBand = 50 GB/s per NIC, alpha 10 us, or 100 Gbit/s "
        f"Ethernet = 12.5 GB/s, alpha 25 us; {buckets} buckets; fp32 gradient sums inside the node, bf16 "
        "parameters). Step = compute + the gradient reduction beyond 2/3 of the compute (backward's share, "
        "during which the buckets' reductions are issued) + the parameter all-gather after the step (exposed: "
        "`defer_all_gather_to` not assumed). Compute = 6 x params x tokens per GPU / (989 TFLOP/s bf16 dense x "
        f"MFU {mfu:g}): " + ", ".join(f"{compute[t]:.3f} s at {t:,} tokens" for t in tokens) + ". Collectives "
        "timed as NCCL's rings (`zero_ext.comm_time.step_link_load(..., algorithm=\"nccl\")`, "
        "`collective_seconds`): a node's inter-node bytes shared by its 8 NICs, the busiest GPU's NVLink bytes at "
        "the same time, plus the ring's (g-1) steps of alpha per pass (the inter-node alpha for a group that "
        "spans nodes); the mesh's two levels add up (not pipelined across buckets: an upper bound for the mesh). "
        "In parentheses: the gradient reduction's and the all-gather's seconds.",
        "",
        head,
        *lines,
        "",
        f"What it rests on ({tokens[0]:,} tokens per GPU; the reduction's rows are the ones that may hide): per "
        "collective, all its calls in a step, the bytes one node sends to the others (each NIC carries 1/8), the "
        "busiest GPU's NVLink bytes, the latency term and the time:",
        "",
        basis_head,
        *basis,
        "",
        "The flat model (`zero_ext.comm_time.estimate_step`, every GPU's (g-1)/g through its own NIC, nothing "
        "overlapped; in parentheses the inter-node GB one GPU sends), the previous prediction: NCCL's 1-D ring "
        "crosses a node's boundary once per channel, so it sends 1/8 of what this charges each NIC.",
        "",
        flat_head,
        *flat,
    ])  # fmt: skip
