"""Block-quantized 8-bit AdamW moments (``moment_dtype=torch.int8``), in plain torch: the maps and quantize /
dequantize, which the engine uses to save and load int8 moments (the fused step is ``zero_ext.ops.int8``'s kernel;
its plain-torch reference is tests/helpers/int8_reference.py, the maps' C++ header comes from
scripts/gen_int8_maps_header.py).

The maps are the dynamic ("dynamic tree") quantization of Dettmers et al. 2022, *8-bit Optimizers via Block-wise
Quantization*, as bitsandbytes' ``create_dynamic_map`` defines it (torchao's AdamW8bit uses the same maps); the
values are computed here in float64 and rounded to fp32 once. A block of ``block`` consecutive elements keeps one
fp32 scale, its absmax; an element is stored as the index of the map value nearest to ``x / absmax``:

- ``exp_avg``: :data:`EXP_AVG_MAP`, 256 values in [-1, 1], 7 decades (bitsandbytes' signed 8-bit map, with -1 in
  place of its smallest positive value: :func:`with_minus_one`, so that dequantize -> quantize is the identity).
- ``exp_avg_sq``: :data:`EXP_AVG_SQ_MAP`, 128 values in (0, 1], 7 decades, no 0 (``dynamic_map(False, 7, 7,
  zero=False)``): codes 0..127, so bit 7 of every code is free for ``param_remainders``' tie bit (SPEC A). Without
  a 0, a small exp_avg_sq is never decoded as 0 (its update would be m/eps: the "zero point" problem of Li et al.
  2023); an exact 0 decodes to 5.5e-7 * absmax, harmless (its exp_avg is 0 too), and an all-zero block to 0.
- :data:`BLOCK` = 64 elements: a rank's shard slices are multiples of 64 elements, so 64-element blocks aligned to
  the shard never straddle a bucket (or any 64-aligned call) boundary.

The choice, measured on the benchmark GPT's moment trajectories (bench/investigations/int8_moments.md): the
update direction's relative error at block 64 / 128 / 256 / 2048 is 1.13 / 1.21 / 1.41 / 2.01 % (median over the
run) with this map, 1.03 / 1.11 / 1.25 / 1.71 % with an 8-bit map (what bit 7 costs). Both 8-bit unsigned and 7-bit
maps that keep a 0 code turn 0.08-0.95 % of the nonzero exp_avg_sq elements into 0, which puts the worst step's
error at 611-28906 % (the first steps, when exp_avg_sq spans many decades in a block); the maps without 0 stay
under 7.2 %. The simulated 8-bit AdamW's final loss is within 0.2 % of fp32's for every dynamic map and block.

Exactly (the kernels do the same IEEE fp32 operations, so CPU results are bitwise equal):

- ``scale = max |x|`` over the block (NaN if the block holds a NaN); the last block of a tensor may be short.
- ``code = #{t in thresholds(map) : t < y}`` with ``y = x / scale`` (``y = x`` where ``scale == 0``), the
  thresholds being the midpoints of neighbouring map values (float64, rounded to fp32): the nearest value, a tie
  going to the lower one. A NaN ``y`` gets code 0.
- ``value = map[code] * scale``.

Non-finite values: a block holding a NaN gets a NaN scale and dequantizes to NaN everywhere; a block holding an
inf (and no NaN) gets an inf scale and dequantizes to inf/-inf/NaN. One non-finite moment poisons its block, not
just its element (as fp32 moments poison their element): the engine's skip-on-inf keeps such gradients out.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.int8 import BLOCK, num_blocks  # noqa: F401  (part of this module's API: the engine and tests read them here)


def dynamic_map(
    signed: bool, total_bits: int = 8, exponent_bits: Optional[int] = None, zero: bool = True
) -> torch.Tensor:
    """The sorted dynamic quantization map (bitsandbytes' ``create_dynamic_map``) with ``2**total_bits`` values.

    Decade ``i`` (``i = 0 .. exponent_bits-1``) covers ``[10**(i+1-exponent_bits) * 0.1, 10**(i+1-exponent_bits)]``
    with the midpoints of a linear grid of ``2**(i + total_bits - 1 - exponent_bits)`` (signed, each sign) or twice
    that (unsigned) intervals; then 0 and 1. ``exponent_bits`` defaults to ``total_bits - 1``. ``zero=False``
    leaves 0 out (the "zero point" fix of Li et al. 2023 for the second moment: a small nonzero exp_avg_sq coded 0
    would make its update m/eps), which makes room for one more decade: ``dynamic_map(False, 7, 7, zero=False)``
    has the 8-bit unsigned map's 7 decades in 128 values."""
    non_sign_bits = total_bits - 1
    exponent_bits = non_sign_bits if exponent_bits is None else exponent_bits
    data: list[float] = []
    for i in range(exponent_bits):
        items = (
            2 ** (i + non_sign_bits - exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - exponent_bits + 1) + 1
        )
        bounds = torch.linspace(0.1, 1.0, items, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        decade = 10.0 ** (i + 1 - exponent_bits) * means
        data += decade.tolist() + ((-decade).tolist() if signed else [])
    extra = 2 ** (non_sign_bits - exponent_bits) - 1
    if extra > 0:  # bitsandbytes' "additional items": a finer grid of the top decade
        bounds = torch.linspace(0.1, 1.0, extra + 1, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += means.tolist() + ((-means).tolist() if signed else [])
    data += [0.0, 1.0] if zero else [1.0]
    if len(data) != 2**total_bits:
        raise ValueError(f"dynamic_map: {len(data)} values for {total_bits} bits")
    return torch.tensor(sorted(data), dtype=torch.float64).to(torch.float32)


def with_minus_one(qmap: torch.Tensor) -> torch.Tensor:
    """A signed map whose smallest positive value gives way to -1. bitsandbytes' signed map has +1 but not -1, so
    a block whose largest-magnitude element is negative decodes it as -0.993 x absmax, and quantizing the decoded
    block again finds a smaller absmax and moves every code of the block: a checkpoint (which holds the moments
    dequantized) would not load back into the same codes. With -1 a block's absmax element decodes to +-scale
    exactly, so ``quantize(dequantize(codes, scales))`` gives back ``codes, scales`` and a checkpoint resumes
    bitwise (tests/precision/test_moment_dtype.py). The value given up, 5.5e-7, is the smallest positive one:
    positive values below 1.9e-6 x absmax round to 0 or 3.25e-6 instead."""
    smallest = qmap[qmap > 0].min()
    return torch.cat([qmap[qmap != smallest], torch.tensor([-1.0])]).sort().values


EXP_AVG_MAP = with_minus_one(dynamic_map(True, 8))
EXP_AVG_SQ_MAP = dynamic_map(False, 7, 7, zero=False)


def thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """The midpoints of neighbouring values of a sorted map (``len(qmap) - 1`` of them), float64 rounded to fp32."""
    q = qmap.to(torch.float64)
    return ((q[:-1] + q[1:]) / 2.0).to(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (1-D) zero-padded to whole blocks, as (blocks, block)."""
    pad = num_blocks(x.numel(), block) * block - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, block)


def block_absmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-block max |x| (fp32), NaN where the block holds a NaN."""
    a = _blocks(x.reshape(-1).float().abs(), block)
    return torch.where(a.isnan().any(dim=1), float("nan"), a.amax(dim=1))


def encode(x: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Codes (int64 indices into ``qmap``) of 1-D fp32 ``x`` under the given per-block scales."""
    s = scales.repeat_interleave(block)[: x.numel()]
    y = torch.where(s == 0, x, x / s)
    codes = torch.searchsorted(thresholds(qmap), y, right=False)  # #{t < y}
    return torch.where(y.isnan(), 0, codes)


def quantize(
    x: torch.Tensor, block: int = BLOCK, qmap: torch.Tensor = EXP_AVG_MAP
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8, scales fp32)`` of ``x`` (any shape, read flat): one scale per ``block`` elements."""
    flat = x.reshape(-1).float()
    scales = block_absmax(flat, block)
    codes = encode(flat, scales, qmap, block)
    return codes.to(torch.uint8).view(torch.int8), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, qmap: torch.Tensor = EXP_AVG_MAP
) -> torch.Tensor:
    """The fp32 values of int8 ``codes`` (flat) with per-block ``scales``; bit 7 is ignored for a 128-value map."""
    idx = codes.reshape(-1).view(torch.uint8).to(torch.int64) & (len(qmap) - 1)
    return qmap[idx] * scales.repeat_interleave(block)[: idx.numel()]
