"""DCP checkpoints of ZeroAdamW across settings: offload none / cpu / nvme, 1-D and HSDP meshes (state sharded over
every rank, or replicated over the replicas: DCP writes a replicated box once), stages, 2 -> 3 ranks and back, each
resumed run bitwise the uninterrupted one (fp32 parameters and moments); and precision settings (bf16 / int8
moments, bf16 parameters with and without param_remainders): saved as their canonical fp32 values, loaded into fp32
exactly, and from fp32 into each setting as that setting encodes it."""

import pytest
import torch
from dcp_runs import (
    check_settings_across_world_sizes,
    model_for,
    read_whole,
    save_or_resave,
    setting_kwargs,
    zero_optimizer,
)
from distributed import run_on_ranks

from zero_ext.update import blockwise_int8 as q8

# (offload, mesh shape or None, stage, replicate_state) at 2 ranks and at 3 ranks
AT_2 = [("none", (2, 1), 2, True), ("cpu", None, 3, False), ("nvme", (1, 2), 1, False), ("cpu", (2, 1), 3, False)]
AT_3 = [("cpu", (3, 1), 3, False), ("nvme", None, 2, False), ("none", (1, 3), 1, False), ("none", (3, 1), 2, True)]
SAVED_AT, STOP = 2, 4


def _build(setting, root, rank, tag):
    model = model_for(torch.float32)
    return model, zero_optimizer(model, setting[2], setting[1], **setting_kwargs(setting, root, rank, tag))


@pytest.mark.slow
def test_offload_meshes_stages_across_world_sizes_bitwise(tmp_path):
    check_settings_across_world_sizes(str(tmp_path), AT_2, AT_3, _build, SAVED_AT, STOP)


PRECISIONS = {
    "fp32": dict(),
    "bf16-moments": dict(moment_dtype=torch.bfloat16),
    "int8-moments": dict(moment_dtype=torch.int8),
    "bf16-remainders": dict(dtype=torch.bfloat16, param_remainders=True),
    "bf16-params": dict(dtype=torch.bfloat16),
}


def _precision_run(rank, world, root, name, source):
    """``source`` None: train and save; else load ``source`` and save again at once (what the setting holds)."""
    kw = dict(PRECISIONS[name])
    model = model_for(kw.pop("dtype", torch.float32))
    opt = zero_optimizer(model, 2 if source is None else 3, **kw)
    save_or_resave(model, opt, root, name, source, SAVED_AT)
    return True


@pytest.mark.slow
def test_precision_settings_save_canonical_fp32_and_load_into_any(tmp_path):
    root = str(tmp_path)
    for name in PRECISIONS:
        run_on_ranks(2, _precision_run, root, name, None)
    for name in PRECISIONS:  # every setting's canonical values carry into fp32 exactly
        if name != "fp32":
            run_on_ranks(3, _precision_run, root, "fp32", name)
            saved, loaded = read_whole(f"{root}/{name}"), read_whole(f"{root}/{name}-into-fp32")
            assert saved.keys() == loaded.keys()
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    # canonical fp32 whatever the setting keeps; the frozen parameter as the model holds it
                    assert value.dtype == torch.float32 or key == "model.blocks.0.ln1.weight", key
                    assert torch.equal(value, loaded[key]), f"{name} -> fp32: {key}"
    fp32 = read_whole(f"{root}/fp32")
    for name in PRECISIONS:  # and fp32 into each setting, as the setting encodes it
        if name == "fp32":
            continue
        run_on_ranks(3, _precision_run, root, name, "fp32")
        loaded = read_whole(f"{root}/fp32-into-{name}")
        for key, value in fp32.items():
            if not isinstance(value, torch.Tensor):
                continue
            got, moment = loaded[key], key.endswith(("exp_avg", "exp_avg_sq"))
            if name == "bf16-moments" and moment:  # stored rounded to nearest even
                assert torch.equal(got, value.bfloat16().float()), key
            elif name == "int8-moments" and moment:  # each parameter's 64-element blocks, quantized with its map
                qmap = q8.EXP_AVG_MAP if key.endswith("exp_avg") else q8.EXP_AVG_SQ_MAP
                expected = q8.dequantize(*q8.quantize(value, qmap=qmap), qmap=qmap).reshape(value.shape)
                assert torch.equal(got, expected), key
            elif name == "bf16-params" and key.startswith("model.") and value.dtype == torch.float32:
                assert torch.equal(got, value), key  # the fp32 master kept beside bf16 parameters
            else:
                assert torch.equal(got, value), f"fp32 -> {name}: {key}"
