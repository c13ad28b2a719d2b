"""Two emulated nodes (``netns_cluster.py``): step time and bytes of the 1-D layout against the HSDP mesh at several
inter-node link speeds, checked against the alpha-beta estimate (``zero_ext.comm_time``), and that estimate at 8 x 8
H100s with 400 Gb/s links.

    python bench/bench_hsdp_cluster.py [--rates 100mbit,1gbit,10gbit,none] [--stage 2] [--params-m 2] [--steps 6]
                                       [--out-dir bench/results]

Four gloo ranks, two per node: ranks 0, 1 in namespace a, ranks 2, 3 in namespace b, joined by a veth pair shaped by
``tc`` (``none``: unshaped); MASTER_ADDR is node a's veth address, each rank's gloo address its node's veth end, so
traffic inside a node stays on the namespace's loopback. Contenders, interleaved step by step in one launch per
link speed (each timed from a barrier to a barrier):

- ``zero_1d``: ZeroAdamW over the 4 ranks (every collective crosses the link);
- ``zero_mesh``: ZeroAdamW with ``mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``
  (skipped, with the engine's error in the result, where this checkout's ZeroAdamW takes no mesh); with
  ``--bf16-reduce`` also ``zero_mesh_bf16``, the same with ``reduce_dtype=torch.bfloat16`` (the replicas then reduce
  bf16 sums, not fp32: half the bytes across the link); with ``--compressed`` also ``zero_mesh_inter_bf16`` and
  ``zero_mesh_inter_int8``, the mesh with ``inter_node_reduce_dtype=torch.bfloat16`` / ``torch.int8`` (the intra-node
  reduction stays fp32; the node sums cross as bf16 or as 64-element int8 blocks with an fp32 step);
- ``fsdp2_hsdp`` (with ``--fsdp2``): FSDP2's HSDP, ``fully_shard`` of every layer and the model on the same 2-D
  mesh, fp32 parameters with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
  (bf16 compute, fp32 gradient sums and master, as ZeroAdamW), ``reshard_after_forward`` False at stage 2 and True
  at stage 3, torch.optim.AdamW(foreach) on the sharded parameters;
- ``pattern_1d`` / ``pattern_mesh``: only the collectives ``zero_ext.comm_time.step_collectives`` lists for each
  layout, on buffers of the same sizes, called as the engine's gloo communicator calls them (a reduce-scatter as one
  all-to-all, an all-gather into a tensor): the estimator's own model of the step, measured.

Measured per step: seconds (median of the timed steps), the bytes ``comm_stats()`` counts, and the bytes that crossed
the veth (node a's end). The check fits ``T = c[contender] + k * u`` over the shaped speeds, u the link's seconds at
its nominal rate for the estimator's inter-node wire bytes (the two ranks of a node share the link: 2 W / rate), or
for the bytes that crossed the veth; k = 1 when the link delivers its nominal rate (beta = rate / k), c what the rate
does not change (compute, the node's own traffic, every collective's fixed cost); alpha is probed apart (a 1-element
all-reduce), and each point's error. Without root or iproute2 it prints why and exits 0 (after the 8 x 8 prediction).

Each timed step ends when its traffic has: a ZeroAdamW step is ``backward(); step(); finish_sync()`` (at stage 3 on
a mesh ``step()`` returns with the replicas' all-gather in flight), then a barrier; FSDP2's backward waits for its
reductions. After the barrier the bench sleeps ``--quiet-ms`` and counts what crossed the veth meanwhile (``quiet``
column: a contender whose traffic outlives its timed step shows bytes there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from netns_cluster import EmulatedCluster, parse_rate, tx_bytes, unavailable  # noqa: E402

from zero_ext import comm_time  # noqa: E402
from zero_ext.comm_time import GBIT, GBYTE, Cluster, Link  # noqa: E402

WORLD, PER_NODE, LAYERS = 4, 2, 4
MESH = (2, 2)


# ------------------------------------------------------------------------------------------------ the prediction
def h100_prediction(params_b=(7, 30, 70), stages=(2, 3), buckets: int = 32) -> tuple[list[dict], str]:
    """The estimate at 8 nodes x 8 H100s: NVLink 450 GB/s (alpha 3 us) inside a node, a 400 Gb/s NIC per GPU (alpha
    10 us) between nodes; fp32 gradient reduction (ZeroAdamW's default reduce_dtype), bf16 parameters."""
    cluster = Cluster(8, 8, Link(450 * GBYTE, 3e-6), Link(400 * GBIT, 10e-6))
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
            lines.append(f"| {b}B | {stage} | " + " | ".join(
                f"{row[k]['seconds'] * 1e3:.0f} ms ({row[k]['inter_bytes'] / 1e9:.2f} GB)"
                for k in ("1d", "mesh", "mesh_replicated")) + f" | {row['1d']['seconds'] / row['mesh']['seconds']:.2f}x |")  # fmt: skip
    head = ("| params | stage | 1-D over 64 | mesh 8 x 8 (state over 64) | mesh 8 x 8, replicate_state | 1-D / mesh |\n"
            "|---|---|---|---|---|---|")  # fmt: skip
    text = (
        "Predicted communication per step (`zero_ext.comm_time.estimate_step`, nothing overlapped; in parentheses "
        "the inter-node wire bytes one GPU sends) at 8 nodes x 8 H100: NVLink 450 GB/s, alpha 3 us; a 400 Gb/s NIC "
        f"per GPU, alpha 10 us; {buckets} buckets, fp32 gradient reduction, bf16 parameters.\n\n" + head + "\n"
        + "\n".join(lines)
    )  # fmt: skip
    return rows, text


def compressed_prediction(params_b: float = 7, stage: int = 2, buckets: int = 32) -> tuple[list[dict], str]:
    """The estimate for a 7B model at 8 x 8 GPUs on 400 Gbit/s InfiniBand and on 100 Gbit/s Ethernet (a NIC per GPU;
    NVLink 450 GB/s inside a node): 1-D over 64, the mesh, the mesh with bf16 and with int8 inter-node sums."""
    links = {"400 Gbit/s InfiniBand": Link(400 * GBIT, 10e-6), "100 Gbit/s Ethernet": Link(100 * GBIT, 25e-6)}
    layouts = {"1-D over 64": dict(), "mesh 8 x 8": dict(mesh=(8, 8)),
               "mesh, bf16 inter-node": dict(mesh=(8, 8), replica_grad_bytes=2),
               "mesh, int8 inter-node": dict(mesh=(8, 8), replica_grad_bytes=1 + 4 / 64)}  # fmt: skip
    rows, lines = [], []
    for link_name, link in links.items():
        cluster = Cluster(8, 8, Link(450 * GBYTE, 3e-6), link)
        cells = []
        for name, kw in layouts.items():
            e = comm_time.estimate_step(int(params_b * 1e9), cluster, stage, buckets=buckets, **kw)
            inter_s = sum(t for c, t in zip(e.collectives, e.times) if c.inter_node)
            rows.append({"link": link_name, "layout": name, "seconds": e.total_s, "inter_s": inter_s,
                         "inter_bytes": e.bytes_on(True), "intra_bytes": e.bytes_on(False), "collectives": e.rows()})  # fmt: skip
            cells.append(f"{e.total_s * 1e3:.0f} ms ({inter_s * 1e3:.0f} ms, {e.bytes_on(True) / 1e9:.2f} GB)")
        lines.append(f"| {link_name} | " + " | ".join(cells) + " |")
    head = "| inter-node link | " + " | ".join(layouts) + " |\n|---|" + "---|" * len(layouts)
    text = (
        f"Predicted communication per step of a {params_b:g}B model, stage {stage}, at 8 nodes x 8 GPUs "
        f"(`zero_ext.comm_time.estimate_step`, nothing overlapped; NVLink 450 GB/s, alpha 3 us inside a node; one NIC "
        f"per GPU: 400 Gbit/s InfiniBand alpha 10 us, or 100 Gbit/s Ethernet alpha 25 us; {buckets} buckets; fp32 "
        "gradient sums in the node, bf16 parameters). In parentheses: the inter-node collectives' time and the "
        "inter-node wire bytes one GPU sends.\n\n" + head + "\n" + "\n".join(lines)
    )  # fmt: skip
    return rows, text


# ------------------------------------------------------------------------------------------------ one rank
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from zero_ext import ZeroAdamW

    __import__("warnings").filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's new name
    rank, node = args.rank, args.rank // PER_NODE
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=WORLD,
                            timeout=__import__("datetime").timedelta(seconds=args.timeout))  # fmt: skip
    shard_groups, replica_groups = comm_time.mesh_groups(WORLD, MESH)
    groups = {}
    for kind, members in [("shard", g) for g in shard_groups] + [("replicate", g) for g in replica_groups]:
        group = dist.new_group(members)  # every rank creates every group, in the same order
        if rank in members:
            groups[kind] = group
    dim = int((args.params_m * 1e6 / LAYERS) ** 0.5)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            *[torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(LAYERS)]
        )

    contenders, opts, out = {}, {}, {"mesh_error": None}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, dim, generator=gen).bfloat16()
    kw = dict(stage=args.stage, bucket_size=args.bucket_size)

    def zero_step(m, opt):
        def step():
            m(x).float().pow(2).mean().backward()
            opt.step()
            opt.finish_sync()  # the step's traffic ends here (stage 3 on a mesh: the replicas' gathers)
            opt.zero_grad()

        return step

    m1 = model()
    opts["zero_1d"] = ZeroAdamW(m1.parameters(), module=m1, **kw)
    contenders["zero_1d"] = zero_step(m1, opts["zero_1d"])
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
        m2 = model()
        opts["zero_mesh"] = ZeroAdamW(m2.parameters(), module=m2, mesh=mesh, **kw)
        contenders["zero_mesh"] = zero_step(m2, opts["zero_mesh"])
        if args.bf16_reduce:
            m3 = model()
            opts["zero_mesh_bf16"] = ZeroAdamW(m3.parameters(), module=m3, mesh=mesh, reduce_dtype=torch.bfloat16, **kw)
            contenders["zero_mesh_bf16"] = zero_step(m3, opts["zero_mesh_bf16"])
        for name in ("bfloat16", "int8") if args.compressed else ():
            m4 = model()
            tag = "zero_mesh_inter_" + name.replace("bfloat16", "bf16")
            opts[tag] = ZeroAdamW(m4.parameters(), module=m4, mesh=mesh, inter_node_reduce_dtype=getattr(torch, name),
                                  **kw)  # fmt: skip
            contenders[tag] = zero_step(m4, opts[tag])
    except (TypeError, ValueError, NotImplementedError) as e:  # this checkout's ZeroAdamW takes no mesh
        out["mesh_error"] = f"{type(e).__name__}: {e}"
    if args.fsdp2:
        contenders["fsdp2_hsdp"] = fsdp2_step(model, x, args.stage)
    buckets = sum(1 for _ in opts["zero_1d"].sharded_state.buckets())
    psi = sum(p.numel() for p in m1.parameters())
    per = {name: sum(1 for _ in opt.sharded_state.buckets()) for name, opt in opts.items()}
    out.update(buckets=buckets, psi=psi, dim=dim, buckets_by_contender=per)

    def pattern(mesh_):
        cl = Cluster(2, PER_NODE, Link(1.0), Link(1.0))
        plan = comm_time.step_collectives(psi, cl, args.stage, mesh=mesh_, grad_bytes=2, replica_grad_bytes=4,
                                          buckets=buckets)  # fmt: skip
        calls = []
        for c in plan:
            group = groups.get(c.group)  # "world": the default group
            # bf16 gradients and parameters; the fp32 sums of the shard group's gradients between the replicas
            fp32 = c.group == "replicate" and c.kind != "all_gather"
            dtype = torch.float32 if fp32 else torch.bfloat16
            n = int(c.nbytes // dtype.itemsize) // c.size * c.size
            if c.kind == "reduce_scatter":  # the engine's gloo reduce-scatter: one all-to-all, then a local sum
                send, recv = torch.zeros(n, dtype=dtype), torch.empty(n, dtype=dtype)

                def rs(s=send, r=recv, g=group, size=c.size):
                    dist.all_to_all_single(r, s, group=g)
                    r.view(size, -1).float().sum(0)

                calls += [rs] * c.calls
            elif c.kind == "all_gather":
                full, piece = torch.zeros(n, dtype=dtype), torch.zeros(n // c.size, dtype=dtype)
                calls += [lambda f=full, p=piece, g=group: dist.all_gather_into_tensor(f, p, group=g)] * c.calls
            else:
                buf = torch.zeros(n, dtype=dtype)
                calls += [lambda b=buf, g=group: dist.all_reduce(b, group=g)] * c.calls
        return lambda: [f() for f in calls]

    contenders["pattern_1d"] = pattern(None)
    contenders["pattern_mesh"] = pattern(MESH)
    veth = os.environ.get("GLOO_SOCKET_IFNAME", "")
    times = {k: [] for k in contenders}
    comm = {k: [] for k in contenders}
    tx = {k: [] for k in contenders}
    quiet = {k: [] for k in contenders}
    for rep in range(args.warmup + args.steps):
        for name, fn in contenders.items():
            dist.barrier()
            before = opts[name].comm_stats() if name in opts else {}
            t0_tx = tx_bytes(veth)
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            seconds = time.perf_counter() - t0
            t1_tx = tx_bytes(veth)
            time.sleep(args.quiet_ms * 1e-3)  # what still crosses now belongs to this contender's step
            after_tx = tx_bytes(veth)
            if rep >= args.warmup:
                times[name].append(seconds)
                tx[name].append(t1_tx - t0_tx)
                quiet[name].append(after_tx - t1_tx)
                after = opts[name].comm_stats() if name in opts else {}
                comm[name].append({k: after[k] - before.get(k, 0) for k in after})
    # alpha probes: a 1-element all-reduce over 2 ranks (2 message steps) inside the node and across the link
    probes = {}
    for kind in ("shard", "replicate"):
        t = torch.zeros(1)
        samples = []
        for _ in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t, group=groups[kind])
            samples.append(time.perf_counter() - t0)
        probes[kind] = statistics.median(samples[5:]) / 2
    out.update(times=times, comm=comm, tx=tx, quiet=quiet, alpha_probe=probes, node=node, rank=rank)
    for opt in opts.values():
        opt.close()
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def fsdp2_step(model, x, stage: int):
    """FSDP2's HSDP on the bench's 2-D mesh (see the module docstring): one step, its traffic ended when it returns
    (FSDP2's backward waits for its reduce-scatters and all-reduces; its next forward gathers)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    m = model().float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)

    def step():
        m(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


# ------------------------------------------------------------------------------------------------ the driver
def run_speed(cluster: EmulatedCluster, args, rate_text: str) -> dict:
    """One launch of the four ranks at one link speed; rank 0's and rank 2's results."""
    rate = parse_rate(rate_text)
    qdisc = cluster.shape(rate, args.delay_ms * 1e-3)
    port = 29500 + os.getpid() % 1000
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(WORLD):
            node = rank // PER_NODE
            # LOCAL_WORLD_SIZE: comm_stats() counts a group larger than a node as inter-node (the 1-D layout's)
            env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.vethw[node], "OMP_NUM_THREADS": "1",
                   "LOCAL_WORLD_SIZE": str(PER_NODE)}  # fmt: skip
            cmd = [*cluster.prefix(node), sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
                   "--master", cluster.addrs[0], "--port", str(port), "--result-dir", tmp, "--stage", str(args.stage),
                   "--params-m", str(args.params_m), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--bucket-size", str(args.bucket_size), "--timeout", str(args.timeout),
                   "--quiet-ms", str(args.quiet_ms), *(["--bf16-reduce"] if args.bf16_reduce else []),
                   *(["--compressed"] if args.compressed else []), *(["--fsdp2"] if args.fsdp2 else [])]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.time() + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"the ranks at {rate_text} did not finish in {args.timeout} s")
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed at {rate_text}: return codes {[p.returncode for p in procs]}")
        ranks = {r: json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in (0, 2)}
    return {"rate": rate_text, "rate_bps": rate, "qdisc": qdisc, "netem": cluster.netem, "rank0": ranks[0],
            "rank2": ranks[2]}  # fmt: skip


def emulated_estimate(psi: int, stage: int, buckets: int, mesh, replica_grad_bytes: float = 4,
                      **kw) -> comm_time.StepComm:  # fmt: skip
    """The estimate on the emulated cluster with unit bandwidths: its wire bytes and latency steps are what count.
    gloo sends bf16 gradients as they are (2 bytes) and the replicas reduce their fp32 sums (4; 2 with
    ``reduce_dtype=torch.bfloat16``)."""
    cl = Cluster(2, PER_NODE, Link(1.0), Link(1.0), nics_per_node=1)
    kw = {"grad_bytes": 2, **kw}
    return comm_time.estimate_step(psi, cl, stage, mesh=mesh, replica_grad_bytes=replica_grad_bytes, buckets=buckets,
                                   **kw)  # fmt: skip


def replica_bytes(name: str) -> float:
    """Bytes per element of the sums the replicas exchange: fp32 (4), bf16 (2: ``reduce_dtype`` or
    ``inter_node_reduce_dtype``), int8 blocks (1 + 4 / 64)."""
    if name.endswith("int8"):
        return 1 + 4 / 64
    return 2 if name.endswith("bf16") else 4


def fit(points: list[dict], key: str) -> dict:
    """Least squares of T = c[contender] + k * u over ``points`` (u: ``point[key]``, the link's seconds at its nominal
    rate): one intercept per contender (compute, the node's own traffic and every collective's fixed cost: nothing
    that the link's rate changes) and one slope k for all (1: the link delivers its nominal rate to the bytes u
    counts). The errors are then those of the bytes model across speeds and layouts."""
    import numpy as np

    names = list(dict.fromkeys(p["contender"] for p in points))
    t = np.array([p["seconds"] for p in points])
    design = np.array([[float(p["contender"] == n) for n in names] + [p[key]] for p in points])
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    pred = design @ coef
    err = (pred - t) / t
    return {"c_s": dict(zip(names, map(float, coef[:-1]))), "k": float(coef[-1]), "predicted_s": pred.tolist(),
            "rel_error": err.tolist(), "max_abs_rel_error": float(abs(err).max()),
            "median_abs_rel_error": float(np.median(abs(err)))}  # fmt: skip


def analyse(runs: list[dict], stage: int) -> dict:
    """Per speed and contender: median step, bytes per step, veth bytes; the fits per family (zero, pattern)."""
    table, families = [], {"zero": [], "pattern": []}
    for run in runs:
        r0, r2 = run["rank0"], run["rank2"]
        for name, times in r0["times"].items():
            mesh = MESH if "mesh" in name or name.startswith("fsdp2") else None
            nb = r0["buckets_by_contender"].get(name, r0["buckets"])
            # FSDP2's HSDP: fp32 gradients reduce-scattered in the node, all-reduced across, one collective per layer
            extra = dict(replicate_state=True, grad_bytes=4, reshard_after_forward=stage == 3) if name.startswith(
                "fsdp2") else {}  # fmt: skip
            if extra:
                nb = LAYERS
            est = emulated_estimate(r0["psi"], stage, nb, mesh, replica_grad_bytes=replica_bytes(name), **extra)
            steps = len(times)
            row = {"rate": run["rate"], "rate_bps": run["rate_bps"], "contender": name,
                   "seconds": statistics.median(times), "q1_s": sorted(times)[steps // 4],
                   "q3_s": sorted(times)[(3 * steps) // 4], "times": times,
                   "veth_bytes_a_to_b": statistics.median(r0["tx"][name]),
                   "veth_bytes_b_to_a": statistics.median(r2["tx"][name]),
                   "quiet_bytes_a_to_b": max(r0.get("quiet", {}).get(name, [0])),
                   "quiet_bytes_b_to_a": max(r2.get("quiet", {}).get(name, [0])),
                   "comm_stats": r0["comm"][name][-1] if r0["comm"][name] else {},
                   "est_inter_wire_bytes": est.bytes_on(True), "est_intra_wire_bytes": est.bytes_on(False),
                   "latency_steps": est.latency_steps_on(True) + est.latency_steps_on(False)}  # fmt: skip
            table.append(row)
            if run["rate_bps"] is not None:
                # seconds at the nominal rate: the estimate's wire bytes of the node's 2 ranks through one link (the
                # flat model), and the bytes that crossed it (the busier direction)
                row["u"] = 2 * est.bytes_on(True) * 8 / run["rate_bps"]
                row["u_veth"] = max(row["veth_bytes_a_to_b"], row["veth_bytes_b_to_a"]) * 8 / run["rate_bps"]
                families.setdefault(name.split("_")[0], []).append(row)
    fits = {}
    for fam, pts in families.items():
        if len(pts) >= 3:
            for key, tag in (("u", ""), ("u_veth", "_veth")):
                f = fits[fam + tag] = fit(pts, key)
                for p, pred, err in zip(pts, f["predicted_s"], f["rel_error"]):
                    p["fit" + tag + "_s"], p["fit" + tag + "_rel_error"] = pred, err
    # no fit at all: the step's increase over the unshaped run against the nominal link time
    base = {r["contender"]: r["seconds"] for r in table if r["rate_bps"] is None}
    for r in table:
        if r["rate_bps"] is not None and r["contender"] in base:
            r["measured_increase_s"] = r["seconds"] - base[r["contender"]]
    return {"rows": table, "fits": fits}


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 5.2))
    rows = [r for r in result["rows"] if r["rate_bps"] is not None and r["contender"].startswith(("zero", "fsdp2"))]
    for name in dict.fromkeys(r["contender"] for r in rows):
        pts = sorted((r for r in rows if r["contender"] == name), key=lambda r: r["rate_bps"])
        xs = [r["rate_bps"] / 1e6 for r in pts]
        style = dict(color="black") if name.startswith("fsdp2") else {}  # FSDP2: measured only (no fit)
        (line,) = ax.plot(xs, [r["seconds"] for r in pts], "o-", label=f"{name}, measured", **style)
        for key, style, what in (("fit_s", "--", "fit, flat model's bytes"), ("fit_veth_s", ":", "fit, veth bytes")):
            if all(key in r for r in pts):
                ax.plot(xs, [r[key] for r in pts], style, color=line.get_color(), label=f"{name}, {what}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("inter-node link (Mbit/s, tc tbf on the veth)")
    ax.set_ylabel("step time (s, median)")
    stage = result.get("stage", "?")
    ax.set_title(f"2 emulated nodes x 2 gloo ranks, stage {stage}: zero_ext 1-D vs mesh vs FSDP2 HSDP")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no line hidden
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict, stage: int, h100_text: str) -> str:
    from harness import markdown_table

    rows = []
    for r in result["rows"]:
        cs = r["comm_stats"]
        stats = f"{cs['inter_node_bytes'] / 2**20:.2f} / {cs['intra_node_bytes'] / 2**20:.2f}" if cs else "-"
        fit_ = " / ".join(f"{r['fit' + t + '_s']:.3f} ({r['fit' + t + '_rel_error'] * 100:+.0f} %)"
                          for t in ("", "_veth") if "fit" + t + "_s" in r) or "-"  # fmt: skip
        inc = (
            f"{r['measured_increase_s']:.3f} / {r['u']:.3f} / {r['u_veth']:.3f}" if "measured_increase_s" in r else "-"
        )
        rows.append([r["rate"], r["contender"], f"{r['seconds']:.3f} [{r['q1_s']:.3f}, {r['q3_s']:.3f}]",
                     f"{r['veth_bytes_a_to_b'] / 2**20:.2f} / {r['veth_bytes_b_to_a'] / 2**20:.2f}",
                     f"{r['est_inter_wire_bytes'] / 2**20:.2f} / {r['est_intra_wire_bytes'] / 2**20:.2f}",
                     stats, inc, fit_,
                     f"{r.get('quiet_bytes_a_to_b', 0) / 1024:.1f} / {r.get('quiet_bytes_b_to_a', 0) / 1024:.1f}"])  # fmt: skip
    head = ["link", "contender", "step s, median [q1, q3]", "veth MiB a->b / b->a", "est. wire MiB/rank inter / intra",
            "comm_stats wire MiB (rank 0) inter / intra", "s over unshaped: measured / flat model / veth bytes at the rate",
            "fit s (error): flat model / veth bytes", "quiet: KiB on the veth after the step, max a->b / b->a"]  # fmt: skip
    fits = []
    for fam, f in result["fits"].items():
        what = "the bytes that crossed the veth" if fam.endswith("_veth") else "the estimate's wire bytes (flat model)"
        cs = ", ".join(f"{n} {c * 1e3:.0f}" for n, c in f["c_s"].items())
        fits.append(f"- `{fam.removesuffix('_veth')}_*`, u from {what}: k = {f['k']:.3f} (beta = {1 / f['k']:.2f} x "
                    f"the nominal rate); c (ms): {cs}; error median {f['median_abs_rel_error'] * 100:.1f} %, max "
                    f"{f['max_abs_rel_error'] * 100:.1f} %")  # fmt: skip
    r0 = result["rank0"]
    probe = r0["alpha_probe"]
    netem = "applied" if result["netem"] else "not in this kernel: bandwidth only (tbf); alpha is gloo's and the veth's"
    mesh = "measured" if result["mesh_error"] is None else "not run: " + result["mesh_error"]
    lines = [
        f"Stage {stage}, {r0['psi']:,} bf16 parameters ({LAYERS} linear layers of {r0['dim']}), {r0['buckets']} "
        f"buckets; 4 gloo ranks as 2 nodes x 2; {result['steps']} timed steps per contender and speed after "
        f"{result['warmup']} warm-up, interleaved. Link latency (netem): {netem}.",
        f"Mesh engine (`zero_mesh`): {mesh}.",
        "",
        markdown_table(head, rows),
        "",
        "Fits of T = c[contender] + k u over the shaped speeds, one k for every contender of a family (u: the "
        "link's seconds at its nominal rate, from the estimate's inter-node wire bytes of the node's 2 ranks (2 W / "
        "rate: the flat model, every rank's (g-1)/g through the link), or from the bytes that crossed the veth in "
        "the busier direction; c: what the rate does not change, compute and every collective's fixed cost, alpha "
        "included):",
        *fits,
        f"- alpha, probed (a 1-element all-reduce over 2 ranks, / 2 message steps, unshaped run): inside a node "
        f"{probe['shard'] * 1e3:.3f} ms, across the link {probe['replicate'] * 1e3:.3f} ms",
        "",
        "Columns: veth bytes crossed node a's and node b's end of the link per step (median; the barriers' few "
        "bytes included); est. wire bytes are `zero_ext.comm_time`'s (g-1)/g of each collective's tensor that one "
        "rank sends, what `comm_stats()` reports as `inter_node_bytes` / `intra_node_bytes` (measured in the next column: "
        "the engine's buckets are padded to whole granules, and its step adds small all-reduces of statistics).",
        "",
        "## The estimate at 8 x 8 H100s",
        "",
        h100_text,
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100mbit,1gbit,10gbit,none")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--params-m", type=float, default=2.0, help="millions of parameters")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-size", type=int, default=2**19)
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way link latency (needs netem in the kernel)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--bf16-reduce", action="store_true",
                    help="also ZeroAdamW on the mesh with reduce_dtype=torch.bfloat16 (zero_mesh_bf16)")  # fmt: skip
    ap.add_argument("--compressed", action="store_true",
                    help="also the mesh with inter_node_reduce_dtype bf16 and int8 (zero_mesh_inter_*)")  # fmt: skip
    ap.add_argument("--fsdp2", action="store_true", help="also FSDP2's HSDP (fully_shard on the 2-D mesh)")
    ap.add_argument("--predict-only", action="store_true", help="write the 8 x 8 predictions only (no cluster)")
    ap.add_argument("--quiet-ms", type=float, default=50.0, help="the wait after each timed step, veth bytes counted")
    ap.add_argument("--out-dir", default=None, help="default bench/results")
    ap.add_argument("--name", default="hsdp_cluster")
    ap.add_argument("--redraw", default=None, help="redraw the chart of a result's JSON (next to it) and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.redraw:
        result = json.load(open(args.redraw))
        command = result["meta"]["command"].split()
        result.setdefault("stage", int(command[command.index("--stage") + 1]) if "--stage" in command else 2)
        chart(result, args.redraw.removesuffix(".json") + ".png")
        return 0
    import torch
    from harness import RESULTS, meta, write_results

    info = meta(torch.device("cpu"))
    h100_rows, h100_text = h100_prediction()
    print(h100_text, flush=True)
    if args.predict_only:
        rows, text = compressed_prediction()
        out_dir = args.out_dir or str(RESULTS)
        write_results(args.name, info, {"compressed": rows, "h100_prediction": h100_rows}, text + "\n\n" + h100_text,
                      out_dir)  # fmt: skip
        print(text)
        return 0
    why = unavailable()
    if why is not None:
        print(f"bench_hsdp_cluster: skipped, no emulated cluster on this machine: {why}")
        return 0
    runs = []
    with EmulatedCluster() as cluster:
        for rate in args.rates.split(","):
            print(f"link {rate} ...", flush=True)
            runs.append(run_speed(cluster, args, rate))
            r0 = runs[-1]["rank0"]
            print("  " + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in r0["times"].items()), flush=True)
    result = analyse(runs, args.stage)
    r0 = runs[0]["rank0"]
    result.update(stage=args.stage, rank0={k: r0[k] for k in ("psi", "dim", "buckets", "alpha_probe")}, steps=args.steps,
                  warmup=args.warmup, netem=any(r["netem"] for r in runs), mesh_error=r0["mesh_error"],
                  qdiscs={r["rate"]: r["qdisc"] for r in runs}, h100_prediction=h100_rows)  # fmt: skip
    unshaped = [r for r in runs if r["rate_bps"] is None]
    if unshaped:
        result["rank0"]["alpha_probe"] = unshaped[0]["rank0"]["alpha_probe"]
    out_dir = args.out_dir or str(RESULTS)
    body = markdown(result, args.stage, h100_text)
    png = os.path.join(out_dir, f"{args.name}.png")
    os.makedirs(out_dir, exist_ok=True)
    chart(result, png)
    body = body.replace("## The estimate", f"![step time against link speed]({args.name}.png)\n\n## The estimate", 1)
    write_results(args.name, info, result, body, out_dir)
    print(body)
    print(f"wrote {out_dir}/{args.name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
