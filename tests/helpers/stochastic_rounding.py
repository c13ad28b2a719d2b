"""Stochastic rounding of bf16 moments (``ZeroAdamW(moment_dtype=torch.bfloat16)``), in plain torch.

The kernels (``csrc/stochastic_rounding.h``: the CPU paths and CUDA) compute the same bits; this is their
reference. Element ``i`` of a kernel call has the canonical index ``element_offset + i`` (its index in the layout of
world size 1 with one unbounded bucket, so it is the same at every world size and stage) and 32 random bits
(uint32 arithmetic, wrapping; ``>>`` logical):

    mix(x) = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key    = mix(seed32 ^ mix(step32 ^ 0x9E3779B9))           (once per call; step32 = step mod 2^32)
    h      = mix(mix(key ^ (idx >> 32)) ^ (idx & 0xFFFFFFFF))

exp_avg rounds with ``h & 0xFFFF``, exp_avg_sq and max_exp_avg_sq with ``h >> 16`` (the same bits for both, so a
max that equals exp_avg_sq rounds to the same bf16). :func:`sr_bf16` adds them below bf16's last bit and
truncates: the magnitude rounds up with probability (low 16 bits) / 2^16, so the stored moment is unbiased.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32): by 16-bit halves of ``c``, so no int64 product overflows."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int | float) -> int:
    """One call's key from its ``rounding_seed`` (its low 32 bits) and ``step`` (a whole number >= 1)."""
    step32 = int(step) & _MASK32
    inner = _mix(torch.tensor([step32 ^ 0x9E3779B9], dtype=torch.int64))
    return int(_mix((int(seed) & _MASK32) ^ inner)[0])


def random_bits(seed: int, step: int | float, element_offset: int, numel: int) -> torch.Tensor:
    """The 32 random bits (int64 tensor of values in [0, 2^32)) of elements ``element_offset ...
    element_offset + numel - 1`` of a call with ``rounding_seed=seed`` at ``step``."""
    key = rounding_key(seed, step)
    idx = torch.arange(numel, dtype=torch.int64) + int(element_offset)
    return _mix(_mix(key ^ (idx >> 32)) ^ (idx & _MASK32))


def sr_bf16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with the random 16-bit values ``r`` (int, in [0, 2^16), same shape):
    ``(bits(x) + r) >> 16``; a NaN gives 0xFFFF, an infinity stays one."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    high = torch.where(torch.isnan(x), 0xFFFF, ((bits + r.to(torch.int64)) >> 16) & 0xFFFF)
    return torch.where(high >= 1 << 15, high - (1 << 16), high).to(torch.int16).view(torch.bfloat16)


__all__ = ["random_bits", "rounding_key", "sr_bf16"]
