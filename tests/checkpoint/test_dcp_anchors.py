"""The anchors' failure cases through DCP: AdamW with ``amsgrad=True`` (DeepSpeed's universal checkpoint knows only
Adam's two moments, DeepSpeed #8608) moves ZeroAdamW -> FSDP2 + torch.optim.AdamW and back with ``max_exp_avg_sq``;
and stage 3 on a 2 x 2 HSDP mesh (DeepSpeed reshards ZeRO-3 over data parallelism only, #5475) resumes as 1-D
stage 3 on 3 ranks bitwise and under FSDP2 on 3 ranks. Each continuation is compared with the uninterrupted run:
bitwise between zero_ext runs, at torch's fp32 tolerance across zero_ext and torch (their AdamW kernels round the same
formula differently)."""

import pytest
import torch
from dcp_runs import (
    HYPER,
    fsdp_full,
    fsdp_load,
    fsdp_mesh,
    fsdp_save,
    fsdp_steps,
    zero_full,
    zero_load,
    zero_optimizer,
    zero_save,
    zero_steps,
)
from distributed import run_on_ranks
from mesh_runs import model_for, param_groups
from torch.distributed.fsdp import fully_shard

SAVED_AT, STOP = 2, 4


def _fsdp(amsgrad: bool):
    model = model_for(torch.float32)
    mesh = fsdp_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(param_groups(model), **HYPER, amsgrad=amsgrad)


def _amsgrad_save(rank, world, root):
    out = {}
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 2, amsgrad=True)
    zero_steps(model, opt, 0, SAVED_AT)
    zero_save(model, opt, f"{root}/zero-ams")
    zero_steps(model, opt, SAVED_AT, STOP)
    out["zero"] = zero_full(model, opt)
    model, opt = _fsdp(True)
    fsdp_steps(model, opt, 0, SAVED_AT)
    fsdp_save(model, opt, f"{root}/fsdp-ams")
    fsdp_steps(model, opt, SAVED_AT, STOP)
    out["fsdp"] = fsdp_full(model)
    return out


def _amsgrad_resume(rank, world, root):
    out = {}
    model, opt = _fsdp(True)
    fsdp_load(model, opt, f"{root}/zero-ams")
    keys = {k for entry in opt.state_dict()["state"].values() for k in entry}
    assert "max_exp_avg_sq" in keys, keys
    fsdp_steps(model, opt, SAVED_AT, STOP)
    out["zero->fsdp"] = fsdp_full(model)
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3, amsgrad=True)
    zero_load(model, opt, f"{root}/fsdp-ams")
    zero_steps(model, opt, SAVED_AT, STOP)
    out["fsdp->zero"] = zero_full(model, opt)
    return out


@pytest.mark.slow
def test_amsgrad_moves_between_zero_ext_and_fsdp2_with_max_exp_avg_sq(tmp_path):
    root = str(tmp_path)
    saved = run_on_ranks(2, _amsgrad_save, root)[0]
    resumed = run_on_ranks(3, _amsgrad_resume, root)[0]
    for run, source in (("zero->fsdp", "zero"), ("fsdp->zero", "fsdp")):
        assert resumed[run].keys() == saved[source].keys()
        for key, value in saved[source].items():
            torch.testing.assert_close(resumed[run][key], value, msg=lambda m: f"{run} {key}: {m}")


def _hsdp_stage3_save(rank, world, root):
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3, (2, 2))
    zero_steps(model, opt, 0, SAVED_AT)
    zero_save(model, opt, f"{root}/hsdp-s3")
    zero_steps(model, opt, SAVED_AT, STOP)
    return zero_full(model, opt)


def _hsdp_stage3_resume(rank, world, root):
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3)
    zero_load(model, opt, f"{root}/hsdp-s3")
    zero_steps(model, opt, SAVED_AT, STOP)
    out = {"1-D stage 3": zero_full(model, opt)}
    model, opt = _fsdp(False)
    fsdp_load(model, opt, f"{root}/hsdp-s3")
    fsdp_steps(model, opt, SAVED_AT, STOP)
    out["FSDP2"] = fsdp_full(model)
    return out


@pytest.mark.slow
def test_stage3_on_a_2x2_mesh_resumes_1d_on_3_ranks_and_under_fsdp2(tmp_path):
    root = str(tmp_path)
    uninterrupted = run_on_ranks(4, _hsdp_stage3_save, root)[0]
    resumed = run_on_ranks(3, _hsdp_stage3_resume, root)[0]
    for key, value in uninterrupted.items():
        assert torch.equal(resumed["1-D stage 3"][key], value), f"2x2 stage 3 -> 1-D stage 3 on 3 ranks: {key}"
        torch.testing.assert_close(resumed["FSDP2"][key], value, msg=lambda m: f"2x2 stage 3 -> FSDP2: {key}: {m}")
