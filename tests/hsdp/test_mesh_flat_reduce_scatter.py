"""bf16 gradients summed in fp32 on nodes of 2 ranks: a mesh reduce-scatters each bucket with one all-to-all over
every rank, since the two levels would send as many bytes across nodes (the node's fp32 sums of half the bucket
against the bf16 gradients of the other node's half) in two collectives instead of one
(``MeshCommunicator.flat_reduce_scatter``). Seen through comm_stats(): the all-to-all sends 1/4 of each bf16 bucket
to the node's other rank and 2/4 across nodes, the two levels 1/2 of it inside the node and 1/4 of its fp32 sums
across. The flat sum is every rank's gradient in process order divided by N, the 1-D layout's own mean, so the mesh
run equals the 1-D run bitwise at every stage. Under no_sync() the node's sums are held as before (the two levels)."""

import os

import pytest
import torch
from distributed import run_on_ranks
from mesh_runs import batch, full_copies, loss_fn, model_for, optimizer, train_kw, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _reduce_scatter_bytes(rank, world, shape, stage, dtype_name):
    """One step's reduce-scatter counts (after two steps), with LOCAL_WORLD_SIZE = the mesh's S."""
    os.environ["LOCAL_WORLD_SIZE"] = str(shape[1])
    try:
        model = model_for(getattr(torch, dtype_name))
        opt = optimizer(model, shape, stage)
        train_steps(model, opt, rank, 2)
        before = opt.comm_stats()
        train_steps(model, opt, rank, 1, start=2)
        after = opt.comm_stats()
        opt.close()
        keys = ("reduce_scatter_elements", "reduce_scatter_bytes", "reduce_scatter_intra_node_bytes",
                "reduce_scatter_inter_node_bytes")  # fmt: skip
        return {k: after[k] - before[k] for k in keys}
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradients_on_2x2_take_one_all_to_all(stage):
    for got in run_on_ranks(4, _reduce_scatter_bytes, (2, 2), stage, "bfloat16"):
        n = got["reduce_scatter_elements"]
        assert got["reduce_scatter_bytes"] == 2 * n, "one bf16 collective per bucket (no fp32 node sums sent)"
        # an all-to-all over 4 ranks: a quarter of the bucket to each peer, one inside the node and two across
        assert got["reduce_scatter_intra_node_bytes"] == n // 2, got
        assert got["reduce_scatter_inter_node_bytes"] == n, got


def test_fp32_gradients_keep_the_two_levels():
    """fp32 gradients: the node's fp32 sums of half the bucket cross nodes, half the bytes the all-to-all would."""
    for got in run_on_ranks(4, _reduce_scatter_bytes, (2, 2), 2, "float32"):
        n = got["reduce_scatter_elements"] * 2 // 3  # the bucket's elements, then the chunk's (half of them)
        assert got["reduce_scatter_bytes"] == 4 * n * 3 // 2, got
        assert got["reduce_scatter_intra_node_bytes"] == 2 * n, got  # half of 4n bytes to the node's other rank
        assert got["reduce_scatter_inter_node_bytes"] == n, got  # half of the chunk's 2n bytes across


@pytest.mark.slow
def test_the_rule_on_six_ranks():
    """3 x 2 (nodes of 2 ranks) takes the all-to-all, 2 x 3 (nodes of 3: the two levels send 2/3 of its bytes
    across) keeps the two levels."""
    for got in run_on_ranks(6, _reduce_scatter_bytes, (3, 2), 2, "bfloat16"):
        assert got["reduce_scatter_bytes"] == 2 * got["reduce_scatter_elements"], got
    for got in run_on_ranks(6, _reduce_scatter_bytes, (2, 3), 2, "bfloat16"):
        assert got["reduce_scatter_bytes"] > 2 * got["reduce_scatter_elements"], got  # fp32 sums travel too


def test_the_mesh_run_is_the_1d_run_bitwise_at_every_stage():
    """Each run is also checked against the unsharded kernel fed the mesh's mean (train_against_reference)."""
    one_d = {digest for digest, _ in run_on_ranks(4, train_kw, None, 2, dict(dtype_name="bfloat16"))}
    assert len(one_d) == 1
    for stage in (1, 2, 3):
        mesh = {digest for digest, _ in run_on_ranks(4, train_kw, (2, 2), stage, dict(dtype_name="bfloat16"))}
        assert mesh == one_d, f"stage {stage}"


def _accumulate_bf16(rank, world, shape, pattern):
    """Two steps of two micro-batches in bf16, the first under no_sync() ("sync-last"), or dropped by zero_grad()
    before the second ("dropped"); returns the parameters and the inter-node bytes of each micro-batch."""
    model = model_for(torch.bfloat16)
    opt = optimizer(model, shape, 2)
    crossed = []
    for step in range(2):
        before = opt.comm_stats()["inter_node_bytes"]
        with opt.no_sync():
            loss_fn(model, batch(10 + step, rank)).backward()
        crossed.append(opt.comm_stats()["inter_node_bytes"] - before)
        if pattern == "dropped":
            opt.zero_grad()
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return full_copies(model, opt), crossed


@pytest.mark.parametrize("pattern", ["sync-last", "dropped"])
def test_no_sync_holds_the_node_sums_and_then_matches_1d(pattern):
    """The held micro-batch crosses no node (its two levels' first only); the run agrees with the 1-D one to bf16
    accumulation (1-D accumulates the micro-batches in the bf16 gradient, the mesh its node sums in fp32)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        flat = run_on_ranks(4, _accumulate_bf16, None, pattern)[0][0]
        mesh_runs = run_on_ranks(4, _accumulate_bf16, (2, 2), pattern)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    for params, crossed in mesh_runs:
        assert crossed == [0, 0], crossed
    for a, b in zip(flat, mesh_runs[0][0]):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)


def _two_backwards(rank, world, shape, stage):
    """Two backward passes before each step (no no_sync(): the second reduce-scatter adds into the grad shard)."""
    model = model_for(torch.bfloat16)
    opt = optimizer(model, shape, stage)
    for step in range(2):
        for micro in range(2):
            loss_fn(model, batch(10 * step + micro, rank)).backward()
        opt.step()
        opt.zero_grad()
    return full_copies(model, opt)


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulating_reduce_scatters_match_1d_bitwise(stage):
    one_d = run_on_ranks(4, _two_backwards, None, stage)[0]
    mesh = run_on_ranks(4, _two_backwards, (2, 2), stage)[0]
    assert all(torch.equal(a, b) for a, b in zip(one_d, mesh))
