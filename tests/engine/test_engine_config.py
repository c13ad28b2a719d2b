"""The engine's configuration is one frozen object checked once, the stage one object chosen once, and the sharded
state holds the mesh seam (a shard group and a replicate group of one replica)."""

import dataclasses

import pytest
import torch

import zero_ext
from zero_ext.engine.config import EngineConfig
from zero_ext.engine.stages import Stage1, Stage2, Stage3, stage_for

DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False)


def test_config_is_checked_once_and_frozen():
    config = EngineConfig.checked(DEFAULTS, stage=2, staging_buffers=3)
    assert (config.stage, config.staging_buffers, config.offload) == (2, 3, None)
    assert isinstance(config.strategy, Stage2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(stage=4), "`stage` must be 1, 2 or 3"),
        (dict(stage=3), "stage 3 needs the model"),
        (dict(stage=2, staging_buffers=0), "`staging_buffers` must be an int >= 1"),
        (dict(stage=2, offload="tape"), "offload"),
    ],
)
def test_config_names_the_bad_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.checked(DEFAULTS, **options)


def test_defer_all_gather_to_is_the_module_when_only_it_is_given():
    model = torch.nn.Linear(2, 2)
    assert EngineConfig.checked(DEFAULTS, stage=2, defer_all_gather_to=model).module is model


def test_each_stage_is_one_object():
    assert [type(stage_for(n)) for n in (1, 2, 3)] == [Stage1, Stage2, Stage3]
    assert stage_for(1).grad_buffer_dtype(None, torch.bfloat16) == torch.bfloat16
    assert stage_for(1).grad_buffer_dtype(torch.float32, torch.bfloat16) == torch.float32
    assert stage_for(2).grad_buffer_dtype(None, torch.bfloat16) is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_sharded_state_holds_a_one_dimensional_mesh(stage):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = zero_ext.ZeroAdamW(model.parameters(), stage=stage, module=model)
    mesh = opt.sharded_state.mesh
    assert mesh.shard is opt.sharded_state.comm
    assert (mesh.replicate, mesh.replicate_size, mesh.world_size) == (None, 1, 1)
    opt.close()
