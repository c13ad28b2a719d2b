"""``inter_node_reduce_dtype``: the node sums cross nodes as bf16 or int8 blocks (zero_ext/comm/compress.py).

The reference applies the documented error model in plain torch: each node's fp32 mean of its ranks' gradients
(rank order), encoded as the replica sends it (bf16 round-to-nearest-even; int8: 64-element blocks of each layout
rank's shard of every bucket, ``step = absmax / 127``, ``code = round(x / step)``, ``code * step``), the decoded
values added in replica order in fp32 and divided by R; the engine's kernel, unsharded, fed those means. The model is
exact, so the mesh run equals it bitwise at stages 1, 2 and 3 (and so the stages equal each other), on 2 x 2 and
2 x 1; on 1 x 2 (one replica: nothing crosses nodes) the option changes nothing. Checkpoints of a compressed run
load into an fp32-reduce run bitwise."""

import os

import pytest
import torch
from distributed import run_on_ranks

from zero_ext.comm.compress import BLOCK, InterNodeCodec

slow = pytest.mark.slow


# ---------------------------------------------------------------- the error model, in plain torch


def quantize_reference(x: torch.Tensor, dtype) -> torch.Tensor:
    """What replica value ``x`` (fp32, a whole number of 64-element blocks from its first element for int8) is after
    crossing nodes."""
    if dtype == torch.bfloat16:
        return x.to(torch.bfloat16).float()
    out = torch.empty_like(x)
    for b in range(0, x.numel(), BLOCK):
        block = x[b : b + BLOCK]
        step = block.abs().max() / 127  # fp32
        denominator = step if step != 0 else torch.tensor(1.0)
        codes = torch.nan_to_num(block / denominator, nan=0.0).round().clamp(-127, 127)
        out[b : b + BLOCK] = codes * step
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_codec_is_the_error_model(dtype):
    """Encode, one message per replica, decode, replica-order fp32 sum / R: bitwise the reference; a block with a
    NaN or an inf decodes to NaN (int8) or keeps it (bf16); zero blocks stay zero; the bound |q(x) - x|."""
    codec = InterNodeCodec(dtype)
    R, n = 3, 4 * BLOCK
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(R * n, generator=g) * torch.logspace(-6, 2, R * n) for _ in range(R)]
    chunks[0][:BLOCK] = 0.0  # a zero block
    chunks[1][BLOCK + 3] = float("nan")
    chunks[2][2 * BLOCK + 5] = float("inf")
    for rank in range(R):  # what replica `rank` ends with: its slice of every replica's chunk
        workspace = torch.empty(codec.workspace_bytes(R * n, R), dtype=torch.uint8)
        send, received, decoded, total = codec.split(workspace, R * n, R)
        for r in range(R):  # the all-to-all: message `rank` of replica r
            codec.encode(chunks[r], send)
            received[r].copy_(send[rank])
        codec.sum_into(received, decoded, total, divide=True)
        parts = [quantize_reference(c[rank * n : (rank + 1) * n], dtype) for c in chunks]
        expected = sum(parts[1:], parts[0]) / R
        assert torch.equal(total, expected) or torch.allclose(total, expected, rtol=0, atol=0, equal_nan=True)
        for c in chunks:
            x = c[rank * n : (rank + 1) * n]
            q = quantize_reference(x, dtype)
            finite = torch.isfinite(x).view(-1, BLOCK).all(1).repeat_interleave(BLOCK)
            if dtype == torch.bfloat16:
                bound = x.abs() * 2.0**-8  # half an ulp (2^-8 relative), the ulp of bf16's 8 significant bits
            else:
                absmax = x.abs().view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)
                bound = absmax / 254 + absmax * 2.0**-22  # half a step, and the division's and product's roundings
            assert bool(((q - x).abs()[finite] <= bound[finite]).all())
            if dtype == torch.int8:
                assert bool(q[~finite].isnan().all()), "a non-finite block must decode to NaN"
    assert codec.message_bytes(n) == (2 * n if dtype == torch.bfloat16 else n + n // 16)


# ---------------------------------------------------------------- on gloo ranks


def _compressed_means(ref, step, world, shape, dtype, owners):
    """The means the engine must compute: ``tree_means``' node means, each replica's encoded per the layout
    (``owners``: every layout rank's pieces), added in replica order and divided by R."""
    from engine_reference import rank_grads
    from mesh_runs import batch, loss_fn, model_for

    model = model_for(torch.float32)
    ref.load_into(model)
    named = list(model.named_parameters())
    grads = rank_grads(model, [p for _, p in named], [batch(step, r) for r in range(world)], loss_fn)
    R, S = shape
    partial = [{} for _ in range(R)]
    for i, (name, p) in enumerate(named):
        if p.requires_grad:
            for r in range(R):
                row = [grads[r * S + s][i].float().reshape(-1) for s in range(S)]
                partial[r][name] = sum(row[1:], row[0]) / S
    means = {name: torch.zeros_like(v) for name, v in partial[0].items()}
    for group, pieces in owners.items():  # one shard buffer per (flat group, layout rank), as the replicas send it
        size = -(-max(off + end - start for _, start, end, off in pieces) // BLOCK) * BLOCK
        decoded = []
        for r in range(R):
            shard = torch.zeros(size)
            for name, start, end, off in pieces:
                shard[off : off + end - start] = partial[r][name][start:end]
            decoded.append(quantize_reference(shard, dtype))
        total = sum(decoded[1:], decoded[0]) / R
        for name, start, end, off in pieces:
            means[name][start:end] = total[off : off + end - start]
    return means


def _owners(opt):
    """Every layout rank's pieces, keyed (flat group, layout rank): (name, start, end, shard offset)."""
    import torch.distributed as dist

    groups = list(opt.sharded_state.groups)
    mine = {}
    for ref in opt.sharded_state.pieces():
        mine.setdefault(groups.index(ref.group), []).append(
            (ref.name, ref.piece.start, ref.piece.end, ref.piece.shard_offset)
        )
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {(g, k): pieces for k, m in enumerate(every) for g, pieces in m.items()}


def _against_reference(rank, world, shape, configs, steps=3):
    """For each (stage, dtype name): ``steps`` steps checked bitwise against the reference after each; returns the
    parameters' digests and this rank's comm_stats() per configuration."""
    from engine_reference import params_digest
    from mesh_runs import GroupedFusedReference, batch, loss_fn, model_for, optimizer, tree_means

    out = []
    for stage, name in configs:
        dtype = None if name is None else getattr(torch, name)
        model = model_for(torch.float32)
        opt = optimizer(model, shape, stage, inter_node_reduce_dtype=dtype)
        ref = GroupedFusedReference(model_for(torch.float32))
        owners = _owners(opt)
        for step in range(steps):
            if dtype is None or shape[0] == 1:  # fp32 sums, or nothing crosses nodes: today's tree mean
                ref.step(tree_means(ref, step, world, shape, torch.float32))
            else:
                ref.step(_compressed_means(ref, step, world, shape, dtype, owners))
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            with opt.gathered_params():
                ref.check(opt, model, f"{shape} stage {stage} {name} step {step}")
        with opt.gathered_params():
            digest = params_digest(model)
        out.append((digest, opt.comm_stats()))
        opt.close()
    return out


def test_2x2_bf16_and_int8_at_every_stage_are_the_error_model_bitwise():
    configs = [(stage, name) for name in ("bfloat16", "int8") for stage in (1, 2, 3)] + [(2, None)]
    runs = run_on_ranks(4, _against_reference, (2, 2), configs)
    for i in range(0, 6, 3):  # the stages equal each other (and every rank holds the same parameters)
        assert len({rank[j][0] for rank in runs for j in range(i, i + 3)}) == 1, configs[i]
    inter = {name: runs[0][configs.index((2, name))][1]["reduce_scatter_inter_node_bytes"] for name in
             ("bfloat16", "int8", None)}  # fmt: skip
    assert inter["bfloat16"] * 2 == inter[None]  # 2 bytes per element instead of 4
    assert inter["int8"] * 64 == inter[None] * 17  # 1 + 4/64 bytes per element
    assert runs[0][configs.index((2, "int8"))][0] != runs[0][configs.index((2, None))][0]  # it did compress


@slow
def test_2x1_and_1x2_edge_meshes():
    """2 x 1 (a node of one rank: the node sum is its gradient) follows the model bitwise; 1 x 2 (one replica)
    sends nothing across nodes, so the option leaves the run bitwise fp32's."""
    run_on_ranks(2, _against_reference, (2, 1), [(2, "int8"), (3, "bfloat16")])
    one = run_on_ranks(2, _against_reference, (1, 2), [(2, "int8"), (2, None)])
    assert one[0][0][0] == one[0][1][0]


def _refusals(rank, world):
    from mesh_runs import make_mesh, model_for, optimizer
    from torch.distributed.device_mesh import init_device_mesh

    one_d = init_device_mesh("cpu", (world,))
    cases = [
        (dict(mesh=None, inter_node_reduce_dtype=torch.int8), "2-D `mesh`"),
        (dict(mesh=one_d, inter_node_reduce_dtype=torch.bfloat16), "2-D `mesh`"),
        (dict(mesh=make_mesh((2, 2)), inter_node_reduce_dtype=torch.float16), "torch.bfloat16 or torch.int8"),
        (dict(mesh=make_mesh((2, 2)), inter_node_reduce_dtype=torch.int8, replicate_state=True), "replicate_state"),
    ]
    for kw, words in cases:
        model = model_for(torch.float32)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="inter_node_reduce_dtype") as err:
            optimizer(model, None, 2, **kw)
        assert words in str(err.value), str(err.value)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return True


def test_refused_without_a_two_dimensional_sharded_mesh():
    """No mesh, a 1-D DeviceMesh, fp16, replicate_state=True: a ValueError naming the option on every rank."""
    run_on_ranks(4, _refusals)


def _save_compressed(rank, world, path):
    from mesh_runs import model_for, optimizer, train_steps

    from zero_ext import checkpoint

    model = model_for(torch.float32)
    opt = optimizer(model, (2, 2), 2, inter_node_reduce_dtype=torch.int8)
    train_steps(model, opt, rank, 2)
    checkpoint.save(path, opt)
    state = {(r.name, r.piece.start, kind): r.group.state.read(kind, r.piece.shard_range).clone() for r in
             opt.sharded_state.pieces() for kind in ("master", "exp_avg", "exp_avg_sq")}  # fmt: skip
    opt.close()
    return state


def _load_fp32(rank, world, path, every):
    from mesh_runs import model_for, optimizer

    from zero_ext import checkpoint

    model = model_for(torch.float32)
    opt = optimizer(model, (2, 2), 2)  # fp32 sums
    checkpoint.load(path, opt)
    saved = every[rank]  # the same mesh shape: the same layout rank
    for r in opt.sharded_state.pieces():
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            mine = r.group.state.read(kind, r.piece.shard_range)
            assert torch.equal(mine, saved[(r.name, r.piece.start, kind)]), (r.name, kind)
    opt.close()
    return True


def test_checkpoints_of_a_compressed_run_load_into_an_fp32_run(tmp_path):
    path = os.path.join(str(tmp_path), "ck")
    saved = run_on_ranks(4, _save_compressed, path)
    assert all(run_on_ranks(4, _load_fp32, path, saved))
