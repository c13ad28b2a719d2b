"""Block-quantized 8-bit AdamW moments (``moment_dtype=torch.int8``), in plain torch: the maps and quantize /
dequantize, which the engine uses to save and load int8 moments (the fused step is ``zero_ext.ops.int8``'s kernel;
its plain-torch reference is tests/helpers/int8_reference.py, the maps' C++ header comes from
scripts/gen_int8_maps_header.py).

A block of ``block`` consecutive elements keeps one fp32 scale, its absmax; an element is stored as the index of the
map value nearest to ``x / absmax``. The maps are minifloats ending at 1, so that the kernels compute a code by
rounding the float's own bits and a value by shifting the code's bits into place (a few integer operations each way,
no table and no search: the AVX2 step went from 2.4-2.8x the fp32-moment step's time to 1.1-1.3x,
bench/results/precision_kernel_cost_avx2.md):

- ``exp_avg``: :data:`EXP_AVG_MAP`, 256 values: 0 and +-G[1..127], G the fp32 numbers with 3 mantissa bits from
  G[1] = 1.25 * 2^-16 (1.9e-5) to G[127] = 1 (8 values per octave, 6.25-12.5 % apart), and -G[128] = -1.125 for
  code 0 (no ``|y| <= 1`` is coded 0; with it every code has a value and ``x = code - 128`` is sign-magnitude). -1
  and 1 are both values, so a block's absmax element decodes to +-scale exactly and ``quantize(dequantize(codes,
  scales))`` gives back ``codes, scales``: a checkpoint (which holds the moments dequantized) resumes bitwise.
- ``exp_avg_sq``: :data:`EXP_AVG_SQ_MAP`, 128 values H[0..127], the fp32 numbers with 3 mantissa bits from H[0] =
  1.125 * 2^-16 (1.7e-5) to H[127] = 1, no 0: codes 0..127, so bit 7 of every code is free for
  ``param_remainders``' tie bit (SPEC A). Without a 0 a small exp_avg_sq is never decoded as 0 (its update would be
  m/eps: the "zero point" problem of Li et al. 2023); an exact 0 decodes to 1.7e-5 * absmax, harmless (its exp_avg
  is 0 too), and an all-zero block to 0. (2 mantissa bits would give it exp_avg's range under the square root, but
  its coarser steps let exp_avg_sq stall (a slow EMA's per-step change rounds away): the benchmark GPT's loss ran up
  to 1 % below fp32's, against 0.26 % with 3 bits; bench/investigations/int8_exp_avg_sq_e5m2_quality.md.)
- :data:`BLOCK` = 64 elements: a rank's shard slices are multiples of 64 elements, so 64-element blocks aligned to
  the shard never straddle a bucket (or any 64-aligned call) boundary.

Until 2026-11 the maps were bitsandbytes' dynamic ("dynamic tree") maps (Dettmers et al. 2022; torchao's AdamW8bit
uses them), whose codes take a search (or a decade-by-decade approximation) per element: the fused step ran 2.5-2.8x
the fp32-moment step's time on AVX2 with them. The comparison of the two on the benchmark GPT's moment
trajectories is bench/investigations/int8_moments.md; checkpoints hold the moments dequantized (fp32), so one
written with the old maps loads (requantized with these; tests/precision/test_int8_old_checkpoint.py).

Exactly (the kernels do the same IEEE fp32 operations, so CPU results are bitwise equal):

- ``scale = max |x|`` over the block (NaN if the block holds a NaN); the last block of a tensor may be short.
- ``code = #{t in thresholds(map) : t < y}`` with ``y = x * (1 / scale)`` (fp32, the reciprocal rounded once per
  block: one division per block, not per element; ``y = x`` where ``scale == 0``), the
  thresholds being the midpoints of neighbouring map values (exact in fp32): the nearest value, a tie going to the
  lower one. A NaN ``y`` gets code 0.
- ``value = map[code] * scale``.

Non-finite values: a block holding a NaN gets a NaN scale and dequantizes to NaN everywhere; a block holding an
inf (and no NaN) gets an inf scale and dequantizes to inf/-inf/NaN. One non-finite moment poisons its block, not
just its element (as fp32 moments poison their element): the engine's skip-on-inf keeps such gradients out.
"""

from __future__ import annotations

import torch

from ..ops.int8 import BLOCK, num_blocks  # noqa: F401  (part of this module's API: the engine and tests read them here)

# The maps' mantissa widths; G[j] has the fp32 bits (j + bias) << (23 - mantissa bits), the bias putting index 127
# at 1.0 (0x3F800000). The kernels read them from csrc/fused_adamw_int8_maps.h (scripts/gen_int8_maps_header.py).
EXP_AVG_MANTISSA_BITS = 3
EXP_AVG_SQ_MANTISSA_BITS = 3


def minifloat_values(mantissa_bits: int, first: int, count: int) -> torch.Tensor:
    """``count`` consecutive fp32 numbers with ``mantissa_bits`` mantissa bits, ascending, the one at index 127 (from
    ``first``) being 1.0."""
    shift = 23 - mantissa_bits
    bias = (0x3F800000 >> shift) - 127
    bits = torch.arange(first + bias, first + bias + count, dtype=torch.int64) << shift
    return bits.to(torch.int32).view(torch.float32)


def signed_minifloat_map(mantissa_bits: int = EXP_AVG_MANTISSA_BITS) -> torch.Tensor:
    """exp_avg's 256 values: index ``128 + x`` holds ``sign(x) * G[|x|]``, G[0] = 0 (see the module docstring)."""
    g = minifloat_values(mantissa_bits, 1, 128)  # G[1 .. 128]
    return torch.cat([-g.flip(0), torch.zeros(1), g[:-1]])


def unsigned_minifloat_map(mantissa_bits: int = EXP_AVG_SQ_MANTISSA_BITS) -> torch.Tensor:
    """exp_avg_sq's 128 values H[0 .. 127], no 0."""
    return minifloat_values(mantissa_bits, 0, 128)


EXP_AVG_MAP = signed_minifloat_map()
EXP_AVG_SQ_MAP = unsigned_minifloat_map()


def thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """The midpoints of neighbouring values of a sorted map (``len(qmap) - 1`` of them), float64 rounded to fp32
    (exact for these maps: a midpoint has one mantissa bit more than its neighbours)."""
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
    y = x * (1.0 / torch.where(s == 0, 1.0, s))  # fp32: the reciprocal rounded, then the product
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
