"""docs/checkpoints.md's torchtitan-style loop as a newcomer writes it: an app-state ``Stateful`` under one key, saved by
dcp.async_save (zero_ext, stage 3, 2 ranks) and resumed by FSDP2 with torch's own AppState (3 ranks); and the reverse,
FSDP2 (2 ranks) -> zero_ext (3 ranks, through dcp.load and through the strict load_dcp). Each continuation against
the unsharded torch.optim.AdamW run at torch's default fp32 tolerance."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_runs import (
    checkpoint_group,
    fsdp_full,
    fsdp_model,
    fsdp_steps,
    model_for,
    reference_run,
    zero_full,
    zero_optimizer,
    zero_steps,
)
from distributed import run_on_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import zero_ext.checkpoint


class TorchAppState(Stateful):
    """The AppState of torch's DCP recipe (FSDP2 side)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _zero_saves(rank, world, path):
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3)
    zero_steps(model, opt, 0, 2)
    pending = dcp.async_save({"app": zero_ext.checkpoint.AppState(model, opt)}, checkpoint_id=path,
                             process_group=checkpoint_group())  # fmt: skip
    zero_steps(model, opt, 2, 3)  # training goes on while the files are written
    pending.result()


def _fsdp_resumes(rank, world, path):
    model, opt = fsdp_model()
    dcp.load({"app": TorchAppState(model, opt)}, checkpoint_id=path)
    fsdp_steps(model, opt, 2, 4)
    return fsdp_full(model)


def _fsdp_saves(rank, world, path):
    model, opt = fsdp_model()
    fsdp_steps(model, opt, 0, 2)
    dcp.save({"app": TorchAppState(model, opt)}, checkpoint_id=path)


def _zero_resumes(rank, world, path, strict):
    out = {}
    for stage in (1, 3):
        model = model_for(torch.float32)
        opt = zero_optimizer(model, stage)
        if strict:
            zero_ext.checkpoint.load_dcp(path, model, opt, key="app")
        else:
            dcp.load({"app": zero_ext.checkpoint.AppState(model, opt)}, checkpoint_id=path)
        zero_steps(model, opt, 2, 4)
        out[stage] = zero_full(model, opt)
    return out


@pytest.mark.slow
def test_docs_loop_zero_to_fsdp2_and_back(tmp_path):
    reference = reference_run(4)
    run_on_ranks(2, _zero_saves, f"{tmp_path}/zero")
    resumed = run_on_ranks(3, _fsdp_resumes, f"{tmp_path}/zero")[0]
    for key, value in reference.items():
        torch.testing.assert_close(resumed[key], value, msg=lambda m: f"zero_ext -> FSDP2: {key}: {m}")
    run_on_ranks(2, _fsdp_saves, f"{tmp_path}/fsdp")
    for strict in (False, True):
        for stage, params in run_on_ranks(3, _zero_resumes, f"{tmp_path}/fsdp", strict)[0].items():
            for key, value in reference.items():
                torch.testing.assert_close(params[key], value, msg=lambda m: f"FSDP2 -> stage {stage}: {key}: {m}")
