"""ZeroMuon's DCP checkpoints across settings, as ZeroAdamW's are tested in test_dcp_settings.py: offload none / cpu /
nvme, 1-D and HSDP meshes (state sharded over every rank, or replicated over the replicas), stages 1-3, saved on 2
ranks and resumed on 3 and back, each resumed run bitwise the uninterrupted one (fp32 parameters and moments, the
gradients of dcp_runs.py, whose means are exact at any world size); and ``moment_dtype=torch.bfloat16`` (the Muon
momentum and the AdamW moments in bf16): saved as canonical fp32 values, loaded into fp32 exactly, and fp32 loaded
into it as it encodes them (round to nearest even)."""

import pytest
import torch
from dcp_runs import (
    BUCKET,
    check_settings_across_world_sizes,
    read_whole,
    save_or_resave,
    setting_kwargs,
)
from distributed import run_on_ranks
from mesh_runs import make_mesh
from muon_reference import MUON, freeze, zero_muon_groups
from tiny_transformer import build

from zero_ext import ZeroMuon

# (offload, mesh shape or None, stage, replicate_state) at 2 ranks and at 3 ranks
AT_2 = [("cpu", None, 3, False), ("none", (2, 1), 2, True), ("nvme", (1, 2), 1, False)]
AT_3 = [("none", (3, 1), 3, False), ("cpu", (1, 3), 2, False), ("none", None, 1, False)]
SAVED_AT, STOP = 2, 4


def _model():
    model = build(torch.float32)
    freeze(model)
    return model


def _optimizer(model, setting, root, rank, tag, **kw):
    extra = setting_kwargs(setting, root, rank, tag)
    if setting[1] is not None:
        extra["mesh"] = make_mesh(setting[1])
    return ZeroMuon(zero_muon_groups(model), **MUON, stage=setting[2], module=model, bucket_size=BUCKET, **extra, **kw)


def _build(setting, root, rank, tag):
    model = _model()
    return model, _optimizer(model, setting, root, rank, tag)


@pytest.mark.slow
def test_zero_muon_offload_meshes_stages_across_world_sizes_bitwise(tmp_path):
    check_settings_across_world_sizes(str(tmp_path), AT_2, AT_3, _build, SAVED_AT, STOP)


def _precision_run(rank, world, root, bf16, source):
    """``source`` None: train and save; else load ``source`` and save again at once (what the setting holds)."""
    model = _model()
    kw = dict(moment_dtype=torch.bfloat16) if bf16 else {}
    opt = _optimizer(model, ("none", None, 2 if source is None else 3, False), root, rank, "p", **kw)
    name = "bf16" if bf16 else "fp32"
    save_or_resave(model, opt, root, name, source, SAVED_AT)
    opt.close()
    return True


@pytest.mark.slow
def test_zero_muon_bf16_momentum_saves_canonical_fp32_and_loads_both_ways(tmp_path):
    root = str(tmp_path)
    run_on_ranks(2, _precision_run, root, True, None)
    run_on_ranks(2, _precision_run, root, False, None)
    run_on_ranks(3, _precision_run, root, False, "bf16")  # bf16 -> fp32: the canonical values exactly
    saved, loaded = read_whole(f"{root}/bf16"), read_whole(f"{root}/bf16-into-fp32")
    assert saved.keys() == loaded.keys()
    moments = [k for k in saved if k.endswith(("momentum_buffer", "exp_avg", "exp_avg_sq"))]
    assert any(k.endswith("momentum_buffer") for k in moments) and any(k.endswith("exp_avg") for k in moments)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == torch.float32, key
            assert torch.equal(value, loaded[key]), f"bf16 -> fp32: {key}"
    for key in moments:  # what bf16 storage holds: values a bf16 represents exactly
        assert torch.equal(saved[key], saved[key].bfloat16().float()), key
    run_on_ranks(3, _precision_run, root, True, "fp32")  # fp32 -> bf16: each moment rounded to nearest even
    fp32, into = read_whole(f"{root}/fp32"), read_whole(f"{root}/fp32-into-bf16")
    for key, value in fp32.items():
        if not isinstance(value, torch.Tensor):
            continue
        expected = value.bfloat16().float() if key in moments else value
        assert torch.equal(into[key], expected), f"fp32 -> bf16: {key}"
