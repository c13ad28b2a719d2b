"""An fp32 master as a bf16 parameter, an int16 remainder and a tie bit (``ZeroAdamW(param_remainders=True)``), in
plain torch.

The kernels do the same arithmetic on each element (``csrc/master_split.h``); this is its reference, and the
conversion the placements use where a serialiser reads or writes the master (state dicts, checkpoints, loads). On the
raw bits M of the master:

    param P   = M rounded to nearest even (``master.to(torch.bfloat16)``; a NaN gives 0xFFFF)
    d         = M - (P << 16) (mod 2^32), in [-0x8000, +0x8000] for every non-NaN M
    remainder = the low 16 bits of d, tie = (d == +0x8000)
    M         = (P << 16) + remainder (sign-extended) + (tie << 16) (mod 2^32)

:func:`split` then :func:`join` gives back every fp32 bit pattern but NaNs (a NaN stays a NaN, its payload is not
kept), and the parameter is exactly the fp32-master run's. The 17th bit is needed: an even bf16 value is the
rounding of 2^16 + 1 masters (both ends are ties to even), whose two ends share the remainder 0x8000; tie = 1 is the
upper one (a tie that rounding to even took down). tests/kernels/test_master_split.py and
csrc/cpu/tests/test_master_split.cpp (all 2^32 patterns) check it.

The tie bit is kept in the sign bit of exp_avg_sq's storage (fp32: bit 31, bf16: bit 15, int8 codes: bit 7), free
because exp_avg_sq is >= +0 or NaN: :func:`tie_of`, :func:`without_tie` and :func:`with_tie` read and write it.
Serialisers never show it: reading exp_avg_sq clears it, reading the master joins with it, writing the master sets
it, writing exp_avg_sq keeps the stored one.
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF
# The sign bit of each storage dtype that can hold exp_avg_sq, and the integer view of its bits.
_SIGN = {
    torch.float32: (torch.int32, 1 << 31),
    torch.bfloat16: (torch.int16, 1 << 15),
    torch.int8: (torch.int8, 1 << 7),
}


def _signed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2^bits) (int64) as the two's-complement values with those bits."""
    return torch.where(values >= 1 << (bits - 1), values - (1 << bits), values)


def _master_bits(master: torch.Tensor) -> torch.Tensor:
    return master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def join(param: torch.Tensor, remainder: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``param``, its int16 ``remainder`` and bool ``tie`` (same shape), as a new tensor."""
    high = param.contiguous().view(torch.int16).to(torch.int64) & _LOW
    bits = ((high << 16) + remainder.to(torch.int64) + (tie.to(torch.int64) << 16)) & 0xFFFFFFFF
    return _signed(bits, 32).to(torch.int32).view(torch.float32)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(param, remainder, tie)``: the bf16 parameter (``master.to(torch.bfloat16)``), int16 remainder and bool tie
    that :func:`join` makes the fp32 ``master`` from."""
    bits = _master_bits(master)
    # Round to nearest even on the bits (torch's fp32 -> bf16, NaN -> 0xFFFF as the kernels do: torch's scalar
    # conversion would give 0x7FC0); no carry past bit 31 for a non-NaN pattern.
    high = torch.where(torch.isnan(master), _LOW, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    delta = (bits - (high << 16)) & 0xFFFFFFFF
    param = _signed(high, 16).to(torch.int16).view(torch.bfloat16)
    return param, _signed(delta & _LOW, 16).to(torch.int16), delta == 0x8000


def _sign_of(stored: torch.Tensor) -> tuple[torch.Tensor, int]:
    if stored.dtype not in _SIGN:
        raise TypeError(f"master_split: exp_avg_sq's storage must be float32, bfloat16 or int8, got {stored.dtype}")
    int_dtype, sign = _SIGN[stored.dtype]
    return stored.contiguous().view(int_dtype), sign


def tie_of(stored: torch.Tensor) -> torch.Tensor:
    """The tie bits kept in the sign bits of a stored exp_avg_sq (fp32, bf16 or int8), as a bool tensor."""
    bits, _ = _sign_of(stored)
    return bits < 0


def without_tie(stored: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq's values: ``stored`` with its sign bits cleared (a new tensor, same dtype)."""
    bits, sign = _sign_of(stored)
    return (bits & (sign - 1)).view(stored.dtype)


def with_tie(values: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq as stored: ``values`` (>= +0 or NaN; fp32, bf16 or int8) with ``tie`` in their sign bits (a new
    tensor, same dtype). A sign bit already set in ``values`` (a negative NaN) is replaced by the tie."""
    bits, sign = _sign_of(values)
    cleared = bits & (sign - 1)
    return torch.where(tie, cleared | -sign, cleared).view(values.dtype)  # -sign: the sign bit alone, signed


__all__ = ["join", "split", "tie_of", "with_tie", "without_tie"]
