"""HSDP through NCCL on 4 GPUs as a 2 x 2 mesh, launched with torchrun (written ahead: skipped below 4 GPUs; the
machines lent so far have one). What only GPUs show: each group's collectives on its own side streams (the node's
reduce-scatter, then the replicas' behind an event, no host wait), the 1/N prescale split over two NCCL sums, the
chunks of stage 3 gathered inside the node, the replicas' gathers of the updated slices. Checked against
torch.optim.AdamW on the 1-D mean at fp32 tolerance (NCCL sums in its own order); stages 2 and 3 equal bitwise on
one mesh; the replicated state (replicate_state=True) against the same reference; inter_node_reduce_dtype bf16 and
int8 (NCCL all-to-all of the encoded slices; stages 2 and 3 bitwise equal, within the reach of 3 Adam steps); bf16
gradients keep the two levels on NCCL (one reduce-scatter over every rank is gloo's). The script also runs on 4 gloo
ranks (test_the_script_runs_on_cpu_ranks) so that it cannot rot unseen."""

import subprocess
import textwrap

import pytest
from distributed import skip_unless_gpus
from torchrun_scripts import HELPERS, torchrun

_SCRIPT = textwrap.dedent(
    """
    import hashlib, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {helpers!r})
    from engine_reference import rank_grads, set_mean_grads
    from tiny_transformer import batch, build, loss_fn
    from torch.distributed.device_mesh import init_device_mesh
    from torchrun_scripts import init_ranks
    from zero_ext import ZeroAdamW

    HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_ranks({backend!r})
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))

    def run(stage, atol=1e-5, **kw):
        model = build(torch.float32).to(device)
        opt = ZeroAdamW(model.parameters(), **HYPER, stage=stage, module=model, bucket_size=1500, mesh=mesh, **kw)
        comm = opt.sharded_state.comm
        if device.type == "cuda":  # each group on its own streams, none the compute stream
            assert comm.shard.reduce_scatter_stream is not comm.replicate.reduce_scatter_stream
            assert comm.shard.all_gather_stream is not comm.replicate.all_gather_stream
            assert torch.cuda.current_stream() not in (comm.shard.reduce_scatter_stream,
                                                       comm.replicate.reduce_scatter_stream)
        ref = build(torch.float32)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
        for step in range(3):
            batches = [batch(step, r) for r in range(world)]
            set_mean_grads(list(ref.parameters()), rank_grads(ref, list(ref.parameters()), batches, loss_fn))
            ref_opt.step()
            loss_fn(model, batches[rank].to(device)).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            for (name, p), r in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-4, atol=atol, msg=name)
            h = hashlib.sha256()
            for p in model.parameters():
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digest = h.hexdigest()
        stats = opt.comm_stats()
        opt.close()
        return digest, stats

    s2, stats2 = run(2)
    s3, stats3 = run(3)
    assert s2 == s3, "stage 3 differs from stage 2 on the same mesh"
    assert stats3["all_gather_inter_node_bytes"] == stats3["reduce_scatter_inter_node_bytes"]
    r3, _ = run(3, replicate_state=True)
    # inter_node_reduce_dtype: encoded on the replicas' stream behind the node's event, all-to-all, fp32 sum; an
    # Adam step moves an element by at most ~lr whatever its gradient, so 3 steps stay within 2 x 3 x lr of AdamW's
    for dtype, num, den in ((torch.bfloat16, 2, 1), (torch.int8, 64, 17)):  # fp32 bytes / compressed bytes
        c2, cs2 = run(2, atol=6e-3, inter_node_reduce_dtype=dtype)
        c3, _ = run(3, atol=6e-3, inter_node_reduce_dtype=dtype)
        assert c2 == c3, f"{{dtype}}: stage 3 differs from stage 2"
        assert cs2["reduce_scatter_inter_node_bytes"] * num == stats2["reduce_scatter_inter_node_bytes"] * den, dtype
    # bf16 gradients summed in fp32 on nodes of 2 ranks: gloo reduce-scatters once over every rank (one bf16 element
    # sent per element counted), NCCL keeps the two levels (its wire is fp32, and the node's sums cross too)
    model = build(torch.bfloat16).to(device)
    opt = ZeroAdamW(model.parameters(), **HYPER, stage=2, module=model, bucket_size=1500, mesh=mesh)
    loss_fn(model, batch(0, rank).to(device)).backward()
    opt.step()
    bf16 = opt.comm_stats()
    opt.close()
    once = bf16["reduce_scatter_bytes"] == 2 * bf16["reduce_scatter_elements"]
    assert once == (device.type == "cpu"), bf16
    print("ok", s2[:16], flush=True)
    os._exit(0)
    """
)


def run_ranks(root, backend: str = "nccl") -> subprocess.CompletedProcess:
    return torchrun(_SCRIPT.format(helpers=HELPERS, backend=backend), root / "mesh_ranks.py", 4)


@pytest.mark.cuda
def test_a_2x2_mesh_through_nccl(tmp_path):
    skip_unless_gpus(4)
    proc = run_ranks(tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 4, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len({line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")}) == 1


@pytest.mark.slow
def test_the_script_runs_on_cpu_ranks(tmp_path):
    proc = run_ranks(tmp_path, backend="gloo")
    assert proc.returncode == 0 and proc.stdout.count("ok") == 4, proc.stdout[-2000:] + proc.stderr[-4000:]
