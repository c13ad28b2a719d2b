"""Two emulated nodes (``netns_cluster.py``): step time and bytes of the 1-D layout against the HSDP mesh at several
inter-node link speeds, against the step time ``zero_ext.comm_time`` predicts from the bytes gloo's algorithms put
on the link; and the 8 x 8 GPU prediction of a 7B model's step (``hsdp_prediction.py``).

    python bench/bench_hsdp_cluster.py [--rates 100mbit,1gbit,10gbit,none] [--stage 2] [--params-m 2] [--steps 6]
                                       [--out-dir bench/results]
    python bench/bench_hsdp_cluster.py --reanalyse bench/results/a.json,bench/results/b.json   # no cluster
    python bench/bench_hsdp_cluster.py --predict-only --out-dir bench/results --name hsdp_prediction_8x8

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
  all-to-all, an all-gather into a tensor): the estimator's own model of the step, measured. ``pattern_mesh``
  reduce-scatters as the engine's mesh does on gloo: at 2 ranks per node, once over every rank
  (``flat_reduce_scatter``; runs before 86b05d8 used the two levels, and their JSON says so).

Measured per step: seconds (median of the timed steps), the bytes ``comm_stats()`` counts, and the bytes that crossed
the veth (node a's end and node b's). The analysis (``hsdp_cluster_analysis.py``) predicts each shaped row's step
from the contender's unshaped step and the link bytes of gloo's algorithms with two constants of the machine
(efficiency, overlap) fitted on a run's shaped rows; ``--reanalyse`` with several runs also predicts each run with the
constants of the others (out of sample). alpha is probed apart (a 1-element all-reduce). Without root or iproute2 it
prints why and exits 0 (after the 8 x 8 flat-model table).

Each timed step ends when its traffic has: a ZeroAdamW step is ``backward(); step(); finish_sync()`` (at stage 3 on
a mesh ``step()`` returns with the replicas' all-gather in flight), then a barrier; FSDP2's backward waits for its
reductions. After the barrier the bench sleeps ``--quiet-ms`` and counts what crossed the veth meanwhile (``quiet``
column: a contender whose traffic outlives its timed step shows bytes there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsdp_cluster_analysis import LAYERS, MEASURED, MESH, PER_NODE, WORLD, analyse, measured_rows  # noqa: E402
from hsdp_cluster_report import chart, markdown  # noqa: E402
from hsdp_prediction import compressed_prediction, h100_prediction  # noqa: E402, F401  (tests reach them here)
from netns_cluster import EmulatedCluster, parse_rate, tx_bytes, unavailable  # noqa: E402

from zero_ext import comm_time  # noqa: E402
from zero_ext.comm_time import Cluster, Link  # noqa: E402


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

    # the mesh's reduce-scatter as the engine runs it on gloo: bf16 gradients summed in fp32 (4 bytes) on nodes of
    # PER_NODE ranks take one all-to-all over every rank when 2 x PER_NODE <= 4 (MeshCommunicator.flat_reduce_scatter)
    out["pattern_mesh_flat"] = pattern_flat = 2 * PER_NODE <= 4

    def pattern(mesh_):
        cl = Cluster(2, PER_NODE, Link(1.0), Link(1.0))
        flat = mesh_ is not None and pattern_flat
        plan = comm_time.step_collectives(psi, cl, args.stage, mesh=mesh_, grad_bytes=2, replica_grad_bytes=4,
                                          buckets=buckets, flat_reduce_scatter=flat)  # fmt: skip
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


# ------------------------------------------------------------------------------------------------ results
def write_analysis(name: str, meta_: dict, result: dict, out_dir: str, h100_text: str) -> str:
    """``<name>.json``, ``.md`` and ``.png`` of an analysed result; returns the markdown body."""
    from harness import write_results

    os.makedirs(out_dir, exist_ok=True)
    chart(result, os.path.join(out_dir, f"{name}.png"))
    body = markdown({**result, "meta": meta_}, h100_text, f"{name}.png")
    write_results(name, meta_, {k: v for k, v in result.items() if k != "meta"}, body, out_dir)
    return body


def reanalyse(paths: list[str], argv) -> int:
    """Analyse committed runs again from their measured fields (:data:`MEASURED`), each in sample and with the
    constants of the others; rewrite each run's JSON, markdown and chart in place, its meta kept, the reanalysis
    (command, commit, date) added to it."""
    from harness import git_commit

    runs = [json.load(open(p)) for p in paths]
    names = [os.path.basename(p).removesuffix(".json") for p in paths]
    for run in runs:
        run["rows"] = [{k: r[k] for k in MEASURED if k in r} for r in run["rows"]]
        run.pop("fits", None)  # the per-contender-intercept fits the prediction replaces
    _, h100_text = h100_prediction()
    command = shlex.join(["python", "bench/bench_hsdp_cluster.py", *(argv if argv is not None else sys.argv[1:])])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    for i, (path, run) in enumerate(zip(paths, runs)):
        others = [r for j, r in enumerate(runs) if j != i]
        analyse(run, others, [n for j, n in enumerate(names) if j != i])
        meta_ = {**run.pop("meta"), "reanalysis": {"command": command, "commit": git_commit(), "date": when}}
        write_analysis(names[i], meta_, run, os.path.dirname(path) or ".", h100_text)
        print(f"reanalysed {path}: {json.dumps(run['link_model'], default=str)[:400]}")
    return 0


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
    ap.add_argument("--reanalyse", default=None,
                    help="comma-separated result JSONs: analyse them again (no cluster), each with the others' "
                         "constants out of sample; rewrites their .json/.md/.png in place")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.reanalyse:
        return reanalyse(args.reanalyse.split(","), argv)
    import torch
    from harness import RESULTS, meta, write_results

    info = meta(torch.device("cpu"))
    h100_rows, h100_text = h100_prediction()
    print(h100_text, flush=True)
    out_dir = args.out_dir or str(RESULTS)
    if args.predict_only:
        rows, text = compressed_prediction()
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
    r0 = runs[0]["rank0"]
    unshaped = [r for r in runs if r["rate_bps"] is None]
    probe = (unshaped[0] if unshaped else runs[0])["rank0"]["alpha_probe"]
    result = {"rows": measured_rows(runs), "stage": args.stage, "steps": args.steps, "warmup": args.warmup,
              "rank0": {"psi": r0["psi"], "dim": r0["dim"], "buckets": r0["buckets"], "alpha_probe": probe},
              "netem": any(r["netem"] for r in runs), "mesh_error": r0["mesh_error"],
              "qdiscs": {r["rate"]: r["qdisc"] for r in runs}, "h100_prediction": h100_rows,
              "pattern_mesh_flat": r0.get("pattern_mesh_flat", False)}  # fmt: skip
    analyse(result)
    body = write_analysis(args.name, info, result, out_dir, h100_text)
    print(body)
    print(f"wrote {out_dir}/{args.name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
