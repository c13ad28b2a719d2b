"""What crosses nodes, counted by the group each collective runs on (comm_stats(): a group spanning nodes counts its
wire bytes as inter-node; LOCAL_WORLD_SIZE says how many ranks a node has, as torchrun sets it): per step, on a mesh,
at most half of the 1-D layout's inter-node bytes at stages 1 and 2 and a quarter at stage 3, and stage 3's forward
and backward gathers inside the node only."""

import os

import pytest
import torch
from distributed import run_on_ranks
from mesh_runs import batch, loss_fn, model_for, optimizer, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _step_bytes(rank, world, shape, stage, per_node, kw):
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # read when the communicators are made
    try:
        model = model_for(torch.float32)
        opt = optimizer(model, shape, stage, **kw)
        train_steps(model, opt, rank, 2)  # stage 3 learns its gather order in the first
        before = opt.comm_stats()
        loss_fn(model, batch(2, rank)).backward()
        opt.step()
        opt.zero_grad()
        after = opt.comm_stats()
        opt.close()
        return {k: after[k] - before[k] for k in after}
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inter_node_bytes_2x2(stage):
    flat = run_on_ranks(4, _step_bytes, None, stage, 2, {})
    mesh = run_on_ranks(4, _step_bytes, (2, 2), stage, 2, {})
    replicated = run_on_ranks(4, _step_bytes, (2, 2), stage, 2, {"replicate_state": True})
    bound = 0.5 if stage < 3 else 0.25
    for one_d, m, r in zip(flat, mesh, replicated):
        assert one_d["intra_node_bytes"] == 0, "the 1-D layout's group spans both nodes: all of it is inter-node"
        assert m["inter_node_bytes"] <= bound * one_d["inter_node_bytes"], (stage, m, one_d)
        assert r["inter_node_bytes"] <= bound * one_d["inter_node_bytes"], (stage, r, one_d)
        # the same inter-node bytes as an all-reduce: a reduce-scatter and an all-gather of 1/S among R replicas
        assert abs(m["inter_node_bytes"] - r["inter_node_bytes"]) <= 0.05 * r["inter_node_bytes"]


def test_stage3_gathers_stay_inside_the_node():
    """Stage 3: across nodes per step only the replicas' reduce-scatter of the node's gradient chunk and their
    all-gather of the updated slices (each (R-1)/R of 1/S of the model), however often forward and backward gather."""
    out = run_on_ranks(4, _step_bytes, (2, 2), 3, 2, {})
    for step in out:
        # forward and backward gather the model, in-node: at least 2x the model's bytes (less the buckets kept)
        assert step["all_gather_intra_node_bytes"] > 2 * step["all_gather_inter_node_bytes"]
        assert step["all_gather_inter_node_bytes"] == step["reduce_scatter_inter_node_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 3), (3, 2)])
@pytest.mark.parametrize("stage", [2, 3])
def test_inter_node_bytes_six_ranks(shape, stage):
    R, S = shape
    flat = run_on_ranks(6, _step_bytes, None, stage, S, {})
    mesh = run_on_ranks(6, _step_bytes, shape, stage, S, {})
    for one_d, m in zip(flat, mesh):
        # the wire bytes of a ring: (R-1)/R of 1/S twice, against (N-1)/N of the whole two or three times
        assert m["inter_node_bytes"] <= 0.5 * one_d["inter_node_bytes"]
        if stage == 3 and shape == (2, 3):
            assert m["inter_node_bytes"] <= 0.25 * one_d["inter_node_bytes"]


def _no_sync_bytes(rank, world, shape, per_node):
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        model = model_for(torch.float32)
        opt = optimizer(model, shape, 2)
        before = opt.comm_stats()
        with opt.no_sync():
            loss_fn(model, batch(0, rank)).backward()
        middle = opt.comm_stats()
        loss_fn(model, batch(1, rank)).backward()
        opt.step()
        after = opt.comm_stats()
        opt.close()
        return middle["inter_node_bytes"] - before["inter_node_bytes"], after["inter_node_bytes"] - middle[
            "inter_node_bytes"
        ]
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_no_sync_micro_batches_cross_no_node():
    for accumulating, synchronising in run_on_ranks(4, _no_sync_bytes, (2, 2), 2):
        assert accumulating == 0 and synchronising > 0
