"""Checkpoints on meshes: saved on a 2 x 2 mesh (state sharded over every rank: one file per rank, each with its own
bytes; or replicated over the nodes: replica 0 writes, once per shard) and loaded on 1 x 4, 1-D 4 ranks, 3 x 1,
2 x 2 the other way, 2 ranks, at the same or another stage: every rank's master, moments and parameters equal the
consolidated checkpoint bitwise, and the run continues (and back to 1-D)."""

import json
import os

import pytest
import torch
from distributed import run_on_ranks
from mesh_runs import batch, loss_fn, model_for, optimizer, train_steps
from safetensors.torch import load_file

from zero_ext import checkpoint

slow = pytest.mark.slow


def _save(rank, world, shape, stage, replicate_state, path):
    model = model_for(torch.float32)
    opt = optimizer(model, shape, stage, replicate_state=replicate_state)
    train_steps(model, opt, rank, 2)
    checkpoint.save(path, opt)
    opt.close()
    return True


def _load_and_check(rank, world, shape, stage, replicate_state, path, consolidated):
    model = model_for(torch.float32)
    opt = optimizer(model, shape, stage, replicate_state=replicate_state)
    checkpoint.load(path, opt)
    state = load_file(os.path.join(consolidated, "optimizer.safetensors"))
    for ref in opt.sharded_state.pieces():
        for kind, key in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
            expected = state[f"{key}/{ref.name}"].reshape(-1)[ref.piece.start : ref.piece.end]
            assert torch.equal(mine, expected), f"{shape} stage {stage}: {ref.name} {kind}"
    with opt.gathered_params():
        for name, p in model.named_parameters():
            if f"param/{name}" in state:
                assert torch.equal(p.detach(), state[f"param/{name}"]), name
    loss_fn(model, batch(7, rank)).backward()  # and it trains on
    opt.step()
    opt.close()
    return True


def _files(path):
    with open(os.path.join(path, "meta.json")) as f:
        world = json.load(f)["world_size"]
    return world, sorted(f for f in os.listdir(path) if f.endswith(".bin"))


@pytest.mark.parametrize(
    "save_at, load_at",
    [
        (
            (4, (2, 2), 2, False),
            [(4, None, 2, False), (3, (3, 1), 3, False), (4, (2, 2), 3, True), (2, None, 1, False)],
        ),
        pytest.param((4, (2, 2), 3, True), [(4, (2, 2), 2, False), (4, (1, 4), 3, False)], marks=slow),
        pytest.param((3, (3, 1), 1, False), [(4, (2, 2), 3, False)], marks=slow),
        pytest.param((4, None, 3, False), [(4, (2, 2), 1, False)], marks=slow),
        pytest.param(
            (6, (2, 3), 2, False), [(6, (3, 2), 3, False), (6, (2, 3), 1, True), (4, (2, 2), 2, False)], marks=slow
        ),
    ],
    ids=["2x2-sharded", "2x2-replicated", "3x1", "1d", "2x3"],
)
def test_checkpoints_move_between_mesh_shapes(save_at, load_at, tmp_path):
    world, shape, stage, replicated = save_at
    path, consolidated = str(tmp_path / "ck"), str(tmp_path / "full")
    run_on_ranks(world, _save, shape, stage, replicated, path)
    saved_world, files = _files(path)
    # written once per shard: every rank's own bytes (sharded), or one replica's (replicated)
    expected = (shape[1] if replicated else world) if shape else world
    assert saved_world == expected and len(files) == expected, files
    checkpoint.consolidate(path, consolidated)
    for w, s, st, rep in load_at:
        run_on_ranks(w, _load_and_check, s, st, rep, path, consolidated)
