"""Exact widening to fp32 and round-to-nearest-even fp32 -> bf16/fp16 with integer bit arithmetic,
shared by the Triton kernels.

Why not ``x.to(tl.bfloat16)``: Triton's CPU interpreter truncates on that cast, while compiled Triton
rounds to nearest even. Integer math gives the same bits in both, so what the interpreter tests is what
the GPU runs. The fp16 path uses the same approach (the interpreter's fp16 cast happens to round
correctly, but going through numpy it also warns on overflow); the extra integer ops are free in a
memory-bound kernel. Both match ``torch.Tensor.to`` bit for bit on every non-NaN input, including
subnormal inputs and outputs, overflow to inf and ±inf; NaN stays a quiet NaN with its sign (torch's own
NaN bit pattern differs between its CPU scalar, CPU SIMD and CUDA paths, so only NaN-ness is contractual).
"""

import triton
import triton.language as tl


@triton.jit
def fp32_to_bf16_rne(x):
    """fp32 tensor -> bf16 tensor, rounded to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    # Adding 0x7FFF plus the lsb of the kept half rounds the dropped 16 bits to nearest even; a carry
    # ripples into the exponent (max finite -> inf) exactly as IEEE rounding does.
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return tl.where(is_nan, quiet_nan, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def fp32_to_fp16_rne(x):
    """fp32 tensor -> fp16 tensor, rounded to nearest even (subnormal fp16 results included)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    # Normal fp16 range [2^-14, 65520): rebias the exponent (127 - 15 = 112) and round 13 bits away.
    rebiased = mag - 0x38000000
    normal = (rebiased + (0xFFF + ((rebiased >> 13) & 1))) >> 13
    # Subnormal fp16 results [2^-25, 2^-14): the value in units of 2^-24 is mant * 2^(exp - 126);
    # shift the full 24-bit mantissa right by 126 - exp (14..24) with round-to-nearest-even.
    # The shift is clamped so lanes that take another branch never shift by >= 32.
    exp = (mag >> 23).to(tl.int32)
    shift = tl.minimum(tl.maximum(126 - exp, 14), 24).to(tl.uint32)
    mant = (mag & 0x7FFFFF) | 0x800000
    half_minus_one = (tl.full(mant.shape, 1, tl.uint32) << (shift - 1)) - 1
    subnormal = (mant + half_minus_one + ((mant >> shift) & 1)) >> shift
    # Quiet NaN, top payload bits kept; masked to the 10 mantissa bits so the payload cannot reach the sign bit
    # (fp32 0x7FC00000 -> fp16 0x7E00, as torch gives).
    quiet_nan = 0x7E00 | ((mag >> 13) & 0x3FF)
    h = tl.where(mag >= 0x38800000, normal, subnormal)
    h = tl.where(mag < 0x33000000, 0, h)  # below 2^-25: rounds to zero
    h = tl.where(mag >= 0x477FF000, 0x7C00, h)  # >= 65520 (incl. inf): rounds to inf
    h = tl.where(mag > 0x7F800000, quiet_nan, h)
    return (sign | h).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def to_fp32(x):
    """bf16/fp16/fp32 tensor -> fp32, exactly. bf16 widens by a 16-bit shift because the interpreter's
    bf16 -> fp32 cast flushes bf16 subnormals to zero (compiled Triton does not; the shift is exact in both)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_fp32_rne(x, DTYPE: tl.constexpr):
    """fp32 tensor -> DTYPE (tl.float32, tl.bfloat16 or tl.float16), rounded to nearest even."""
    if DTYPE == tl.bfloat16:
        return fp32_to_bf16_rne(x)
    elif DTYPE == tl.float16:
        return fp32_to_fp16_rne(x)
    else:
        return x
