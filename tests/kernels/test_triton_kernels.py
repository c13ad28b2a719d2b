"""Triton kernels (zero_ext.kernels) bit for bit against torch: CPU through TRITON_INTERPRET=1 (conftest),
CUDA compiled on a GPU machine (run those with ``TRITON_INTERPRET=0 pytest -m cuda``)."""

import math
import struct

import pytest
import torch

from zero_ext.kernels import accumulate_, cast_scale
from zero_ext.ops import split_scalar

# The interpreter does fp math in numpy, which warns on inf/nan arithmetic the tests do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 97, 1025]
BIG = 2**20 + 3
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# fp32 values at every rounding edge the kernels handle.
SPECIALS = [
    0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -math.nan,
    f32(0x00000001), f32(0x80000001), f32(0x007FFFFF), f32(0x00018000), f32(0x00008000),  # fp32 subnormals
    f32(0x00800000),  # smallest normal fp32
    f32(0x3F808000), f32(0x3F818000), -f32(0x3F818000),  # halfway between bf16 values, even / odd lsb
    f32(0x3F808001), f32(0x3F807FFF),  # just above / below halfway
    f32(0x7F7FFFFF), -f32(0x7F7FFFFF), f32(0x7F7F8000), f32(0x7F7F7FFF),  # max finite fp32 / bf16 overflow edge
    65504.0, 65519.99, 65520.0, -65520.0, 70000.0,  # fp16 max finite and overflow to inf
    1.0 + 2**-11, 1.0 + 3 * 2**-11,  # halfway between fp16 values, even / odd lsb
    2**-14, 2**-14 - 2**-25, 2**-24, 2**-25, 2**-25 + 2**-40, 3 * 2**-25, 2**-26,  # fp16 subnormal edges
    f32(0x7FC00001), f32(0xFF812345),  # NaNs with payloads (quiet / signalling)
]  # fmt: skip


def fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and bits, except that a NaN only has to be a NaN (torch's NaN bits differ by backend)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.cpu().flatten(), expected.cpu().flatten()
    nan = e.isnan()
    assert torch.equal(a.isnan(), nan), "NaN positions differ"
    ai, ei = a.view(INT_VIEW[a.dtype])[~nan], e.view(INT_VIEW[e.dtype])[~nan]
    bad = (ai != ei).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} elements differ, first at {bad[:5].tolist()}: {a[~nan][bad[:5]]} vs {e[~nan][bad[:5]]}"
    )


def make_input(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Normal values over a wide exponent range (so fp16 over/underflow happens) plus specials sprinkled in."""
    x = torch.randn(n) * torch.exp2(torch.randint(-40, 40, (n,)).float())
    if n:
        specials = torch.tensor(SPECIALS)
        idx = torch.randint(0, n, (min(n, len(SPECIALS)),))
        x[idx] = specials[: idx.numel()]
    return x.to(dtype).to(device)


def scale_arg(value: float, kind: str, device: str):
    return torch.tensor(value, dtype=torch.float32, device=device) if kind == "tensor" else value


def cast_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * torch.tensor(fp32(scale), dtype=torch.float32, device=x.device)).to(dtype)


# ---------------------------------------------------------------------------------------------- cast_scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_cast_scale_matches_torch(in_dtype, out_dtype, n, scale_kind, device):
    x = make_input(n, in_dtype, device)
    x_before = x.clone()
    y = cast_scale(x, scale_arg(0.3, scale_kind, device), out_dtype=out_dtype)
    assert_bitwise(y, cast_ref(x, 0.3, out_dtype))
    assert_bitwise(x, x_before)  # input untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "in_dtype,out_dtype,scale_kind",
    [(torch.float32, torch.bfloat16, "tensor"), (torch.bfloat16, torch.float32, "float")],
)
def test_cast_scale_big(in_dtype, out_dtype, scale_kind, device):
    x = make_input(BIG, in_dtype, device)
    assert_bitwise(
        cast_scale(x, scale_arg(1 / 3, scale_kind, device), out_dtype=out_dtype), cast_ref(x, 1 / 3, out_dtype)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, -1.0, 0.5, 3.0, 0.1, 2.0**-20, 2.0**100, 1e39, 1e-45, math.inf, math.nan])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_cast_scale_special_values(out_dtype, scale, device):
    x = torch.tensor(SPECIALS, dtype=torch.float32, device=device)
    assert_bitwise(cast_scale(x, scale, out_dtype=out_dtype), cast_ref(x, scale, out_dtype))
    assert_bitwise(
        cast_scale(x, scale_arg(fp32(scale), "tensor", device), out_dtype=out_dtype), cast_ref(x, scale, out_dtype)
    )
    if math.isfinite(scale) and abs(scale) < 3e38:  # torch rounds a Python scalar to fp32 the same way
        assert_bitwise(cast_scale(x, scale, out_dtype=out_dtype), (x * scale).to(out_dtype))


def test_rounding_is_rne_not_truncation():
    """The interpreter's plain bf16 cast truncates; these must round (up, to even, or to inf)."""
    x = torch.tensor([f32(0x3F818000), f32(0x3F808001), f32(0x7F7FFFFF), 65520.0, 1.0 + 3 * 2**-11])
    bf = cast_scale(x, out_dtype=torch.bfloat16).view(torch.int16).tolist()
    assert bf[:3] == [0x3F82, 0x3F81, 0x7F80]
    assert cast_scale(x, out_dtype=torch.float16)[3:].tolist() == [math.inf, 1.0 + 4 * 2**-11]


# fp32 NaN bits -> (bf16 bits, fp16 bits) from zero_ext.kernels.rounding: quiet, sign kept, the top payload bits kept.
NAN_BITS = {
    0x7FC00000: (0x7FC0, 0x7E00),  # the default quiet NaN (torch's fp16 NaN: sign clear, not 0xFE00)
    0xFFC00000: (0xFFC0, 0xFE00),  # negative quiet NaN keeps its sign
    0x7FE00000: (0x7FE0, 0x7F00),  # top payload bit kept
    0x7FC02000: (0x7FC0, 0x7E01),  # lowest payload bit fp16 keeps (bf16 drops it)
    0xFFC02000: (0xFFC0, 0xFE01),
    0x7F812345: (0x7FC1, 0x7E09),  # signalling NaN comes out quiet
}


def _nan_input(device: str) -> torch.Tensor:
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in NAN_BITS], dtype=torch.int32)
    return bits.view(torch.float32).to(device)


def _bits16(t: torch.Tensor) -> list:
    return [b & 0xFFFF for b in t.cpu().view(torch.int16).tolist()]


@pytest.mark.parametrize("scale", [1.0, 0.5, "tensor"])
def test_cast_scale_nan_bits(scale):
    """Exact NaN bits, not just isnan (interpreter: fp32 multiplication keeps a NaN's sign and payload)."""
    x = _nan_input("cpu")
    s = torch.tensor(2.0) if scale == "tensor" else scale
    assert _bits16(cast_scale(x, s, out_dtype=torch.bfloat16)) == [bf for bf, _ in NAN_BITS.values()]
    assert _bits16(cast_scale(x, s, out_dtype=torch.float16)) == [h for _, h in NAN_BITS.values()]
    quiet = [b | 0x00400000 for b in NAN_BITS]
    assert [b & 0xFFFFFFFF for b in cast_scale(x, s, out_dtype=torch.float32).view(torch.int32).tolist()] == quiet


@pytest.mark.cuda
def test_cast_scale_nan_bits_cuda():
    """On a GPU the fp32 multiply before the rounding returns the canonical NaN 0x7FFFFFFF for any NaN operand
    (no payload, no sign), which rounds to 0x7FFF in both formats; either that or the input's own mapping."""
    x = _nan_input("cuda")
    for dtype, column in ((torch.bfloat16, 0), (torch.float16, 1)):
        got = _bits16(cast_scale(x, 0.5, out_dtype=dtype))
        for g, expected in zip(got, NAN_BITS.values()):
            assert g in (expected[column], 0x7FFF), (dtype, hex(g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_cast_scale_into_view_at_odd_offset(in_dtype, buf_dtype, device):
    x = make_input(1025, in_dtype, device).view(25, 41)
    buf = torch.full((3000,), -7.0, dtype=buf_dtype, device=device)
    before = buf.clone()
    slot = buf[333 : 333 + x.numel()]
    y = cast_scale(x, scale_arg(0.125, "tensor", device), out=slot)
    assert y is slot
    assert_bitwise(slot, cast_ref(x, 0.125, buf_dtype).flatten())
    assert_bitwise(buf[:333], before[:333])
    assert_bitwise(buf[333 + x.numel() :], before[333 + x.numel() :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_scale_in_place(dtype):
    x = make_input(97, dtype, "cpu")
    expected = cast_ref(x, 0.75, dtype)
    assert cast_scale(x, 0.75, out=x) is x
    assert_bitwise(x, expected)


def test_cast_scale_defaults():
    x = make_input(97, torch.bfloat16, "cpu").view(97, 1)
    y = cast_scale(x)  # out_dtype defaults to x.dtype, shape kept
    assert y.shape == x.shape and y.data_ptr() != x.data_ptr()
    assert_bitwise(y, x)
    out = torch.empty(97, dtype=torch.float16)
    assert_bitwise(cast_scale(x, 2, out=out, out_dtype=torch.float16), cast_ref(x, 2.0, torch.float16).flatten())


def test_cast_scale_errors_leave_everything_untouched():
    x = torch.randn(10)
    buf = torch.full((40,), 5.0)
    out = buf[1:11]
    bad_calls = [
        (TypeError, "`x`", lambda: cast_scale(torch.ones(10, dtype=torch.float64), out=out)),
        (TypeError, "`x`", lambda: cast_scale(torch.ones(10, dtype=torch.int32), out=out)),
        (TypeError, "`x`", lambda: cast_scale([1.0], out=out)),
        (ValueError, "`x`", lambda: cast_scale(torch.randn(10, 2).t(), out=buf[:20])),
        (ValueError, "`out`", lambda: cast_scale(x, out=buf[1:12])),  # numel
        (ValueError, "`out`", lambda: cast_scale(x, out=buf[:20:2])),  # not contiguous
        (TypeError, "`out`", lambda: cast_scale(x, out=torch.zeros(10, dtype=torch.int32))),
        (TypeError, "`out_dtype`", lambda: cast_scale(x, out=out, out_dtype=torch.bfloat16)),
        (TypeError, "`out_dtype`", lambda: cast_scale(x, out_dtype=torch.float64)),
        (ValueError, "`out`", lambda: cast_scale(x, out=torch.empty(10, device="meta"))),
        (ValueError, "`scale`", lambda: cast_scale(x, torch.ones(2), out=out)),
        (TypeError, "`scale`", lambda: cast_scale(x, torch.ones(1, dtype=torch.float64), out=out)),
        (ValueError, "`scale`", lambda: cast_scale(x, torch.ones(1, device="meta"), out=out)),
        (TypeError, "`scale`", lambda: cast_scale(x, "2", out=out)),
        (TypeError, "`scale`", lambda: cast_scale(x, True, out=out)),
        (ValueError, "overlaps", lambda: cast_scale(buf[0:10], out=buf[5:15])),  # partial overlap
        (ValueError, "overlaps", lambda: cast_scale(buf[0:20], out=buf[0:20].view(torch.bfloat16)[:20])),
    ]
    before = buf.clone()
    for exc, words, call in bad_calls:
        with pytest.raises(exc, match=words):
            call()
        assert torch.equal(buf, before)


def test_scale_split_is_the_one_the_cpp_ops_use():
    """The launchers leave the number-or-tensor split of `scale` to zero_ext.ops.split_scalar, which
    fused_adamw_'s wrapper uses too: one rule, one wording."""
    x = torch.randn(4)
    for bad in ("2", None, True, [1.0]):
        with pytest.raises(TypeError) as expected:
            split_scalar("zero_ext.kernels.cast_scale", "scale", bad)
        with pytest.raises(TypeError) as got:
            cast_scale(x, bad)
        assert str(got.value) == str(expected.value)
        with pytest.raises(TypeError) as expected:
            split_scalar("zero_ext.kernels.accumulate_", "scale", bad)
        with pytest.raises(TypeError) as got:
            accumulate_(x, x.clone(), bad)
        assert str(got.value) == str(expected.value)


# --------------------------------------------------------------------------------------------- accumulate_


def acc_ref(acc: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    # The matched torch expression: product rounded to fp32, then the add (two roundings, no FMA).
    return acc.clone().add_(
        x.float().view(acc.shape) * torch.tensor(fp32(scale), dtype=torch.float32, device=acc.device)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_accumulate_matches_torch(x_dtype, n, scale_kind, device):
    acc = make_input(n, torch.float32, device)
    x = make_input(n, x_dtype, device)
    expected = acc_ref(acc, x, 0.3)
    assert accumulate_(acc, x, scale_arg(0.3, scale_kind, device)) is acc
    assert_bitwise(acc, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_big_and_not_fused(device):
    acc = torch.randn(BIG, device=device)
    x = torch.randn(BIG, device=device, dtype=torch.bfloat16)
    scale = 1 / 3
    expected = acc_ref(acc, x, scale)
    # An FMA (one rounding) would differ from the two-rounding reference on many elements: the test can tell.
    fused = (acc.double() + x.double() * fp32(scale)).float()
    assert (fused != expected).sum() > 1000
    accumulate_(acc, x, scale_arg(scale, "tensor", device))
    assert_bitwise(acc, expected)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, -0.5, 2.0**100, 1e-45, math.inf, math.nan])
def test_accumulate_special_values(x_dtype, scale):
    specials = torch.tensor(SPECIALS, dtype=torch.float32)
    acc = specials.repeat(len(SPECIALS))  # every special acc against every special x
    x = specials.repeat_interleave(len(SPECIALS)).to(x_dtype)
    expected = acc_ref(acc, x, scale)
    accumulate_(acc, x, scale)
    assert_bitwise(acc, expected)


def test_accumulate_into_view_and_in_place():
    buf = torch.full((2000,), 9.0)
    before = buf.clone()
    acc = buf[101:1126].view(25, 41)
    x = make_input(1025, torch.float16, "cpu")  # flat: same numel, different shape is fine
    expected = acc_ref(acc, x, 0.25)
    accumulate_(acc, x, 0.25)
    assert_bitwise(acc, expected)
    assert torch.equal(buf[:101], before[:101]) and torch.equal(buf[1126:], before[1126:])
    a = torch.randn(97)
    expected = acc_ref(a, a, 0.5)
    accumulate_(a, a, 0.5)
    assert_bitwise(a, expected)


def test_accumulate_errors_leave_everything_untouched():
    buf = torch.full((40,), 5.0)
    acc = buf[1:11]
    x = torch.randn(10)
    bad_calls = [
        (TypeError, "`acc`", lambda: accumulate_(torch.zeros(10, dtype=torch.bfloat16), x)),
        (TypeError, "`acc`", lambda: accumulate_(torch.zeros(10, dtype=torch.float64), x)),
        (ValueError, "`acc`", lambda: accumulate_(buf[:20:2], x)),
        (TypeError, "`x`", lambda: accumulate_(acc, torch.ones(10, dtype=torch.int64))),
        (ValueError, "`x`", lambda: accumulate_(acc, torch.randn(10, 2).t()[0])),
        (ValueError, "`x`", lambda: accumulate_(acc, torch.randn(11))),
        (ValueError, "`x`", lambda: accumulate_(acc, torch.randn(10, device="meta"))),
        (ValueError, "`scale`", lambda: accumulate_(acc, x, torch.ones(3))),
        (TypeError, "`scale`", lambda: accumulate_(acc, x, torch.ones((), dtype=torch.bfloat16))),
        (TypeError, "`scale`", lambda: accumulate_(acc, x, None)),
        (ValueError, "overlaps", lambda: accumulate_(acc, buf[5:15])),
        (ValueError, "overlaps", lambda: accumulate_(acc, buf[1:6].view(torch.float16))),
    ]
    before = buf.clone()
    for exc, words, call in bad_calls:
        with pytest.raises(exc, match=words):
            call()
        assert torch.equal(buf, before)


# ---------------------------------------------------------------------------------- registered torch ops
# (torch.library.opcheck of each op: tests/kernels/test_ops_opcheck.py)


@pytest.mark.parametrize(
    "device,backend", [("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.cuda)]
)
def test_callable_from_compiled_code(device, backend):
    def step(acc, g, s):
        accumulate_(acc, g, s)
        return cast_scale(acc, s, out_dtype=torch.bfloat16), acc * 2

    torch._dynamo.reset()
    g = make_input(1025, torch.bfloat16, device).nan_to_num()
    s = torch.tensor(0.25, device=device)
    acc = torch.randn(1025, device=device)
    acc_eager = acc.clone()
    y_eager, z_eager = step(acc_eager, g, s)
    y, z = torch.compile(step, backend=backend, fullgraph=False)(acc, g, s)
    # fp32 acc: exact on CPU; Inductor may contract the add into an FMA (see zero_ext.kernels.accumulate).
    torch.testing.assert_close(acc, acc_eager, rtol=0 if device == "cpu" else 1.2e-7, atol=0)
    torch.testing.assert_close(z, z_eager, rtol=0 if device == "cpu" else 1.2e-7, atol=0)
    assert_bitwise(y, cast_ref(acc, 0.25, torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.slow
def test_past_2_to_31_elements_and_at_odd_offsets():
    """64-bit offsets: elements beyond 2**31 are written and read, at an odd offset into a larger buffer (about
    13 GB of GPU memory)."""
    n = 2**31 + 5
    idx = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, n - 1], device="cuda")
    x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    x[idx] = torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0, 6.0], dtype=torch.bfloat16, device="cuda")
    buf = torch.full((n + 3,), -1.0, device="cuda")
    out = buf[3:]  # an odd element offset: 12 bytes, not 16-aligned
    cast_scale(x, 0.5, out=out)
    assert buf[:3].eq(-1.0).all()
    assert torch.equal(out[idx].cpu(), torch.tensor([0.5, -1.0, 1.5, 2.0, -2.5, 3.0]))
    del buf, out
    acc = torch.ones(n, device="cuda")
    accumulate_(acc, x, 2.0)
    assert torch.equal(acc[idx].cpu(), torch.tensor([3.0, -3.0, 7.0, 9.0, -9.0, 13.0]))
    assert acc[2**31 + 2].item() == 1.0
