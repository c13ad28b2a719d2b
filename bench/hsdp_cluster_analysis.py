"""The analysis of ``bench_hsdp_cluster.py``'s measurements: per row the bytes gloo's algorithms put on the link
(``zero_ext.comm_time.step_link_load(..., algorithm="gloo")``) next to the bytes that crossed the veth, and the step
time predicted from the contender's unshaped step:

    T(link) = T_local + max(0, link_bytes / (rate * efficiency) - overlap)

``efficiency`` (the share of the tc rate that reaches the payload) and ``overlap`` (link seconds hidden under the
step's other work) are two constants of the machine, fitted on one run's shaped rows (every contender, every shaped
rate: least squares of the relative errors) and used unchanged on the other runs' (out of sample). Only measured
fields (:data:`MEASURED`) are read from a run, so a committed JSON can be analysed again (``--reanalyse``).
"""

from __future__ import annotations

import statistics

import numpy as np

from zero_ext import comm_time
from zero_ext.comm_time import Cluster, Link

WORLD, PER_NODE, LAYERS = 4, 2, 4
MESH = (2, 2)
MEASURED = ("rate", "rate_bps", "contender", "seconds", "q1_s", "q3_s", "times", "veth_bytes_a_to_b",
            "veth_bytes_b_to_a", "quiet_bytes_a_to_b", "quiet_bytes_b_to_a", "comm_stats", "buckets")  # fmt: skip
TARGET = 0.25  # issue 50: each contender's step within 25 % of the measurement


def _kept_buckets() -> int:
    """Stage 3 ZeroAdamW keeps the first ``prefetch + 1`` buckets backward needs (its default prefetch)."""
    from zero_ext.engine.config import EngineConfig

    return EngineConfig.__dataclass_fields__["prefetch"].default + 1


def replica_bytes(name: str) -> float:
    """Bytes per element of the sums the replicas exchange: fp32 (4), bf16 (2: ``reduce_dtype`` or
    ``inter_node_reduce_dtype``), int8 blocks (1 + 4 / 64)."""
    if name.endswith("int8"):
        return 1 + 4 / 64
    return 2 if name.endswith("bf16") else 4


def ran_flat_reduce_scatter(row: dict) -> bool:
    """Whether a mesh row's engine reduce-scattered each bucket once over every rank (since 86b05d8, bf16 gradients
    summed in fp32 on nodes of 2 ranks: ``MeshCommunicator.flat_reduce_scatter``), read from what its
    ``comm_stats()`` counted: the all-to-all over 2 x 2 ranks sends twice as many bytes across nodes as inside
    (a quarter of the bucket to the node's other rank, two across); the two levels send half the bucket inside the
    node and the sums of the other half across (as many bytes in fp32, half as many in bf16)."""
    stats = row.get("comm_stats") or {}
    intra = stats.get("reduce_scatter_intra_node_bytes", 0)
    inter = stats.get("reduce_scatter_inter_node_bytes", 0)
    return row["contender"].startswith("zero_mesh") and intra > 0 and abs(2 * intra - inter) <= 0.01 * inter


def plan(name: str, stage: int, buckets: int, flat_reduce_scatter: bool = False) -> dict:
    """``step_collectives`` keywords of a contender: gloo sends bf16 gradients as they are (2 bytes) and the replicas
    reduce their sums (:func:`replica_bytes`); FSDP2's HSDP reduce-scatters fp32 gradients in the node and all-reduces
    the shard across, one collective per layer; ZeroAdamW at stage 3 does not gather its kept buckets again."""
    mesh = MESH if "mesh" in name or name.startswith("fsdp2") else None
    kw = dict(mesh=mesh, grad_bytes=2, replica_grad_bytes=replica_bytes(name), buckets=buckets)
    if name.startswith("fsdp2"):
        kw.update(replicate_state=True, grad_bytes=4, reshard_after_forward=stage == 3, buckets=LAYERS)
    elif name.startswith("zero") and stage == 3:
        kw["kept_buckets"] = _kept_buckets()
    if flat_reduce_scatter:
        kw["flat_reduce_scatter"] = True
    return kw


def loads(name: str, psi: int, stage: int, buckets: int, flat_reduce_scatter: bool = False):
    """The contender's step on the emulated cluster (2 nodes x 2 ranks, one link): gloo's and the flat model's
    link bytes, and the flat model's per-rank estimate (``comm_stats()``'s counting)."""
    cl = Cluster(2, PER_NODE, Link(1.0), Link(1.0), nics_per_node=1)
    kw = plan(name, stage, buckets, flat_reduce_scatter)
    gloo = comm_time.step_link_load(psi, cl, stage, algorithm="gloo", **kw)
    flat = comm_time.step_link_load(psi, cl, stage, algorithm="ring", **kw)
    return gloo, flat, comm_time.estimate_step(psi, cl, stage, **kw)


def measured_rows(runs: list[dict]) -> list[dict]:
    """Per link speed and contender: median step and quartiles, every step, veth bytes each way, quiet bytes,
    rank 0's ``comm_stats()`` and bucket count."""
    rows = []
    for run in runs:
        r0, r2 = run["rank0"], run["rank2"]
        for name, times in r0["times"].items():
            steps = sorted(times)
            rows.append({"rate": run["rate"], "rate_bps": run["rate_bps"], "contender": name,
                         "seconds": statistics.median(times), "q1_s": steps[len(steps) // 4],
                         "q3_s": steps[(3 * len(steps)) // 4], "times": times,
                         "veth_bytes_a_to_b": statistics.median(r0["tx"][name]),
                         "veth_bytes_b_to_a": statistics.median(r2["tx"][name]),
                         "quiet_bytes_a_to_b": max(r0.get("quiet", {}).get(name, [0])),
                         "quiet_bytes_b_to_a": max(r2.get("quiet", {}).get(name, [0])),
                         "comm_stats": r0["comm"][name][-1] if r0["comm"][name] else {},
                         "buckets": r0["buckets_by_contender"].get(name, r0["buckets"])})  # fmt: skip
    return rows


def shaped_points(result: dict) -> list[dict]:
    """The rows at a shaped rate whose contender has an unshaped row, with the analysis fields."""
    return [r for r in result["rows"] if r["rate_bps"] is not None and "local_s" in r]


def fit_link_constants(points: list[dict]) -> dict:
    """``efficiency`` and ``overlap_s`` minimising the sum of squared relative errors of :func:`predict` over
    ``points`` (grid: 1/efficiency 1..4 by 0.0005, overlap 0..250 ms by 0.5 ms; deterministic)."""
    if not points:
        raise ValueError("fit_link_constants: no shaped rows to fit")
    t = np.array([p["seconds"] for p in points])
    local = np.array([p["local_s"] for p in points])
    u = np.array([p["link_bytes"] * 8 / p["rate_bps"] for p in points])
    ks = np.arange(1.0, 4.0 + 1e-9, 0.0005)
    best = (np.inf, 1.0, 0.0)
    for o in np.arange(0.0, 0.25 + 1e-9, 0.0005):
        sse = ((((local + np.maximum(0.0, ks[:, None] * u - o)) - t) / t) ** 2).sum(axis=1)
        i = int(sse.argmin())
        if sse[i] < best[0]:
            best = (float(sse[i]), float(ks[i]), float(o))
    return {"efficiency": 1 / best[1], "overlap_s": best[2]}


def predict(row: dict, constants: dict) -> float:
    return comm_time.predict_step_seconds(row["local_s"], row["link_bytes"], row["rate_bps"] / 8,
                                          constants["efficiency"], constants["overlap_s"])  # fmt: skip


def errors(points: list[dict], key: str) -> dict:
    errs = [(abs(p[key]), p) for p in points]
    worst = max(errs, key=lambda e: e[0])[1]
    beyond = [f"{p['contender']} at {p['rate']} ({p[key] * 100:+.1f} %)" for e, p in errs if e > TARGET]
    return {"max_abs_rel_error": max(e for e, _ in errs), "median_abs_rel_error": statistics.median(e for e, _ in errs),
            "worst_row": f"{worst['contender']} at {worst['rate']}", "beyond_target": beyond}  # fmt: skip


def add_bytes(result: dict) -> None:
    """Per row: the unshaped step (``local_s``), gloo's and the flat model's link bytes, the flat estimate."""
    r0, stage = result["rank0"], result["stage"]
    local = {r["contender"]: r["seconds"] for r in result["rows"] if r["rate_bps"] is None}
    for r in result["rows"]:
        one = ran_flat_reduce_scatter(r) or (r["contender"] == "pattern_mesh" and result.get("pattern_mesh_flat"))
        gloo, flat, est = loads(r["contender"], r0["psi"], stage, r.get("buckets", r0["buckets"]), bool(one))
        r["flat_reduce_scatter"] = bool(one)
        r.update(link_bytes=gloo.per_direction, link_bytes_flat=flat.per_direction,
                 est_inter_wire_bytes=est.bytes_on(True), est_intra_wire_bytes=est.bytes_on(False),
                 latency_steps=est.latency_steps_on(True) + est.latency_steps_on(False))  # fmt: skip
        if r["contender"] in local:
            r["local_s"] = local[r["contender"]]


def analyse(result: dict, others: list[dict] = (), names: list[str] = ()) -> dict:
    """Add the analysis to ``result`` (its ``rows`` measured, ``stage``, ``rank0``): bytes, constants fitted on its
    own shaped rows (in sample) and, with ``others`` (runs named ``names``), on theirs (out of sample)."""
    for res in (result, *others):
        add_bytes(res)
    pts = shaped_points(result)
    model = {"algorithm": "gloo", "fit": "least squares of the relative errors over every shaped row", "rows": len(pts)}
    if pts:
        model["in_sample"] = fit_link_constants(pts)
        for p in pts:
            p["predicted_s"] = predict(p, model["in_sample"])
            p["rel_error"] = p["predicted_s"] / p["seconds"] - 1
        model["in_sample"].update(errors(pts, "rel_error"), fitted_on="this run")
        other_pts = [p for res in others for p in shaped_points(res)]
        if other_pts:
            model["out_of_sample"] = fit_link_constants(other_pts)
            for p in pts:
                p["predicted_out_s"] = predict(p, model["out_of_sample"])
                p["rel_error_out"] = p["predicted_out_s"] / p["seconds"] - 1
            model["out_of_sample"].update(errors(pts, "rel_error_out"), fitted_on=", ".join(names))
        share = {}
        for p in pts:
            share.setdefault(p["rate"], []).append(
                p["link_bytes"] / max(p["veth_bytes_a_to_b"], p["veth_bytes_b_to_a"])
            )
        model["payload_share"] = {rate: statistics.median(v) for rate, v in share.items()}
    result["link_model"] = model
    return result
