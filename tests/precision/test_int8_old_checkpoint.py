"""A checkpoint written before the int8 maps became minifloats (bitsandbytes' dynamic maps, zero_ext at f56809a)
still loads, at any world size and stage: checkpoints hold the moments dequantized (fp32), so loading requantizes
them with today's maps.

tests/precision/data/int8_dynamic_maps_checkpoint/ was written by its make_checkpoint.py at that commit (one rank,
stage 2, a bf16 MLP, 3 steps of ZeroAdamW(moment_dtype=torch.int8)); expected.pt holds that optimizer's
state_dict() (the moments dequantized with the old maps, the fp32 master) and the model's parameters."""

import contextlib
import os
from pathlib import Path

import pytest
import torch
from distributed import run_on_ranks

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.update import blockwise_int8 as q8

DATA = Path(__file__).parent / "data" / "int8_dynamic_maps_checkpoint"
KINDS = {"exp_avg": q8.EXP_AVG_MAP, "exp_avg_sq": q8.EXP_AVG_SQ_MAP}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8)).to(torch.bfloat16)


def _requantized(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """What loading makes of a parameter's saved moment: its 64-element blocks (each parameter starts a block)
    quantized with today's map."""
    codes, scales = q8.quantize(values.reshape(-1), q8.BLOCK, qmap)
    return q8.dequantize(codes, scales, q8.BLOCK, qmap)


def test_the_old_file_reads_as_it_was_written(tmp_path):
    """Its fp32 moments come out of the file unchanged (consolidation reads the file alone)."""
    checkpoint.consolidate(DATA / "ckpt", tmp_path)
    saved = checkpoint.adamw_state_dict(tmp_path)["state"]
    expected = torch.load(DATA / "expected.pt")["state"]
    for index, old in expected.items():
        for kind in KINDS:
            assert torch.equal(saved[index][kind].reshape(-1), old[kind].reshape(-1)), (index, kind)


def _load(rank, world, stage, out):
    model = _model()
    with torch.no_grad():  # weights other than the checkpoint's: loading must replace them
        for p in model.parameters():
            p.add_(1.0)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, moment_dtype=torch.int8, module=model)
    assert checkpoint.load(DATA / "ckpt", opt) == {"step": 3}
    expected = torch.load(DATA / "expected.pt")
    with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
        for p, want in zip(model.parameters(), expected["params"]):
            assert torch.equal(p.detach(), want)
    checkpoint.save(os.path.join(out, "again"), opt)  # what it holds now, as fp32 moments again
    model(torch.randn(16, 24, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()  # training goes on from the converted state
    with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
        return all(bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 3), (3, 2)])
def test_loads_requantized_at_any_world_size(tmp_path, world, stage):
    """Loaded at 1-3 ranks and stages 2 / 3: the weights and master exactly the saved ones, each moment its saved
    fp32 values quantized with today's maps (bitwise), and the next step trains."""
    assert all(run_on_ranks(world, _load, stage, str(tmp_path), timeout=120))
    checkpoint.consolidate(tmp_path / "again", tmp_path / "out")
    now = checkpoint.adamw_state_dict(tmp_path / "out")["state"]
    expected = torch.load(DATA / "expected.pt")["state"]
    for index, old in expected.items():
        assert float(now[index]["step"]) == 3.0
        for kind, qmap in KINDS.items():
            got, want = now[index][kind].reshape(-1), _requantized(old[kind], qmap)
            assert torch.equal(got, want), (index, kind)
            # and close to what the old maps held: within half the widest gap of today's maps
            assert bool(((got - old[kind].reshape(-1)).abs() <= old[kind].abs().max() / 8).all()), (index, kind)
