"""``zero_ext.checkpoint.read_extra(path)``: a trainer resuming builds its model from arguments it saved in the
checkpoint, so it reads ``extra`` before anything exists (no model, no optimizer, in a process without a process
group, or on every rank), verified as ``load`` verifies it; then builds, and ``load`` returns the same ``extra``."""

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from engine_reference import params_digest
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.checkpoint import CheckpointError

MODEL_ARGS = {"blocks": 3, "dtype": "bfloat16", "seed": 5}


def _build(model_args):
    return build(getattr(torch, model_args["dtype"]), model_args["seed"], blocks=model_args["blocks"])


def _digest(model, opt):
    with opt.gathered_params():
        return params_digest(model)


def _train_and_save(rank, world, path):
    model = _build(MODEL_ARGS)
    opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=3, module=model, bucket_size=1500)
    for step in range(3):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, opt, extra={"model_args": MODEL_ARGS, "step": 3, "ema": torch.arange(5.0)})
    return _digest(model, opt)


def _resume(rank, world, path):
    extra = checkpoint.read_extra(path)  # before anything is built, on every rank
    model = _build(extra["model_args"])
    opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=1, module=model)
    loaded = checkpoint.load(path, opt)
    assert loaded["model_args"] == extra["model_args"] and loaded["step"] == extra["step"] == 3
    assert torch.equal(loaded["ema"], extra["ema"])
    return _digest(model, opt)


def test_read_extra_before_building_the_model(tmp_path):
    path = str(tmp_path / "ck")
    saved = run_on_ranks(2, _train_and_save, path, timeout=120)
    assert not dist.is_initialized()  # this process has no process group
    extra = checkpoint.read_extra(path)
    assert extra["model_args"] == MODEL_ARGS and extra["step"] == 3
    assert torch.equal(extra["ema"], torch.arange(5.0)) and extra["ema"].device.type == "cpu"
    assert run_on_ranks(3, _resume, path, timeout=120) == [saved[0]] * 3  # at another world size and stage


def _damaged(path: str, name: str) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(-2, os.SEEK_END)
        byte = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x20]))


@pytest.mark.parametrize(
    "damage, match",
    [
        ("extra.json", "extra.json: checksum mismatch"),
        ("extra.safetensors", "extra.safetensors: checksum mismatch"),
        ("meta.json", "meta.json"),
        ("no marker", "no completion marker"),
    ],
)
def test_read_extra_of_a_damaged_checkpoint_raises(tmp_path, damage, match):
    model = build()
    opt = ZeroAdamW(model.named_parameters(), module=model)
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    path = str(tmp_path / "ck")
    checkpoint.save(path, opt, extra={"model_args": MODEL_ARGS, "step": 1, "ema": torch.ones(3)})
    assert checkpoint.read_extra(path)["step"] == 1
    if damage == "no marker":
        os.remove(os.path.join(path, "COMPLETE"))
    else:
        _damaged(path, damage)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.read_extra(path)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(path, opt)  # load refuses it the same way


def test_read_extra_without_extra_is_none(tmp_path):
    model = build()
    opt = ZeroAdamW(model.named_parameters())
    checkpoint.save(tmp_path / "ck", opt)
    assert checkpoint.read_extra(tmp_path / "ck") is None
    with pytest.raises(CheckpointError, match="missing checkpoint directory"):
        checkpoint.read_extra(tmp_path / "nowhere")
