"""Writes csrc/fused_adamw_int8_maps.h: the int8 moment maps of zero_ext/update/blockwise_int8.py and their
thresholds as exact hex-float literals (so the C++ and CUDA kernels use these very fp32 values), and the constants
of the kernels' branch-free quantizer, which computes a map value from its code and a code from its value with
arithmetic instead of a table search:

    python scripts/gen_int8_maps_header.py > csrc/fused_adamw_int8_maps.h

tests/kernels/test_blockwise_int8.py checks that the committed header is this script's output, byte for byte;
csrc/cpu/tests/test_int8_quantizer.cpp checks the quantizer against the maps and the threshold search on every fp32
pattern of |y| <= 1 and every NaN.

The ladder. exp_avg_sq's map is V[0..127]: decade d (d = 0..6) is V[2^d - 1 .. 2^(d+1) - 2], the 2^d midpoints of
an even grid of [0.1, 1] x 10^(d-6), and V[127] = 1. exp_avg's map is the same ladder on both sides of 0 (V[j] at
code 128 + j for j >= 1, 0 at 128, -V[j] at 127 - j): bitsandbytes' signed map with -1 for its smallest positive
value (blockwise_int8.with_minus_one). So one ladder serves both maps, and within a decade its values and
thresholds lie on a line:

- value: V[j] = bits(fma(f, SLOPE[s], OFFSET[s])) + delta_j, with f = j + 1 as a float and s = f's exponent & 7
  (the decade); delta_j in 0..3 (2 bits each in LADDER_DELTAS), fitted here against the exact values.
- code: the count of thresholds below a >= 0. The decade d comes from a's exponent and mantissa (a's bits as an
  integer, converted to float, are within 0.09 of 2^23 log2(a): DECADE_LOG maps them to log10(a) + 6.3, whose
  integer part is d or d - 1, and one comparison with the decade's upper boundary threshold decides); then
  J = round(fma(a, SCALE[d], SHIFT[d])) is the nearest threshold inside the decade, its exact value is
  bits((J - SHIFT[d]) * STEP[d]) + delta_J (2 bits each in THRESHOLD_DELTAS), and the count is J - (a <= T_J),
  at most 2^(d+1) - 2. Decade 0 (one value) and 7 (1.0) have no inner threshold: SCALE 0 and STEP inf make J the
  count and T_J a NaN.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from zero_ext.update.blockwise_int8 import EXP_AVG_MAP, EXP_AVG_SQ_MAP, thresholds

DECADES = 7
# Per-decade nudges, in ulps, of the ideal fp32 slope/offset (value line) and step/shift (threshold line) that put
# every delta in 0..3. Found by trying the nearest ulps; cpp_maps_header() checks them.
_VALUE_NUDGES = {1: (-1, 0), 2: (-1, 0), 5: (-1, -1)}
_THRESHOLD_NUDGES = {4: (-1, 0), 5: (-2, 0), 6: (-1, 0)}
# log10(a) + 6 + 0.3: the offset keeps every decade boundary's estimate inside its integer interval with margin.
_LOG_OFFSET = 0.3


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _bits(x) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _float(bits: int) -> np.float32:
    return np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def _nudge(x: float, ulps: int) -> np.float32:
    return _float(_bits(_f32(x)) + ulps)


def _round_f32(q: Fraction) -> np.float32:
    """q rounded to the nearest fp32, ties to even (normal range)."""
    if q == 0:
        return _f32(0.0)
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    e -= Fraction(2) ** e > q
    m = q / Fraction(2) ** (e - 23)
    whole, rest = divmod(m.numerator, m.denominator)
    whole += 2 * rest > m.denominator or (2 * rest == m.denominator and whole % 2 == 1)
    return _f32(sign * math.ldexp(whole, e - 23))


def _fma(a, b, c) -> np.float32:
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _decade(d: int) -> range:
    return range(2**d - 1, 2 ** (d + 1) - 1)


def _ladder() -> np.ndarray:
    """exp_avg_sq's map, after checking that exp_avg's is the same ladder mirrored around 0."""
    v = EXP_AVG_SQ_MAP.numpy()
    m = EXP_AVG_MAP.numpy()
    if not (len(v) == 128 and v[127] == 1.0 and m[128] == 0.0 and (m[129:] == v[1:]).all()
            and (m[:128][::-1] == -v).all()):  # fmt: skip
        raise ValueError("the quantizer needs exp_avg's map to be exp_avg_sq's ladder mirrored around 0")
    return v


def _packed_deltas(deltas: dict[int, int]) -> list[int]:
    """2-bit deltas of indices 0..127 (missing ones 0), 16 per word."""
    if any(not 0 <= x <= 3 for x in deltas.values()):
        raise ValueError(f"deltas outside 0..3: {sorted(set(deltas.values()))}")
    return [sum(deltas.get(16 * w + i, 0) << (2 * i) for i in range(16)) for w in range(8)]


def value_line() -> tuple[list[int], list[int], list[int]]:
    """(SLOPE, OFFSET by f's exponent & 7, LADDER_DELTAS) of V[j] = bits(fma(j + 1, slope, offset)) + delta_j."""
    v = _ladder()
    slope, offset, deltas = [0] * 8, [0] * 8, {}
    for d in range(DECADES + 1):
        slot = (127 + d) & 7
        if d == DECADES:  # V[127] = 1.0 (f = 128)
            slope[slot], offset[slot] = _bits(0.0), _bits(1.0)
            continue
        p = 10.0 ** (d - 6)
        da, db = _VALUE_NUDGES.get(d, (0, 0))
        a, b = _nudge(0.9 * p / 2**d, da), _nudge(p * (0.45 / 2**d - 0.8), db)
        slope[slot], offset[slot] = _bits(a), _bits(b)
        for j in _decade(d):
            deltas[j] = _bits(v[j]) - _bits(_fma(_f32(j + 1), a, b))
    return slope, offset, _packed_deltas(deltas)


def threshold_line() -> dict[str, list[int]]:
    """The count's per-decade constants (by decade 0..7) and THRESHOLD_DELTAS."""
    t = np.concatenate([[np.nan], thresholds(EXP_AVG_SQ_MAP).numpy()])  # t[J]: between V[J - 1] and V[J]
    scale, shift, step, deltas = [0] * 8, [0] * 8, [0] * 8, {}
    inf = _bits(np.float32(np.inf))
    scale[0], shift[0], step[0] = _bits(0.0), _bits(0.0), inf  # J = 0, T = (0 - 0) * inf = NaN
    scale[7], shift[7], step[7] = _bits(0.0), _bits(127.0), inf  # J = 127, T = NaN
    for d in range(1, DECADES):
        p = 10.0 ** (d - 6)
        s = 2**d / (0.9 * p)  # J-units per unit of a
        c = 2**d - 1 - 2**d / 9  # a = 0.1 p (the decade's start) is threshold J = 2^d - 1
        ds, dc = _THRESHOLD_NUDGES.get(d, (0, 0))
        scale[d], shift[d], step[d] = _bits(_f32(s)), _bits(_nudge(c, dc)), _bits(_nudge(1 / s, ds))
        for j in range(2**d, 2 ** (d + 1) - 1):  # the decade's inner thresholds
            approx = _f32(_f32(_f32(j) - _float(shift[d])) * _float(step[d]))
            deltas[j] = _bits(_f32(t[j])) - _bits(approx)
    bound = [_bits(_f32(t[2 ** (e + 1) - 1])) for e in range(DECADES)] + [_bits(2.0)]
    return {"BOUND": bound, "SCALE": scale, "SHIFT": shift, "STEP": step, "DELTAS": _packed_deltas(deltas)}


def decade_log() -> list[int]:
    """(K1, K2): fma(float(bits(a)), K1, K2) ~ log10(a) + 6.3; checks that its integer part at each decade's ends
    is the decade or the one below (the count's correction compares with one boundary only)."""
    k1, k2 = _f32(math.log10(2) / 2**23), _f32(-127 * math.log10(2) + 6 + _LOG_OFFSET)
    t = thresholds(EXP_AVG_SQ_MAP).numpy()

    def estimate(bits: int) -> int:
        return int(max(float(_fma(_f32(np.int32(bits)), k1, k2)), 0.0))

    for e in range(DECADES):
        upper = _bits(_f32(t[2 ** (e + 1) - 2]))  # boundary e: the last value of decade e is <= it
        if not (estimate(upper) <= e and estimate(upper + 1) >= e):
            raise ValueError(f"decade estimate off at boundary {e}")
    if estimate(_bits(1.0) + 1) > DECADES - 1:
        raise ValueError("decade estimate above 6 at 1")
    return [_bits(k1), _bits(k2)]


def near_zero() -> list[int]:
    """exp_avg's thresholds next to 0 that the ladder lacks: its first positive one (V[1] / 2; the ladder's first is
    (V[0] + V[1]) / 2, its BOUND[0]) and the magnitude of its last negative one (V[0] / 2)."""
    t = thresholds(EXP_AVG_MAP).numpy()
    return [_bits(t[128]), _bits(-t[127])]


def _c_array(name: str, values) -> str:
    items = []
    for v in values.tolist():
        mantissa, exponent = float(v).hex().split("p")
        items.append(mantissa.rstrip("0").rstrip(".") + "p" + exponent + "f")
    rows = [", ".join(items[i : i + 4]) for i in range(0, len(items), 4)]
    return f"#define {name} \\\n  {{" + ", \\\n   ".join(rows) + "}\n"


def _c_words(name: str, words: list[int]) -> str:
    items = [f"0x{w:08X}u" for w in words]
    rows = [", ".join(items[i : i + 4]) for i in range(0, len(items), 4)]
    return f"#define {name} \\\n  {{" + ", \\\n   ".join(rows) + "}\n"


def cpp_maps_header() -> str:
    """The text of csrc/fused_adamw_int8_maps.h."""
    slope, offset, value_deltas = value_line()
    line = threshold_line()
    return (
        "// GENERATED by scripts/gen_int8_maps_header.py; do not edit. Regenerate with\n"
        "//   python scripts/gen_int8_maps_header.py > csrc/fused_adamw_int8_maps.h\n"
        "// The int8 moment maps (zero_ext/update/blockwise_int8.py) and the midpoints between neighbouring\n"
        "// values: a code is the number of thresholds below x / scale. Initialiser lists, so the CPU\n"
        "// kernels can make them constexpr arrays and the CUDA kernels __constant__ ones. Then the\n"
        "// branch-free quantizer's constants as fp32 bit patterns (the script's docstring;\n"
        "// fused_adamw_int8_math.h's Int8Quantizer).\n"
        "#pragma once\n// clang-format off\n\n"
        f"#define ZERO_EXT_INT8_EXP_AVG_CODES {len(EXP_AVG_MAP)}\n"
        f"#define ZERO_EXT_INT8_EXP_AVG_SQ_CODES {len(EXP_AVG_SQ_MAP)}\n\n"
        + _c_array("ZERO_EXT_INT8_EXP_AVG_MAP", EXP_AVG_MAP)
        + "\n"
        + _c_array("ZERO_EXT_INT8_EXP_AVG_THRESHOLDS", thresholds(EXP_AVG_MAP))
        + "\n"
        + _c_array("ZERO_EXT_INT8_EXP_AVG_SQ_MAP", EXP_AVG_SQ_MAP)
        + "\n"
        + _c_array("ZERO_EXT_INT8_EXP_AVG_SQ_THRESHOLDS", thresholds(EXP_AVG_SQ_MAP))
        + "\n"
        + _c_words("ZERO_EXT_INT8_LADDER_SLOPE", slope)
        + _c_words("ZERO_EXT_INT8_LADDER_OFFSET", offset)
        + _c_words("ZERO_EXT_INT8_LADDER_DELTAS", value_deltas)
        + _c_words("ZERO_EXT_INT8_DECADE_LOG", decade_log())
        + _c_words("ZERO_EXT_INT8_DECADE_BOUND", line["BOUND"])
        + _c_words("ZERO_EXT_INT8_DECADE_SCALE", line["SCALE"])
        + _c_words("ZERO_EXT_INT8_DECADE_SHIFT", line["SHIFT"])
        + _c_words("ZERO_EXT_INT8_DECADE_STEP", line["STEP"])
        + _c_words("ZERO_EXT_INT8_THRESHOLD_DELTAS", line["DELTAS"])
        + _c_words("ZERO_EXT_INT8_EXP_AVG_NEAR_ZERO", near_zero())
        + "// clang-format on\n"
    )


if __name__ == "__main__":
    print(cpp_maps_header(), end="")
