"""``ZeroAdamW(moment_dtype=torch.int8)``: state dicts and checkpoints across the setting and world sizes. A state dict
or checkpoint holds fp32 moments (the codes dequantized); loading quantizes them per parameter in 64-element blocks
(the block's absmax as its scale), so an fp32 checkpoint loads into int8 moments as
``dequantize(quantize(values))`` at any world size and offload, an int8 checkpoint loads back into int8 moments
bitwise (the maps make dequantize -> quantize the identity) and into fp32 moments as its dequantized values.
Consolidation writes fp32 master and moments. A local state dict (``opt.state_dict()``) holds this rank's shard of
its layout, and int8 groups place parameters at multiples of 64 elements (16 otherwise): it loads back into int8
moments, and crosses to or from the other settings only through a checkpoint."""

from __future__ import annotations

import os

import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs
from safetensors.torch import load_file
from tiny_transformer import build

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.update import blockwise_int8 as q8
from zero_ext.update.rule import MASTER

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
WINDOW = 3 * 8 * 4096
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _model_and_opt(rank, stage, moment_dtype, offload=None, root=None, tag=""):
    model = build(torch.bfloat16)
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "amsgrad": True},
    ]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=700, module=model, moment_dtype=moment_dtype,
                    **offload_kwargs(offload, root, rank, tag, WINDOW))  # fmt: skip
    return model, opt


def _full_value(index: int, kind: str, numel: int) -> torch.Tensor:
    """A parameter's full values of ``kind``: fp32 numbers over several decades (second moments >= 0)."""
    g = torch.Generator().manual_seed(100 * index + (MOMENTS.index(kind) if kind in MOMENTS else 9))
    x = torch.randn(numel, generator=g) * torch.exp(2 * torch.randn(numel, generator=g)) * 1e-3
    return x.abs() * 1e-3 if kind != "exp_avg" and kind != MASTER else x


def _set_state(opt) -> None:
    """Give every moment of ``opt`` this rank's slice of :func:`_full_value` through load_state_dict."""
    sd = opt.state_dict()
    numels = [p.numel() for g in opt.param_groups for p in g["params"]]
    for index, entry in sd["state"].items():
        runs = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]
        for kind in MOMENTS:
            if kind in entry:
                full = _full_value(index, kind, numels[index])
                entry[kind] = torch.cat([full[s:e] for s, e in runs])
    opt.load_state_dict(sd)


def _save_crafted(rank, world, path, moment_dtype):
    _, opt = _model_and_opt(rank, 2, moment_dtype)
    _set_state(opt)
    checkpoint.save(path, opt)
    opt.close()


def _reload_and_save(rank, world, src, dst, moment_dtype, stage, offload, root):
    _, opt = _model_and_opt(rank, stage, moment_dtype, offload, root, f"{dst[-12:]}-{offload}")
    checkpoint.load(src, opt)
    checkpoint.save(dst, opt)
    opt.close()


def _consolidated(tmp_path, path) -> dict[str, torch.Tensor]:
    out = str(tmp_path / (os.path.basename(path) + "-full"))
    checkpoint.consolidate(path, out)
    return load_file(os.path.join(out, "optimizer.safetensors"))


def _qdq(name: str, value: torch.Tensor) -> torch.Tensor:
    """What int8 moments keep of a parameter's fp32 ``value``: quantized in 64-element blocks of the parameter."""
    qmap = q8.EXP_AVG_MAP if name.split("/")[0] == "exp_avg" else q8.EXP_AVG_SQ_MAP
    flat = value.reshape(-1)
    codes, scales = q8.quantize(flat, q8.BLOCK, qmap)
    return q8.dequantize(codes, scales, q8.BLOCK, qmap).view(value.shape)


def _assert_state(got: dict, expected: dict, quantized: bool, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        want = _qdq(name, value) if quantized and name.split("/")[0] in MOMENTS else value
        assert got[name].dtype == torch.float32, f"{what}: {name}: {got[name].dtype}"
        assert torch.equal(got[name], want), f"{what}: {name}: {int((got[name] != want).sum())} differ"


def test_checkpoints_cross_the_setting_and_world_sizes(tmp_path):
    root = str(tmp_path / "state")
    os.makedirs(root)
    fp32 = str(tmp_path / "fp32")
    run_on_ranks(2, _save_crafted, fp32, torch.float32)
    original = _consolidated(tmp_path, fp32)
    moved = sum(int((v != _qdq(k, v)).sum()) for k, v in original.items() if k.split("/")[0] in MOMENTS)
    assert moved > 1000, moved  # the quantization is exercised
    loaded = []
    for world, stage, offload in ((1, 1, None), (3, 3, "cpu"), (3, 2, "nvme")):
        path = str(tmp_path / f"int8-{world}-{offload}")
        run_on_ranks(world, _reload_and_save, fp32, path, torch.int8, stage, offload, root)
        loaded.append(_consolidated(tmp_path, path))
        _assert_state(loaded[-1], original, True, f"fp32 -> int8 at {world} ranks, offload {offload}")
    again = str(tmp_path / "int8-again")  # int8 -> int8 at 2 ranks, stage 3: the same codes and scales
    run_on_ranks(2, _reload_and_save, str(tmp_path / "int8-3-nvme"), again, torch.int8, 3, None, root)
    _assert_state(_consolidated(tmp_path, again), loaded[0], False, "int8 -> int8")
    back = str(tmp_path / "back-to-fp32")
    run_on_ranks(2, _reload_and_save, again, back, torch.float32, 1, None, root)
    _assert_state(_consolidated(tmp_path, back), loaded[0], False, "int8 -> fp32")
    bf16 = str(tmp_path / "to-bf16")  # int8 -> bf16 moments: rounded to nearest even from the dequantized values
    run_on_ranks(2, _reload_and_save, again, bf16, torch.bfloat16, 2, None, root)
    got = _consolidated(tmp_path, bf16)
    for name, value in loaded[0].items():
        moment = name.split("/")[0] in MOMENTS
        assert torch.equal(got[name], value.to(torch.bfloat16).float() if moment else value), name
    assert not [f for _, _, files in os.walk(root) for f in files], "state files left behind after close()"


def _state_dicts_cross(rank, world):
    """A local state dict of int8 moments loads back into int8 moments bitwise; between int8 and fp32 moments the
    layouts differ (int8 groups align parameters to 64 elements), so loading one into the other raises on every
    rank, naming zero_ext.checkpoint, and changes nothing."""
    (_, o32), (_, o8) = _model_and_opt(rank, 2, torch.float32), _model_and_opt(rank, 2, torch.int8)
    _set_state(o8)
    sd8 = o8.state_dict()
    o8.load_state_dict(sd8)
    again = o8.state_dict()
    for index, entry in sd8["state"].items():
        for key, value in entry.items():
            if key in MOMENTS or key == MASTER:
                assert value.dtype == torch.float32, (index, key)
                assert torch.equal(again["state"][index][key], value), (index, key)
    errors = []
    for target, source in ((o32, sd8), (o8, o32.state_dict())):
        before = target.state_dict()
        try:
            target.load_state_dict(source)
        except ValueError as e:
            errors.append(str(e))
        after = target.state_dict()
        assert all(torch.equal(before["state"][i][k], v) for i, e in after["state"].items() for k, v in e.items()
                   if isinstance(v, torch.Tensor))  # fmt: skip
    o32.close()
    o8.close()
    return errors


def test_state_dicts_cross_only_through_checkpoints():
    for errors in run_on_ranks(2, _state_dicts_cross):
        assert len(errors) == 2, errors
        assert all("moment_dtype=torch.int8" in e and "zero_ext.checkpoint" in e for e in errors), errors
