"""The layout of zero_ext.checkpoint.get_state_dict against torch's own get_state_dict for the same model under FSDP2
with torch.optim.AdamW (keys, entries, shapes, param groups by name), and dcp.async_save of it: what lands equals
what a synchronous save writes though training goes on meanwhile, and host values are not staged a second time. On
2 and 3 gloo ranks."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_runs import checkpoint_group, fsdp_model, fsdp_steps, model_for, read_whole, zero_optimizer, zero_steps
from distributed import run_on_ranks
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

import zero_ext.checkpoint as zc
from zero_ext.checkpoint.dcp_chunks import FlatPieces


def _layout(rank, world, stage):
    model = model_for(torch.float32)
    opt = zero_optimizer(model, stage)
    zero_steps(model, opt, 0, 1)
    msd, osd = zc.get_state_dict(model, opt)
    fmodel, fopt = fsdp_model()
    fsdp_steps(fmodel, fopt, 0, 1)
    tmsd, tosd = torch_get_state_dict(fmodel, fopt)
    assert list(msd) == list(tmsd)
    for key, value in msd.items():
        assert value.shape == tmsd[key].shape and value.dtype == tmsd[key].dtype, key
    assert msd["head.weight"] is msd["embed.weight"]  # a tied weight: one tensor under both keys
    assert list(osd["state"]) == list(tosd["state"])
    for fqn, entry in osd["state"].items():
        assert sorted(entry) == sorted(tosd["state"][fqn]), fqn
        for kind, value in entry.items():
            assert value.shape == tosd["state"][fqn][kind].shape, (fqn, kind)
            assert isinstance(value, FlatPieces) or kind == "step"
    assert [g["params"] for g in osd["param_groups"]] == [g["params"] for g in tosd["param_groups"]]
    for mine, theirs in zip(osd["param_groups"], tosd["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert mine[key] == theirs[key], key
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_layout_is_torch_fsdp2_layout(world):
    for stage in (1, 3):
        assert all(run_on_ranks(world, _layout, stage))


def _async(rank, world, root, offload):
    extra = dict(offload=offload) if offload else {}
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 2, **extra)
    zero_steps(model, opt, 0, 2)
    msd, osd = zc.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/sync")
    msd, osd = zc.get_state_dict(model, opt)
    staged = DefaultStager(StagingOptions(False, False, False, False)).stage({"m": msd})
    shared = all(
        staged["m"][k].flat_values.data_ptr() == v.flat_values.data_ptr()
        for k, v in msd.items()
        if isinstance(v, FlatPieces) and v.flat_values.numel()
    )
    future = dcp.async_save(
        {"model": msd, "optim": osd}, checkpoint_id=f"{root}/async", process_group=checkpoint_group()
    )
    zero_steps(model, opt, 2, 4)  # training goes on while the files are written
    future.result()
    return shared


@pytest.mark.slow
@pytest.mark.parametrize("world,offload", [(2, None), (3, "cpu")])
def test_async_save_writes_what_sync_save_writes(tmp_path, world, offload):
    assert all(run_on_ranks(world, _async, str(tmp_path), offload)), "a host snapshot was staged a second time"
    sync, asynchronous = read_whole(f"{tmp_path}/sync"), read_whole(f"{tmp_path}/async")
    assert sync.keys() == asynchronous.keys()
    for key, value in sync.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, asynchronous[key]), key
        else:
            assert value == asynchronous[key], key
