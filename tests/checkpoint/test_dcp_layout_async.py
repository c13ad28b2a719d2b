"""The layout of zero_ext.checkpoint.get_state_dict against torch's own get_state_dict for the same model under FSDP2
with torch.optim.AdamW (keys, entries, shapes, param groups by name), and dcp.async_save of it: what lands equals
what a synchronous save writes though training goes on at once (DCP's default stager and zero_ext's CachedStager);
get_state_dict copies nothing (fp32 values are views of the state), staging copies once (a host snapshot is not
staged again), CachedStager reuses its buffers once a save is done with them and never while a staged dict lives. On
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
    """At steps 2, 3, 4: a synchronous save, then an async one (DCP's default stager, then CachedStager twice) after
    which training goes on at once. Returns what the values and the stager's buffers showed."""
    extra = dict(offload=offload) if offload else {}
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 2, **extra)
    zero_steps(model, opt, 0, 2)
    msd, _ = zc.get_state_dict(model, opt)
    mine = [v for v in msd.values() if isinstance(v, FlatPieces) and v.flat_values.numel()]
    views = all(v.live for v in mine)  # fp32 in memory: views of the state, nothing copied
    staged = DefaultStager(StagingOptions(False, False, False, False)).stage({"m": msd})
    copied_once = all(
        not staged["m"][k].live and not _shares(staged["m"][k], v)
        for k, v in msd.items()
        if isinstance(v, FlatPieces) and v.flat_values.numel()
    )
    restaged = DefaultStager(StagingOptions(False, False, False, False)).stage(staged)  # a host snapshot: as it is
    not_twice = all(_shares(restaged["m"][k], v) for k, v in staged["m"].items() if _piece(v))
    stager = zc.CachedStager()
    for i, async_stager in enumerate([None, stager, stager]):
        msd, osd = zc.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/sync{i}")
        msd, osd = zc.get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/async{i}",
                                process_group=checkpoint_group(), async_stager=async_stager)  # fmt: skip
        zero_steps(model, opt, 2 + i, 3 + i)  # training goes on while the files are written
        future.result()
    stager.close()
    stager = zc.CachedStager()  # (the last upload thread may still be letting go of its staged dict)
    first = stager.stage({"model": msd})
    pointers = [t.data_ptr() for v in first["model"].values() if _piece(v) for _, t in v.pieces()]
    held = stager.stage({"model": msd})  # while `first` lives, its buffers are not reused
    busy_apart = not any(_shares(held["model"][k], v) for k, v in first["model"].items() if _piece(v))
    del first, held
    again = stager.stage({"model": msd})  # once nothing holds them, the same buffers again
    reused = pointers == [t.data_ptr() for v in again["model"].values() if _piece(v) for _, t in v.pieces()]
    stager.close()
    return dict(views=views, copied_once=copied_once, not_twice=not_twice, reused=reused, busy_apart=busy_apart)


def _piece(v) -> bool:
    return isinstance(v, FlatPieces) and v.flat_values.numel() > 0


def _shares(a: FlatPieces, b: FlatPieces) -> bool:
    ptr = lambda v: {t.untyped_storage().data_ptr() for _, t in v.pieces()}  # noqa: E731
    return bool(ptr(a) & ptr(b))


@pytest.mark.slow
@pytest.mark.parametrize("world,offload", [(2, None), (3, "cpu")])
def test_async_save_writes_what_sync_save_writes(tmp_path, world, offload):
    for rank, seen in enumerate(run_on_ranks(world, _async, str(tmp_path), offload, timeout=600)):
        assert all(seen.values()), f"rank {rank}: {seen}"
    for i in range(3):
        sync, asynchronous = read_whole(f"{tmp_path}/sync{i}"), read_whole(f"{tmp_path}/async{i}")
        assert sync.keys() == asynchronous.keys()
        for key, value in sync.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, asynchronous[key]), (i, key)
            else:
                assert value == asynchronous[key], (i, key)
