"""param_remainders' bit arithmetic (csrc/master_split.h, zero_ext/master_split.py): the fp32 master as the bf16
parameter plus an int16 remainder, exact for every fp32 pattern but NaNs, and the kernel's remainder mode bitwise
the fp32-master kernel on every SIMD path.

The references here are written independently of both implementations, on numpy uint32 (whose arithmetic wraps):
param = (m + 0x8000) >> 16 (0xFFFF for a NaN), remainder = m & 0xFFFF, master = (param << 16) + sign-extended
remainder; and torch's own round to nearest even (``tensor.to(torch.bfloat16)``) for the parameter the fp32 master
path writes."""

import numpy as np
import pytest
import torch

from zero_ext import master_split, ops

ISAS = ["scalar", "avx2", "avx512"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    ops.cpu_isa("auto")


def _reference_split(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(param bits, remainder bits, is_nan) of uint32 master bits ``m``."""
    nan = (m & 0x7FFFFFFF) > 0x7F800000
    param = np.where(nan, np.uint32(0xFFFF), (m + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16)
    return param, (m & np.uint32(0xFFFF)).astype(np.uint16), nan


def _reference_join(param: np.ndarray, remainder: np.ndarray) -> np.ndarray:
    signed = remainder.view(np.int16).astype(np.int32).view(np.uint32)
    return (param.astype(np.uint32) << np.uint32(16)) + signed


def _rne(m: np.ndarray) -> np.ndarray:
    """torch's fp32 -> bf16 (round to nearest even), as uint16 bits."""
    return torch.from_numpy(m.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _sample() -> np.ndarray:
    """Every bf16 high half with edge low halves (0, +-1, the ties, the ends), and random patterns. All 2^32
    patterns are checked in C++ (csrc/cpu/tests/test_master_split.cpp, ``make ctest``, ~70 s of CPU)."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32)
    rng = np.random.default_rng(0)
    return np.concatenate([(high[:, None] + lows[None, :]).ravel(), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])


def test_reference_split_is_exact_and_rounds_ties_away():
    m = _sample()
    param, remainder, nan = _reference_split(m)
    back = _reference_join(param, remainder)
    assert np.array_equal(back[~nan], m[~nan])
    assert np.all((back[nan] & 0x7FFFFFFF) > 0x7F800000)  # a NaN joins back to a NaN
    tie = ((m & 0x1FFFF) == 0x8000) & ~nan  # low half exactly 0x8000, bit 16 (the bf16 lsb) clear
    rne = _rne(m)
    assert np.array_equal(param[~tie], rne[~tie])
    assert tie.any() and np.array_equal(param[tie], rne[tie] + 1)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_splits_and_joins_as_the_reference(isa):
    """An update that keeps every master (lr 0, zero gradient: p * 1 + (-0 * 0) / eps) gives back every (param,
    remainder) pair of the sample (NaNs: param 0xFFFF), on each SIMD path."""
    ops.cpu_isa(isa)
    param, remainder, nan = _reference_split(_sample())
    p = torch.from_numpy(param.view(np.int16).copy()).view(torch.bfloat16)
    r = torch.from_numpy(remainder.view(np.int16).copy())
    zeros = torch.zeros(p.numel())
    ops.fused_adamw_(p, zeros, zeros.clone(), zeros.clone(), lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, step=1, remainder=r)  # fmt: skip
    p_bits, r_bits = p.view(torch.int16).numpy().view(np.uint16), r.numpy().view(np.uint16)
    assert np.array_equal(p_bits[~nan], param[~nan]) and np.array_equal(r_bits[~nan], remainder[~nan])
    assert np.all(p_bits[nan] == 0xFFFF)


def test_master_split_module_matches_the_reference():
    """zero_ext.master_split (the serialisers' conversion) against the reference."""
    m = _sample()
    param, remainder, nan = _reference_split(m)
    p, r = master_split.split(torch.from_numpy(m.view(np.float32).copy()))
    assert np.array_equal(p.view(torch.int16).numpy().view(np.uint16), param)
    assert np.array_equal(r.numpy().view(np.uint16), remainder)
    joined = master_split.join(p, r).view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal(joined[~nan], m[~nan])
    assert np.array_equal(joined, _reference_join(param, remainder))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)], ids=["plain", "amsgrad_maximize"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 97, 1025, 65536 + 17])
def test_remainder_mode_is_the_fp32_master_update(n, grad_dtype, amsgrad, maximize, isa):
    """Three steps in remainder mode give bitwise the fp32-master kernel's master (joined), moments and, but at
    ties, its param_out; SIMD paths with vector blocks and scalar tails."""
    ops.cpu_isa(isa)
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    master[: n // 8] = master[: n // 8].to(torch.bfloat16).float()  # some masters start with a zero remainder
    param, remainder = master_split.split(master)
    state = [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]
    state += [torch.zeros(n)] if amsgrad else []
    twin = [t.clone() for t in state]
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        kw = dict(HYPER, step=step, maximize=maximize, max_exp_avg_sq=state[2] if amsgrad else None)
        ops.fused_adamw_(master, grad, state[0], state[1], param_out=out, **kw)
        kw["max_exp_avg_sq"] = twin[2] if amsgrad else None
        ops.fused_adamw_(param, grad, twin[0], twin[1], remainder=remainder, **kw)
        assert torch.equal(master_split.join(param, remainder).view(torch.int32), master.view(torch.int32))
        for a, b in zip(state, twin):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        ties = (master.view(torch.int32) & 0x1FFFF) == 0x8000
        same = param.view(torch.int16) == out.view(torch.int16)
        assert bool((same | ties).all())


def test_every_isa_gives_the_same_bits():
    n = 4099
    results = []
    for isa in ISAS:
        ops.cpu_isa(isa)
        gen = torch.Generator().manual_seed(5)
        param, remainder = master_split.split(torch.randn(n, generator=gen))
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        for step in (1, 2):
            grad = torch.randn(n, generator=gen, dtype=torch.float32).to(torch.bfloat16)
            ops.fused_adamw_(param, grad, m, v, remainder=remainder, step=step, **HYPER)
        results.append(torch.cat([param.view(torch.int16).int(), remainder.int(), m.view(torch.int32)]))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_found_inf_changes_no_byte():
    param, remainder = master_split.split(torch.randn(33))
    before = (param.clone(), remainder.clone())
    zeros = torch.zeros(33)
    ops.fused_adamw_(param, zeros, zeros.clone(), zeros.clone(), step=1, remainder=remainder,
                     found_inf=torch.ones(()), **HYPER)  # fmt: skip
    assert torch.equal(param.view(torch.int16), before[0].view(torch.int16)) and torch.equal(remainder, before[1])


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
    param, remainder = master_split.split(torch.randn(n, generator=gen))
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    on_gpu = [t.cuda() for t in (param, remainder, m, v, grad)]
    for step in (1, 2):
        ops.fused_adamw_(param, grad, m, v, remainder=remainder, step=step, **HYPER)
        ops.fused_adamw_(on_gpu[0], on_gpu[4], on_gpu[2], on_gpu[3], remainder=on_gpu[1], step=step, **HYPER)
    for cpu, gpu in zip((param.view(torch.int16), remainder, m, v), on_gpu[:4]):
        assert torch.equal(cpu, gpu.view(cpu.dtype).cpu())
