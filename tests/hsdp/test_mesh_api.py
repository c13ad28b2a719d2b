"""ZeroAdamW(mesh=...): what it accepts, what it builds, and a bad mesh failing on every rank with an error naming
the problem (nothing built, no rank left waiting)."""

import os

import pytest
import torch
from distributed import run_on_ranks
from mesh_runs import make_mesh, model_for, optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zero_ext


def _error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def _refusals(rank, world):
    model = model_for(torch.float32)
    params = list(model.parameters())
    good = make_mesh((2, 2))
    misnamed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    three = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))
    small = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("replicate", "shard"))
    cases = {
        "misnamed": dict(mesh=misnamed),
        "three dims": dict(mesh=three),
        "not the world": dict(mesh=small),
        "a string": dict(mesh="nodes"),
        "a list": dict(mesh=[[0, 1], [2, 3]]),
        "and a group": dict(mesh=good, process_group=torch.distributed.group.WORLD),
        "replicate_state alone": dict(replicate_state=True),
        "replicate_state not a bool": dict(mesh=good, replicate_state="yes"),
    }
    out = {}
    for name, kw in cases.items():
        out[name] = _error_of(lambda kw=kw: zero_ext.ZeroAdamW(params, stage=2, **kw))
    return out


def test_bad_meshes_are_refused_with_the_reason():
    for errors in run_on_ranks(4, _refusals):
        assert "('replicate', 'shard')" in errors["misnamed"]
        assert "1 or 2 dimensions" in errors["three dims"]
        assert "cover every rank" in errors["not the world"] and "the world has 4" in errors["not the world"]
        assert "'auto'" in errors["a string"] and "DeviceMesh" in errors["a list"]
        assert "not both" in errors["and a group"]
        assert "2-D `mesh`" in errors["replicate_state alone"]
        assert "`replicate_state` must be True or False" in errors["replicate_state not a bool"]


def _one_rank_misnamed(rank, world):
    """Rank 0 alone names its dimensions wrongly: every rank fails, none waits."""
    names = ("dp", "fsdp") if rank == 0 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = model_for(torch.float32)
    return _error_of(lambda: zero_ext.ZeroAdamW(model.parameters(), stage=2, mesh=mesh, collective_timeout=30))


def test_a_mesh_bad_on_one_rank_fails_every_rank():
    errors = run_on_ranks(4, _one_rank_misnamed)
    assert "('replicate', 'shard')" in errors[0]
    assert all(e is not None for e in errors[1:]), errors


def _auto(rank, world, per_node):
    if per_node is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        model = model_for(torch.float32)
        opt = optimizer(model, None, 2, mesh="auto")
        shape = opt.sharded_state.mesh.shape
        opt.close()
        return shape
    except ValueError as e:
        return str(e)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def test_auto_builds_nodes_by_ranks_per_node(capfd):
    assert run_on_ranks(4, _auto, 2) == [(2, 2)] * 4
    assert run_on_ranks(4, _auto, 4) == [(1, 4)] * 4  # one node: the 1-D layout
    assert all("LOCAL_WORLD_SIZE" in e for e in run_on_ranks(4, _auto, None))
    assert all("does not divide" in e for e in run_on_ranks(4, _auto, 3))


def _one_d_mesh(rank, world):
    mesh = init_device_mesh("cpu", (4,))
    model = model_for(torch.float32)
    opt = optimizer(model, None, 2, mesh=mesh)
    shape, replicate = opt.sharded_state.mesh.shape, opt.sharded_state.mesh.replicate
    opt.close()
    return shape, replicate


def test_a_one_dimensional_mesh_is_its_group():
    assert run_on_ranks(4, _one_d_mesh) == [((1, 4), None)] * 4


def _edit(rank, world, stage, replicate_state):
    from mesh_runs import batch, loss_fn

    model = model_for(torch.float32)
    opt = optimizer(model, (2, 2), stage, replicate_state=replicate_state)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    with opt.gathered_params(modifier_rank=3):
        if rank == 3:
            with torch.no_grad():
                model.head.weight.fill_(0.5)
    with opt.gathered_params():
        seen = bool((model.head.weight == 0.5).all())
    masters = [
        bool((ref.group.state.read("master", ref.piece.shard_range) == 0.5).all())
        for ref in opt.sharded_state.pieces()
        if ref.name == "head.weight" or ref.name == "embed.weight"
    ]
    loss_fn(model, batch(1, rank)).backward()  # and trains on from there
    opt.step()
    opt.close()
    return seen, all(masters)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("replicate_state", [False, True])
def test_an_edit_by_the_last_rank_reaches_every_shard_and_chunk(stage, replicate_state):
    """gathered_params(modifier_rank=3): rank 3 (of the job; a replica's rank with replicate_state) edits, every
    rank's parameters, chunks (stage 3) and master follow."""
    assert run_on_ranks(4, _edit, stage, replicate_state) == [(True, True)] * 4
