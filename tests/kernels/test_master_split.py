"""param_remainders' bit arithmetic (csrc/master_split.h, zero_ext/master_split.py): the fp32 master as the bf16
parameter (rounded to nearest even, as the fp32-master run writes it) plus an int16 remainder and a tie bit kept in
exp_avg_sq's sign bit, exact for every fp32 pattern but NaNs, and the kernel's remainder mode bitwise the fp32-master
kernel (master, moments and parameter) on every SIMD path.

The references here are written independently of both implementations, on numpy uint32 (whose arithmetic wraps):
param = torch's round to nearest even (``tensor.to(torch.bfloat16)``; 0xFFFF for a NaN), d = m - (param << 16),
remainder = d & 0xFFFF, tie = (d == 0x8000), master = (param << 16) + sign-extended remainder + (tie << 16)."""

import numpy as np
import pytest
import torch

from zero_ext import ops
from zero_ext.update import master_split

ISAS = ["scalar", "avx2", "avx512"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    ops.cpu_isa("auto")


def _rne(m: np.ndarray) -> np.ndarray:
    """torch's fp32 -> bf16 (round to nearest even), as uint16 bits."""
    return torch.from_numpy(m.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _reference_split(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(param bits, remainder bits, tie, is_nan) of uint32 master bits ``m``."""
    nan = (m & 0x7FFFFFFF) > 0x7F800000
    param = np.where(nan, np.uint16(0xFFFF), _rne(m))
    d = m - (param.astype(np.uint32) << np.uint32(16))
    return param, (d & np.uint32(0xFFFF)).astype(np.uint16), d == 0x8000, nan


def _reference_join(param: np.ndarray, remainder: np.ndarray, tie: np.ndarray) -> np.ndarray:
    signed = remainder.view(np.int16).astype(np.int32).view(np.uint32)
    return (param.astype(np.uint32) << np.uint32(16)) + signed + (tie.astype(np.uint32) << np.uint32(16))


def _sample() -> np.ndarray:
    """Every bf16 high half with edge low halves (0, +-1, the ties, the ends), and random patterns. All 2^32
    patterns are checked in C++ (csrc/cpu/tests/test_master_split.cpp, ``make ctest``, ~70 s of CPU)."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32)
    rng = np.random.default_rng(0)
    return np.concatenate([(high[:, None] + lows[None, :]).ravel(), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])


def _bits16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def test_reference_split_is_exact_and_the_param_rounds_to_nearest_even():
    m = _sample()
    param, remainder, tie, nan = _reference_split(m)
    back = _reference_join(param, remainder, tie)
    assert np.array_equal(back[~nan], m[~nan])
    assert np.all((back[nan] & 0x7FFFFFFF) > 0x7F800000)  # a NaN joins back to a NaN
    # the tie bit is set exactly on the ties that rounding to even took down (low half 0x8000, bf16 lsb clear)
    assert np.array_equal(tie[~nan], ((m & 0x1FFFF) == 0x8000)[~nan]) and tie.any()
    # without the tie bit the two ends of an even param's range share a remainder: 16 bits are not enough
    assert not np.array_equal(_reference_join(param, remainder, np.zeros_like(tie))[~nan], m[~nan])


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_splits_and_joins_as_the_reference(isa):
    """An update that keeps every master (lr 0, zero gradient: p * 1 + (-0 * 0) / eps) gives back every (param,
    remainder, tie) triple of the sample, the tie in exp_avg_sq's sign bit (NaNs: param 0xFFFF), on each path."""
    ops.cpu_isa(isa)
    param, remainder, tie, nan = _reference_split(_sample())
    p = torch.from_numpy(param.view(np.int16).copy()).view(torch.bfloat16)
    r = torch.from_numpy(remainder.view(np.int16).copy())
    v = master_split.with_tie(torch.zeros(p.numel()), torch.from_numpy(tie))
    zeros = torch.zeros(p.numel())
    ops.fused_adamw_(p, zeros, zeros.clone(), v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, step=1, remainder=r)  # fmt: skip
    p_bits, r_bits = _bits16(p), r.numpy().view(np.uint16)
    assert np.array_equal(p_bits[~nan], param[~nan]) and np.array_equal(r_bits[~nan], remainder[~nan])
    assert np.array_equal(master_split.tie_of(v).numpy()[~nan], tie[~nan])
    assert not master_split.without_tie(v).any()
    assert np.all(p_bits[nan] == 0xFFFF)


def test_master_split_module_matches_the_reference():
    """zero_ext.update.master_split (the serialisers' conversion) against the reference."""
    m = _sample()
    param, remainder, tie, nan = _reference_split(m)
    p, r, t = master_split.split(torch.from_numpy(m.view(np.float32).copy()))
    assert np.array_equal(_bits16(p), param)
    assert np.array_equal(r.numpy().view(np.uint16), remainder)
    assert np.array_equal(t.numpy(), tie)
    joined = master_split.join(p, r, t).view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal(joined[~nan], m[~nan])
    assert np.array_equal(joined, _reference_join(param, remainder, tie))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_tie_lives_in_the_sign_bit(dtype):
    int_view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int8: torch.int8}[dtype]
    if dtype == torch.int8:
        values = torch.tensor([0, 1, 3, 127, 64, 5, 2, 0], dtype=torch.int8)
    else:  # a positive NaN: torch's fp32 -> bf16 gives the negative 0xFFFF
        values = torch.tensor([0.0, 1.0, 3.0, 0.5, float("nan"), float("inf"), 2.0, 0.0]).to(dtype)
        values = values.view(int_view).bitwise_and(torch.iinfo(int_view).max).view(dtype)
    tie = torch.tensor([True, False, True, True, False, True, False, False])
    stored = master_split.with_tie(values, tie)
    assert stored.dtype == dtype
    assert torch.equal(master_split.tie_of(stored), tie)
    assert torch.equal(master_split.without_tie(stored).view(int_view), values.view(int_view))
    # a negative NaN's sign bit is replaced, not or-ed in
    if dtype != torch.int8:
        negative_nan = -torch.full((2,), float("nan"), dtype=dtype)
        assert torch.equal(master_split.tie_of(master_split.with_tie(negative_nan, tie[:2])), tie[:2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)], ids=["plain", "amsgrad_maximize"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 97, 1025, 65536 + 17])
def test_remainder_mode_is_the_fp32_master_update(n, grad_dtype, amsgrad, maximize, isa):
    """Three steps in remainder mode give bitwise the fp32-master kernel's master (joined with the tie bit),
    moments (exp_avg_sq without the tie bit) and param_out; SIMD paths with vector blocks and scalar tails. The
    masters start with many ties (low half 0x8000, both parities of the bf16 lsb)."""
    ops.cpu_isa(isa)
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    master[: n // 8] = master[: n // 8].to(torch.bfloat16).float()  # some masters start with a zero remainder
    ties = master[n // 8 : n // 4].view(torch.int32)
    ties.copy_((ties & ~0xFFFF) | 0x8000)  # and some are ties
    param, remainder, tie = master_split.split(master)
    assert n < 16 or tie.any()  # the first step reads tie bits
    state = [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]
    state += [torch.zeros(n)] if amsgrad else []
    twin = [state[0].clone(), master_split.with_tie(state[1], tie)] + [t.clone() for t in state[2:]]
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        kw = dict(HYPER, step=step, maximize=maximize, max_exp_avg_sq=state[2] if amsgrad else None)
        ops.fused_adamw_(master, grad, state[0], state[1], param_out=out, **kw)
        kw["max_exp_avg_sq"] = twin[2] if amsgrad else None
        ops.fused_adamw_(param, grad, twin[0], twin[1], remainder=remainder, **kw)
        joined = master_split.join(param, remainder, master_split.tie_of(twin[1]))
        assert torch.equal(joined.view(torch.int32), master.view(torch.int32))
        assert torch.equal(param.view(torch.int16), out.view(torch.int16))
        values = [twin[0], master_split.without_tie(twin[1])] + twin[2:]
        for a, b in zip(state, values):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_every_isa_gives_the_same_bits():
    n = 4099
    results = []
    for isa in ISAS:
        ops.cpu_isa(isa)
        gen = torch.Generator().manual_seed(5)
        master = torch.randn(n, generator=gen)
        master.view(torch.int32)[::3] = (master.view(torch.int32)[::3] & ~0xFFFF) | 0x8000
        param, remainder, tie = master_split.split(master)
        m, v = torch.randn(n, generator=gen) * 0.1, master_split.with_tie(torch.rand(n, generator=gen) * 0.01, tie)
        for step in (1, 2):
            grad = torch.randn(n, generator=gen, dtype=torch.float32).to(torch.bfloat16)
            ops.fused_adamw_(param, grad, m, v, remainder=remainder, step=step, **HYPER)
        results.append(
            torch.cat([param.view(torch.int16).int(), remainder.int(), m.view(torch.int32), v.view(torch.int32)])
        )
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_found_inf_changes_no_byte(moment_dtype):
    param, remainder, tie = master_split.split(torch.randn(33))
    m = torch.randn(33).to(moment_dtype)
    v = master_split.with_tie(torch.rand(33).to(moment_dtype), tie)
    before = [t.clone() for t in (param, remainder, m, v)]
    ops.fused_adamw_(param, torch.ones(33), m, v, step=1, remainder=remainder,
                     found_inf=torch.ones(()), **HYPER)  # fmt: skip
    for a, b in zip((param, remainder, m, v), before):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "case,match",
    [
        ("fp32_master", "with `remainder`, `master` must be the bfloat16 parameter"),
        ("fp16_master", "with `remainder`, `master` must be the bfloat16 parameter"),
        ("int32_remainder", "`remainder` must be int16"),
        ("param_out", "`param_out` must be None with `remainder`"),
        ("short_remainder", "`remainder` must have the same number of elements"),
        ("overlap", "overlap in memory"),
    ],
)
def test_bad_arguments_are_refused_before_any_write(case, match):
    n = 16
    master = {"fp32_master": torch.zeros(n), "fp16_master": torch.zeros(n, dtype=torch.float16)}.get(
        case, torch.zeros(n, dtype=torch.bfloat16)
    )
    remainder = torch.ones(n, dtype=torch.int32 if case == "int32_remainder" else torch.int16)
    if case == "short_remainder":
        remainder = remainder[:-1]
    kwargs = dict(param_out=torch.zeros(n, dtype=torch.bfloat16)) if case == "param_out" else {}
    m, v = torch.zeros(n), torch.zeros(n)
    if case == "overlap":
        remainder = master.view(torch.int16)
    before = master.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.fused_adamw_(master, torch.ones(n), m, v, step=1, remainder=remainder, **kwargs, **HYPER)
    assert torch.equal(master, before) and not m.any() and not v.any()


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7, 1025, 65536 + 17])
def test_cuda_remainder_mode_matches_cpu(n):
    """The CUDA kernel's remainder mode (vector path and scalar tail): the CPU kernel's bits (its coefficients
    agree with the CPU's unless a double lies within ~1e-16 of a float rounding boundary: none here)."""
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    master.view(torch.int32)[::3] = (master.view(torch.int32)[::3] & ~0xFFFF) | 0x8000  # ties
    param, remainder, tie = master_split.split(master)
    m, v = torch.randn(n, generator=gen) * 0.1, master_split.with_tie(torch.rand(n, generator=gen) * 0.01, tie)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    on_gpu = [t.cuda() for t in (param, remainder, m, v, grad)]
    for step in (1, 2):
        ops.fused_adamw_(param, grad, m, v, remainder=remainder, step=step, **HYPER)
        ops.fused_adamw_(on_gpu[0], on_gpu[4], on_gpu[2], on_gpu[3], remainder=on_gpu[1], step=step, **HYPER)
    for cpu, gpu in zip((param.view(torch.int16), remainder, m, v), on_gpu[:4]):
        assert torch.equal(cpu, gpu.view(cpu.dtype).cpu())
