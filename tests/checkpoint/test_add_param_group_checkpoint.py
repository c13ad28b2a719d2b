"""Checkpoints and state dicts carry a param group added after construction (issue 25): saved at 2 ranks (stage 2)
after the group was added, loaded into an optimizer that added the same group at another world size, stage and
offload, and on bitwise like an unsharded reference of the engine's kernel; a checkpoint with more or fewer groups
is refused, naming the group; consolidate and the local state dict include it."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import params_digest, state_shards
from tiny_transformer import batch, build, loss_fn
from unfreezing import HYPER, KernelReference, block0, frozen_start, param_steps, train, unfreeze, world_batches

from zero_ext import checkpoint

SAVE_WORLD, SAVE_STAGE = 2, 2


def _replay(kref, model, upto, world):
    """The kernel reference through the saved run: 2 steps, block 0 added with lr/10, steps 2 .. upto - 1."""
    for step in range(upto):
        if step == 2:
            kref.add_group(block0(model), HYPER["lr"] / 10)
        kref.step(world_batches(step, world))


def _save_run(rank, world, path):
    model, opt = frozen_start(torch.bfloat16, SAVE_STAGE, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    for step in range(4):
        if step == 2:
            unfreeze(model, opt)
            kref.add_group(block0(model), HYPER["lr"] / 10)
        train(model, opt, kref, step, rank, world)
    checkpoint.save(path, opt, extra={"step": 4})
    kref.check(opt, model)


def _load_run(rank, world, stage, offload, root, path):
    model, opt = frozen_start(torch.bfloat16, stage, rank, world, offload, root, tag="load")
    before = state_shards(opt)
    # Without the group: refused on every rank, naming the group's parameters and telling what to do; nothing changed
    with pytest.raises(
        checkpoint.CheckpointError, match=r"param group\(s\) \[1\] \(parameters \['blocks\.0\.ln1\.weight'"
    ):
        checkpoint.load(path, opt)
    with pytest.raises(checkpoint.CheckpointError, match=r"opt\.add_param_group"):
        checkpoint.load(path, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, state_shards(opt))) and opt.step_count == 0
    unfreeze(model, opt)
    opt.param_groups[1]["lr"] = 1.0  # restored from the checkpoint
    assert checkpoint.load(path, opt) == {"step": 4}
    assert opt.param_groups[1]["lr"] == HYPER["lr"] / 10 and opt.step_count == 4
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, _ in model.named_parameters() if n not in block0(model)], HYPER["lr"])
    _replay(kref, model, 4, SAVE_WORLD)
    with opt.gathered_params():
        kref.check(opt, model)  # right after load: bitwise the saved state, step counts included
    for step in range(4, 6):  # and on, at this world size, stage and offload
        train(model, opt, kref, step, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)
        return params_digest(model)


@pytest.fixture(scope="module")
def saved_with_group(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ck") / "run")
    run_on_ranks(SAVE_WORLD, _save_run, path)
    return path


@pytest.mark.parametrize(("world", "stage", "offload"), [(1, 1, None), (3, 3, "cpu"), (2, 1, "nvme"), (3, 2, None)])
def test_a_checkpoint_carries_the_added_group(saved_with_group, tmp_path, world, stage, offload):
    digests = run_on_ranks(world, _load_run, stage, offload, str(tmp_path), saved_with_group)
    assert len(set(digests)) == 1


def _fewer_groups(rank, world, path):
    """A checkpoint saved before the group was added does not load into an optimizer that has it."""
    model, opt = frozen_start(torch.bfloat16, 2, rank, world)
    checkpoint.save(path, opt)
    unfreeze(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=r"its param group\(s\) \[1\] are not in the checkpoint"):
        checkpoint.load(path, opt)


def test_a_checkpoint_without_the_group_is_refused(tmp_path):
    run_on_ranks(2, _fewer_groups, str(tmp_path / "ck"))


def test_consolidate_includes_the_added_group(saved_with_group, tmp_path):
    from zero_ext.checkpoint.consolidate import adamw_state_dict

    checkpoint.consolidate(saved_with_group, tmp_path)
    sd = adamw_state_dict(tmp_path)
    assert len(sd["param_groups"]) == 2 and sd["param_groups"][1]["lr"] == HYPER["lr"] / 10
    added = sd["param_groups"][1]["params"]
    assert len(added) == len(block0(build())) and all(sd["state"][i]["step"].item() == 2 for i in added)
    assert all(sd["state"][i]["step"].item() == 4 for i in sd["param_groups"][0]["params"])


def _local_state_dict(rank, world, stage):
    """opt.state_dict() after the group was added loads into an optimizer that added it too (same layout), every
    count included (those of parameters this rank owns nothing of too: rank 0's go into checkpoints)."""
    runs = []
    for _ in range(2):
        model, opt = frozen_start(torch.bfloat16, stage, rank, world)
        kref = KernelReference(torch.bfloat16)
        kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
        runs.append((model, opt, kref))
    (model, opt, kref), (model2, opt2, _) = runs
    for step in range(4):
        if step == 2:
            unfreeze(model, opt)
            kref.add_group(block0(model), HYPER["lr"] / 10)
        train(model, opt, kref, step, rank, world)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"saved 2 param groups, this optimizer has 1; .*add_param_group"):
        opt2.load_state_dict(sd)
    unfreeze(model2, opt2)
    opt2.load_state_dict(sd)
    assert param_steps(opt2) == param_steps(opt)
    for step in range(4, 6):
        for m, o in ((model, opt), (model2, opt2)):
            loss_fn(m, batch(step, rank)).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(state_shards(opt), state_shards(opt2)))
    with opt.gathered_params(), opt2.gathered_params():
        assert params_digest(model) == params_digest(model2)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_local_state_dict_carries_the_added_group(stage):
    run_on_ranks(3, _local_state_dict, stage)
