"""ZeroMuon <-> torch.optim.Muon (+ torch.optim.AdamW for the non-Muon group) through DCP: ZeroMuon's dicts have the
layout torch's get_state_dict gives for the two torch optimizers (Muon's ``momentum_buffer`` without a step, AdamW's
``step`` / ``exp_avg`` / ``exp_avg_sq``, the param groups of both in order); ZeroMuon at stage 2 on 2 ranks -> torch on
1 rank and torch -> ZeroMuon at stages 1 and 3 on 3 ranks continue the uninterrupted run (at torch's default fp32
tolerance: ZeroMuon's AdamW part rounds as zero_ext's kernel does), ZeroMuon -> ZeroMuon bitwise."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_runs import BUCKET, grad_for, zero_full, zero_load, zero_save
from distributed import run_on_ranks
from muon_reference import ADAM, MUON, MUON_LR_1, freeze, group_names, zero_muon_groups
from tiny_transformer import build
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import zero_ext.checkpoint as zc
from zero_ext import ZeroMuon

SAVED_AT, STOP = 2, 4


def _model():
    model = build(torch.float32)
    freeze(model)
    return model


def _steps(model, opts, start, stop):
    for step in range(start, stop):
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.grad = grad_for(name, p.shape, step)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _zero(model, stage):
    return ZeroMuon(zero_muon_groups(model), **MUON, stage=stage, module=model, bucket_size=BUCKET)


def _torch(model):
    params = dict(model.named_parameters())
    m0, m1, adam = group_names(model)
    given = lambda names: [params[n] for n in names]  # noqa: E731  (frozen ones too, as ZeroMuon is given them)
    muon = torch.optim.Muon([{"params": given(m0)}, {"params": given(m1), "lr": MUON_LR_1}], **MUON)
    return muon, torch.optim.AdamW(given(adam), **ADAM)


def _full(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_saves(rank, world, root):
    model = _model()
    opt = _zero(model, 2)
    _steps(model, [opt], 0, SAVED_AT)
    zero_save(model, opt, f"{root}/zero")
    _steps(model, [opt], SAVED_AT, STOP)
    return zero_full(model, opt)


def _torch_side(rank, world, root):
    """One rank: the layout against ZeroMuon's, zero_ext's checkpoint resumed by torch, and torch's own run."""
    model, zmodel = _model(), _model()
    opts = _torch(model)
    _steps(model, opts, 0, 1)
    tm, to = get_state_dict(model, opts)
    zopt = _zero(zmodel, 1)
    _steps(zmodel, [zopt], 0, 1)
    zm, zo = zc.get_state_dict(zmodel, zopt)
    assert list(zm) == list(tm) and list(zo["state"]) == list(to["state"])
    for fqn, entry in zo["state"].items():
        assert sorted(entry) == sorted(to["state"][fqn]), fqn
    assert [g["params"] for g in zo["param_groups"]] == [g["params"] for g in to["param_groups"]]
    out = {}
    model = _model()
    opts = _torch(model)
    msd, osd = get_state_dict(model, opts)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{root}/zero")
    set_state_dict(model, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _steps(model, opts, SAVED_AT, STOP)
    out["zero->torch"] = _full(model)
    model = _model()
    opts = _torch(model)
    _steps(model, opts, 0, SAVED_AT)
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/torch")
    _steps(model, opts, SAVED_AT, STOP)
    out["torch"] = _full(model)
    return out


def _zero_resumes(rank, world, root):
    out = {}
    for source in ("zero", "torch"):
        for stage in (1, 3):
            model = _model()
            opt = _zero(model, stage)
            zero_load(model, opt, f"{root}/{source}")
            _steps(model, [opt], SAVED_AT, STOP)
            out[(source, stage)] = zero_full(model, opt)
    return out


@pytest.mark.slow
def test_zero_muon_and_torch_muon_both_ways(tmp_path):
    root = str(tmp_path)
    zero_run = run_on_ranks(2, _zero_saves, root)[0]
    torch_side = run_on_ranks(1, _torch_side, root)[0]
    for key, value in zero_run.items():
        torch.testing.assert_close(torch_side["zero->torch"][key], value, msg=lambda m: f"zero -> torch {key}: {m}")
    for (source, stage), params in run_on_ranks(3, _zero_resumes, root)[0].items():
        for key, value in params.items():
            if source == "zero":
                assert torch.equal(value, zero_run[key]), f"ZeroMuon -> ZeroMuon stage {stage}: {key}"
            else:
                expected = torch_side["torch"][key]
                torch.testing.assert_close(value, expected, msg=lambda m: f"torch -> stage {stage}: {key}: {m}")
