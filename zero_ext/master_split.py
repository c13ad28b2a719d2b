"""An fp32 master as a bf16 parameter plus an int16 remainder (``ZeroAdamW(param_remainders=True)``), in plain torch.

The kernels do the same arithmetic on each element (``csrc/master_split.h``); this is its reference, and the
conversion the placements use where a serialiser reads or writes the master (state dicts, checkpoints, loads):

    master bits = (param bits << 16) + remainder (sign-extended, mod 2^32)
    param       = (master bits + 0x8000) >> 16 (0xFFFF for a NaN), remainder = the low 16 bits of the master

:func:`split` then :func:`join` gives back every fp32 bit pattern but NaNs (a NaN stays a NaN, its payload is not
kept). The param is the master rounded to nearest with ties away from zero: it differs from torch's round to
nearest even (``master.to(torch.bfloat16)``) only where the low 16 bits are exactly 0x8000 and bit 16 is 0, one
master in 2^17, where it is one bf16 ulp larger in magnitude. No 16-bit remainder of a round-to-nearest-even
param can be exact there: an even bf16 value is the rounding of 2^16 + 1 fp32 values. The master stays exact;
tests/test_master_split.py checks all 2^32 patterns.
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF


def _to_int16(values: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2^16) as the int16 with those bits."""
    return torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``param`` and its int16 ``remainder`` (same shape), as a new tensor."""
    high = param.view(torch.int16).to(torch.int64) & _LOW
    bits = ((high << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(param, remainder)``: the bf16 parameter and int16 remainder that :func:`join` makes ``master`` from."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = torch.where(torch.isnan(master), _LOW, ((bits + 0x8000) >> 16) & _LOW)
    return _to_int16(high).view(torch.bfloat16), _to_int16(bits & _LOW)


__all__ = ["join", "split"]
