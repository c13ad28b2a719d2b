"""``ZeroAdamW(moment_dtype=torch.bfloat16)`` and ``moment_dtype=torch.int8``: what does not need a training step.
The option and its refusals, the rule's kinds, the canonical element index (the same for every element at every
world size and bucket size), and state dicts and checkpoints across the setting at other world sizes and offloads,
with consolidation. A state dict or checkpoint holds fp32 moments (bf16 widened exactly, int8 codes dequantized);
loading fp32 moments keeps what the moment dtype can (bf16: rounded to nearest even; int8: quantized per parameter
in 64-element blocks, the block's absmax its scale), so an fp32 checkpoint loads as that at any world size and
offload, and a bf16 or int8 checkpoint loads back into the same moments bitwise (int8: the maps make dequantize ->
quantize the identity). A local state dict (``opt.state_dict()``) holds this rank's shard of its layout: bf16 and
fp32 moments share one layout and cross directly; int8 groups place parameters at multiples of 64 elements (16
otherwise), so int8 state dicts load back into int8 moments and cross to or from the other settings only through a
checkpoint. Training is tests/precision/test_moment_dtype.py."""

from __future__ import annotations

import os
import random

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs
from moment_dtypes import BF16, INT8, MOMENT_DTYPES
from safetensors.torch import load_file
from tiny_transformer import build

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.layout import PARAM_ALIGN, Layout
from zero_ext.update.adamw import MASTER, AdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# ---------------------------------------------------------------- the option
@pytest.mark.parametrize("bad", [torch.float16, torch.float64, torch.uint8, "bfloat16", "int8", None, 2])
def test_refused_unless_fp32_bf16_or_int8(bad):
    with pytest.raises(ValueError, match=r"`moment_dtype` must be torch.float32, torch.bfloat16 or torch.int8"):
        ZeroAdamW(build(torch.bfloat16).parameters(), moment_dtype=bad)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_rule_stores_int8_moments_with_block_scales_and_saves_fp32(param_dtype):
    rule = AdamW(param_dtype, amsgrad=True, moment_dtype=torch.int8)
    codes = [k for k in rule.kinds if k.dtype == torch.int8]
    scales = [k for k in rule.kinds if k.block > 1]
    assert [k.name for k in codes] == list(MOMENTS) and [k.name for k in scales] == [m + "_scale" for m in MOMENTS]
    assert all(k.dtype == torch.float32 and k.block == 64 for k in scales)
    assert all(k.dtype == torch.float32 for k in rule.saved_kinds)  # state dicts, checkpoints: fp32 moments
    assert rule.saved_kind_names == ("master", *MOMENTS)
    assert rule.bytes_per_element() == 4 + 3 * 1.0625 and rule.bytes_per_element(master_copy=False) == 3 * 1.0625
    assert rule.param_align == 64 and AdamW(param_dtype, moment_dtype=torch.bfloat16).param_align == PARAM_ALIGN
    assert "moment_dtype=torch.int8" in rule.describe()
    remainders = AdamW(torch.bfloat16, param_remainders=True, moment_dtype=torch.int8)
    assert remainders.tie_kind == "exp_avg_sq" and remainders.bytes_per_element() == 2 + 2 * 1.0625


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_rule_stores_bf16_moments_and_saves_fp32(param_dtype):
    rule = AdamW(param_dtype, amsgrad=True, moment_dtype=torch.bfloat16)
    assert [k.dtype for k in rule.kinds] == [torch.float32] + [torch.bfloat16] * 3
    assert all(k.dtype == torch.float32 for k in rule.saved_kinds)  # state dicts, checkpoints: fp32 moments
    assert rule.bytes_per_element() == 4 + 3 * 2 and rule.bytes_per_element(master_copy=False) == 6
    assert "moment_dtype=torch.bfloat16" in rule.describe()  # every rank must agree on it
    assert rule.describe() != AdamW(param_dtype, amsgrad=True).describe()
    # the seed is the flat group's (param group, dtype), never the world size or rank
    assert AdamW(param_dtype, moment_dtype=torch.bfloat16, group_index=1).rounding_seed != rule.rounding_seed


# ---------------------------------------------------------------- the canonical index
def _canonical(numels):
    """Each parameter's offset with one rank and one unbounded bucket (reverse order, 16-aligned), computed here
    from the definition, not by zero_ext."""
    out, fill = [0] * len(numels), 0
    for i in reversed(range(len(numels))):
        out[i] = -(-fill // PARAM_ALIGN) * PARAM_ALIGN
        fill = out[i] + numels[i]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_canonical_index_is_the_same_in_every_layout(seed):
    """Every real element's canonical index (the kernel's element_offset of its run plus its place in the run) is
    its offset in the one-rank, one-bucket layout, at world sizes 1-3 and bucket sizes that split parameters into
    fragments or keep every parameter in one bucket."""
    rng = random.Random(seed)
    numels = [rng.choice([1, 7, 16, 33, 97, 300, 1025, 4099]) for _ in range(rng.randint(1, 12))]
    canonical = _canonical(numels)
    for world in (1, 2, 3):
        for bucket_size in (100, 700, 3000, 10**7):
            layout = Layout(numels, world, bucket_size)
            for rank in range(world):
                for piece in layout.owned_pieces(rank):
                    bucket = layout.buckets[piece.bucket]
                    start = layout.canonical_start(bucket, rank) + piece.shard_offset - bucket.shard_offset
                    assert start == canonical[piece.index] + piece.start, (world, bucket_size, rank, piece)
                for bucket in layout.buckets:  # padding too gets an index >= 0 (a uint64 offset)
                    assert layout.canonical_start(bucket, rank) >= 0


# ---------------------------------------------------------------- state dicts and checkpoints across the setting
def _model_and_opt(rank, stage, moment_dtype, offload=None, root=None, tag=""):
    model = build(torch.bfloat16)
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "amsgrad": True},
    ]
    window = (INT8 if moment_dtype == torch.int8 else BF16).window  # (only bf16 or int8 moments go to nvme here)
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=700, module=model, moment_dtype=moment_dtype,
                    **offload_kwargs(offload, root, rank, tag, window))  # fmt: skip
    return model, opt


# The crafted fp32 state of each setting's tests: int8's spans several decades, so that small elements of a block
# quantize coarsely beside its largest; bf16's is plain, most of it values bf16 cannot hold.
DECADES = {"bf16": False, "int8": True}


def _full_value(index: int, kind: str, numel: int, decades: bool) -> torch.Tensor:
    """A parameter's full values of ``kind``: fp32 numbers (second moments >= 0), over several decades or not."""
    g = torch.Generator().manual_seed(100 * index + (MOMENTS.index(kind) if kind in MOMENTS else 9))
    x = torch.randn(numel, generator=g)
    x = (x * torch.exp(2 * torch.randn(numel, generator=g)) if decades else x) * 1e-3
    return x.abs() * 1e-3 if kind != "exp_avg" and kind != MASTER else x


def _set_state(opt, decades: bool) -> None:
    """Give every moment of ``opt`` this rank's slice of :func:`_full_value` through load_state_dict."""
    sd = opt.state_dict()
    numels = [p.numel() for g in opt.param_groups for p in g["params"]]
    for index, entry in sd["state"].items():
        runs = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]
        for kind in MOMENTS:
            if kind in entry:
                full = _full_value(index, kind, numels[index], decades)
                entry[kind] = torch.cat([full[s:e] for s, e in runs])
    opt.load_state_dict(sd)


def _save_crafted(rank, world, path, moment_dtype, decades):
    _, opt = _model_and_opt(rank, 2, moment_dtype)
    _set_state(opt, decades)
    sd = opt.state_dict()
    for entry in sd["state"].values():  # what a state dict holds: fp32 moments, whatever is stored
        assert all(entry[k].dtype == torch.float32 for k in MOMENTS if k in entry)
    checkpoint.save(path, opt)
    opt.close()


def _reload_and_save(rank, world, src, dst, moment_dtype, stage, offload, root):
    _, opt = _model_and_opt(rank, stage, moment_dtype, offload, root, f"{os.path.basename(dst)}-{offload}")
    checkpoint.load(src, opt)
    checkpoint.save(dst, opt)
    opt.close()


def _consolidated(tmp_path, path) -> dict[str, torch.Tensor]:
    out = str(tmp_path / (os.path.basename(path) + "-full"))
    checkpoint.consolidate(path, out)
    return load_file(os.path.join(out, "optimizer.safetensors"))


def _assert_state(got: dict, expected: dict, kept, what: str) -> None:
    """``got`` holds ``expected``'s master and steps bitwise, and its moments as ``kept(kind, value)`` (a
    :meth:`MomentDtype.kept`) keeps them, or bitwise when ``kept`` is None."""
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        kind = name.split("/")[0]
        want = kept(kind, value) if kept is not None and kind in MOMENTS else value
        assert got[name].dtype == torch.float32, f"{what}: {name}: {got[name].dtype}"
        assert torch.equal(got[name], want), f"{what}: {name}: {int((got[name] != want).sum())} differ"


# After fp32 -> the setting at 1 and 3 ranks: each setting's checkpoint goes on, (from, to, moment dtype, world,
# stage, what it then holds of the first load: None for bitwise), every load from the setting's nvme checkpoint
# at 3 ranks or from one saved after it.
ONWARD = {
    "bf16": [("bf16-3-nvme", "back-to-fp32", torch.float32, 2, 1, None)],  # bf16 -> fp32: exact
    "int8": [
        ("int8-3-nvme", "int8-again", torch.int8, 2, 3, None),  # int8 -> int8: the same codes and scales
        ("int8-again", "back-to-fp32", torch.float32, 2, 1, None),  # int8 -> fp32: the dequantized values
        ("int8-again", "to-bf16", torch.bfloat16, 2, 2, BF16.kept),  # int8 -> bf16: those rounded to nearest even
    ],
}


@pytest.mark.parametrize("name", list(MOMENT_DTYPES))
def test_checkpoints_cross_the_setting_and_world_sizes(tmp_path, name):
    """An fp32-moment checkpoint (2 ranks) loads into bf16 or int8 moments at 1 and 3 ranks, in memory, host memory
    and on disk, as what they keep of it; saved again it holds fp32 moments, which load on as ``ONWARD`` lists.
    Consolidation writes the fp32 master and moments each time."""
    md = MOMENT_DTYPES[name]
    root = str(tmp_path / "state")
    os.makedirs(root)
    fp32 = str(tmp_path / "fp32")
    run_on_ranks(2, _save_crafted, fp32, torch.float32, DECADES[name])
    original = _consolidated(tmp_path, fp32)
    moments = {k: v for k, v in original.items() if k.split("/")[0] in MOMENTS}
    moved = sum(int((v != md.kept(k.split("/")[0], v)).sum()) for k, v in moments.items())
    assert moved > 1000, moved  # the rounding or quantization is exercised
    loaded = []
    for world, stage, offload in ((1, 1, None), (3, 3, "cpu"), (3, 2, "nvme")):
        path = str(tmp_path / f"{name}-{world}-{offload}")
        run_on_ranks(world, _reload_and_save, fp32, path, md.dtype, stage, offload, root)
        loaded.append(_consolidated(tmp_path, path))
        _assert_state(loaded[-1], original, md.kept, f"fp32 -> {name} at {world} ranks, offload {offload}")
    for src, dst, moment_dtype, world, stage, kept in ONWARD[name]:
        path = str(tmp_path / dst)
        run_on_ranks(world, _reload_and_save, str(tmp_path / src), path, moment_dtype, stage, None, root)
        _assert_state(_consolidated(tmp_path, path), loaded[0], kept, f"{src} -> {dst} at {world} ranks")
    assert not [f for _, _, files in os.walk(root) for f in files], "state files left behind after close()"


def _bf16_state_dicts_cross(rank, world):
    """A state dict of either setting loads into the other (same layout): bf16 -> fp32 exact, fp32 -> bf16 RNE."""
    (_, o32), (_, o16) = _model_and_opt(rank, 2, torch.float32), _model_and_opt(rank, 2, torch.bfloat16)
    _set_state(o32, DECADES["bf16"])
    sd32 = o32.state_dict()
    o16.load_state_dict(sd32)
    sd16 = o16.state_dict()
    o32.load_state_dict(sd16)
    back = o32.state_dict()
    for index, entry in sd32["state"].items():
        for key, value in entry.items():
            if key in MOMENTS:
                assert sd16["state"][index][key].dtype == torch.float32
                assert torch.equal(sd16["state"][index][key], value.to(torch.bfloat16).float()), (index, key)
                assert torch.equal(back["state"][index][key], sd16["state"][index][key]), (index, key)
            elif key == MASTER:
                assert torch.equal(sd16["state"][index][key], value) and torch.equal(back["state"][index][key], value)
    o32.close()
    o16.close()
    return True


def test_bf16_state_dicts_cross_the_setting():
    assert all(run_on_ranks(2, _bf16_state_dicts_cross))


def _int8_state_dicts_cross(rank, world):
    """A local state dict of int8 moments loads back into int8 moments bitwise; between int8 and fp32 moments the
    layouts differ (int8 groups align parameters to 64 elements), so loading one into the other raises on every
    rank, naming zero_ext.checkpoint, and changes nothing."""
    (_, o32), (_, o8) = _model_and_opt(rank, 2, torch.float32), _model_and_opt(rank, 2, torch.int8)
    _set_state(o8, DECADES["int8"])
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


def test_int8_state_dicts_cross_only_through_checkpoints():
    for errors in run_on_ranks(2, _int8_state_dicts_cross):
        assert len(errors) == 2, errors
        assert all("moment_dtype=torch.int8" in e and "zero_ext.checkpoint" in e for e in errors), errors
