"""fused_adamw_ with bf16 moments (stochastic rounding) and with param_remainders' tie bit, against a plain-torch
reference of the same arithmetic, bitwise, on every CPU path (scalar, AVX2, AVX-512), odd sizes included.

The reference (``reference_step``) follows adamw_math.h operation by operation in fp32 torch ops. Its fused
multiply-adds are computed exactly without relying on ATen's contraction choices: the product of two floats is exact
in double, the sum is rounded to odd in double (TwoSum gives its error) and then to float, which is a correctly
rounded fma (53 >= 2 * 24 + 2 bits); sqrt in double then rounded to float is correctly rounded for the same reason.
Moments are stored through tests/helpers/stochastic_rounding.py (bf16) and the master through
zero_ext.update.master_split (remainders)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import stochastic_rounding
import torch

from zero_ext import ops
from zero_ext.update import master_split

ISAS = ["scalar", "avx2", "avx512"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SEED = 0x5EED1234ABCD  # more than 32 bits: the kernel keys on the low 32


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    ops.cpu_isa("auto")


def _f32(x: float) -> float:
    return float(np.float32(x))


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) rounded once: a*b exact in double, the sum rounded to odd in double, then to float."""
    ab = a.double() * b.double()
    c = c.double().expand_as(ab)
    s = ab + c
    bb = s - ab
    err = (ab - (s - bb)) + (c - bb)  # TwoSum: s + err == ab + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def _coefficients(lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0, maximize=False) -> dict:
    """adamw_coefficients (adamw_math.h): double precision, rounded to float once."""
    return dict(
        decay=_f32(1.0 - lr * weight_decay),
        lerp_weight=_f32(1.0 - beta1),
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1.0 - beta2),
        neg_step_size=_f32(-(lr / (1.0 - beta1**step))),
        bc2_sqrt=_f32(math.sqrt(1.0 - beta2**step)),
        eps=_f32(eps),
        grad_scale=_f32(-grad_scale if maximize else grad_scale),
    )


def _update(p, g, m, v, v_max, c):
    """adamw_update (adamw_math.h) on fp32 tensors; v_max None unless amsgrad."""
    g = g * c["grad_scale"]
    p = p * c["decay"]
    w = c["lerp_weight"]
    diff = g - m
    if abs(w) < 0.5:
        m = _fma32(torch.full_like(diff, w), diff, m)
    else:
        m = _fma32(-diff, torch.full_like(diff, _f32(1.0 - w)), g)
    v = _fma32(g * c["one_minus_beta2"], g, v * c["beta2"])
    v_hat = v
    if v_max is not None:
        v_max = torch.where((v_max > v) | torch.isnan(v_max), v_max, v)
        v_hat = v_max
    denom = torch.sqrt(v_hat.double()).float() / c["bc2_sqrt"] + c["eps"]
    p = p + (c["neg_step_size"] * m) / denom
    return p, m, v, v_max


class State:
    """One shard's optimizer state as the kernel stores it: an fp32 master (or a bf16 param + int16 remainder, the
    tie bit in exp_avg_sq's sign bit), moments in `moment_dtype`, an optional max_exp_avg_sq and param_out."""

    def __init__(self, n, moment_dtype, remainders, amsgrad, seed=0, param_out=True):
        gen = torch.Generator().manual_seed(seed)
        master = torch.randn(n, generator=gen)
        bits = master.view(torch.int32)
        bits[::5] = (bits[::5] & ~0xFFFF) | 0x8000  # ties of both parities
        m = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
        v = (torch.rand(n, generator=gen) * 0.01).to(moment_dtype)
        self.remainders = remainders
        if remainders:
            self.param, self.remainder, tie = master_split.split(master)
            self.master = None
            v = master_split.with_tie(v, tie)
        else:
            self.master, self.param, self.remainder = master, None, None
        self.exp_avg, self.exp_avg_sq = m, v
        self.max_exp_avg_sq = (v.float() * 1.5).to(moment_dtype) if amsgrad else None
        if amsgrad and remainders:
            self.max_exp_avg_sq = master_split.without_tie(v).float().mul(1.5).to(moment_dtype)
        self.param_out = torch.empty(n, dtype=torch.bfloat16) if param_out and not remainders else None

    def clone(self):
        other = object.__new__(State)
        other.__dict__ = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return other

    def to(self, device, shift=0):
        """A copy on `device`; shift > 0 puts every tensor at that element offset of its storage (unaligned)."""
        other = self.clone()
        for k, v in other.__dict__.items():
            if isinstance(v, torch.Tensor):
                other.__dict__[k] = torch.empty(v.numel() + shift, dtype=v.dtype, device=device)[shift:].copy_(v)
        return other

    def tensors(self):
        return [t for t in (self.master, self.param, self.remainder, self.exp_avg, self.exp_avg_sq,
                            self.max_exp_avg_sq, self.param_out) if t is not None]  # fmt: skip

    def kernel_step(self, grad, step, seed=SEED, offset=0, maximize=False, found_inf=None, **hyper):
        ops.fused_adamw_(
            self.param if self.remainders else self.master, grad, self.exp_avg, self.exp_avg_sq,
            **dict(HYPER, **hyper), step=step, param_out=self.param_out, max_exp_avg_sq=self.max_exp_avg_sq,
            maximize=maximize, remainder=self.remainder, rounding_seed=seed, element_offset=offset,
            found_inf=found_inf,
        )  # fmt: skip

    def reference_step(self, grad, step, seed=SEED, offset=0, maximize=False, **hyper):
        c = _coefficients(**dict(HYPER, **hyper), step=step, maximize=maximize)
        v_stored = self.exp_avg_sq
        if self.remainders:
            p = master_split.join(self.param, self.remainder, master_split.tie_of(v_stored))
            v_stored = master_split.without_tie(v_stored)
        else:
            p = self.master
        v_max = self.max_exp_avg_sq.float() if self.max_exp_avg_sq is not None else None
        p, m, v, v_max = _update(p, grad.float(), self.exp_avg.float(), v_stored.float(), v_max, c)
        if self.exp_avg.dtype == torch.bfloat16:
            h = stochastic_rounding.random_bits(seed, step, offset, p.numel())
            m, v = stochastic_rounding.sr_bf16(m, h & 0xFFFF), stochastic_rounding.sr_bf16(v, h >> 16)
            v_max = stochastic_rounding.sr_bf16(v_max, h >> 16) if v_max is not None else None
        if self.remainders:
            self.param, self.remainder, tie = master_split.split(p)
            v = master_split.with_tie(v, tie)
        else:
            self.master = p
        self.exp_avg, self.exp_avg_sq = m, v
        if v_max is not None:
            self.max_exp_avg_sq = v_max
        if self.param_out is not None:
            self.param_out = p.to(torch.bfloat16)


def assert_same_state(a: State, b: State) -> None:
    for x, y in zip(a.tensors(), b.tensors()):
        assert x.dtype == y.dtype
        int_view = {4: torch.int32, 2: torch.int16}[x.element_size()]
        same = x.view(int_view) == y.view(int_view)
        assert bool(same.all()), f"{int((~same).sum())} of {x.numel()} elements differ bitwise ({x.dtype})"


def _grads(n, steps, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).mul(2.0 ** -(k % 3)).to(dtype) for k in range(steps)]


MODES = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True), (torch.float32, False)]
MODE_IDS = ["bf16", "bf16_remainders", "fp32_remainders", "fp32"]
FLAGS = [(False, False), (True, False), (True, True)]
FLAG_IDS = ["plain", "amsgrad", "amsgrad_maximize"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("moment_dtype,remainders", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("n", [1, 7, 16, 97, 1025])
def test_kernel_is_the_reference_bitwise(n, moment_dtype, remainders, amsgrad, maximize, isa):
    ops.cpu_isa(isa)
    kernel = State(n, moment_dtype, remainders, amsgrad, seed=n)
    reference = kernel.clone()
    for step, grad in enumerate(_grads(n, 3, torch.bfloat16), start=1):
        kernel.kernel_step(grad, step, offset=12345, maximize=maximize)
        reference.reference_step(grad, step, offset=12345, maximize=maximize)
        assert_same_state(kernel, reference)


def _run_on_each_isa(state: State, grads, offset: int, amsgrad_maximize: bool) -> list[State]:
    results = []
    for isa in ISAS:
        ops.cpu_isa(isa)
        copy = state.clone()
        for step, grad in enumerate(grads, start=1):
            copy.kernel_step(grad, step, offset=offset, maximize=amsgrad_maximize)
        results.append(copy)
    return results


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad_maximize"])
@pytest.mark.parametrize("moment_dtype,remainders", MODES, ids=MODE_IDS)
def test_every_isa_gives_the_same_bits(moment_dtype, remainders, amsgrad):
    """AVX-512 and AVX2 against the scalar path, bitwise: every size 1..100 (vector blocks and every tail length)
    and 100003 (OpenMP chunks), element offsets that cross 2^32 inside a vector, unaligned storage."""
    cases = [(n, offset, 0) for n in range(1, 101) for offset in (0, 2**32 - 37)]
    cases += [(100003, 2**32 - 65536 - 5, 0), (1000, 3, 1)]
    for n, offset, shift in cases:
        state = State(n, moment_dtype, remainders, amsgrad, seed=n).to("cpu", shift)
        grads = _grads(n, 2, torch.bfloat16, seed=n)
        scalar, *simd = _run_on_each_isa(state, grads, offset, amsgrad)
        for other in simd:
            assert_same_state(scalar, other)


@pytest.mark.parametrize("moment_dtype,remainders", MODES[:3], ids=MODE_IDS[:3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_grad_dtypes_and_hyperparameters(moment_dtype, remainders, grad_dtype):
    """fp32 and fp16 gradients, grad_scale, no weight decay, lerp's other branch (beta1 < 0.5)."""
    n = 301
    kernel = State(n, moment_dtype, remainders, amsgrad=False, seed=3)
    reference = kernel.clone()
    hyper = dict(weight_decay=0.0, grad_scale=0.5, beta1=0.25)
    for step, grad in enumerate(_grads(n, 2, grad_dtype), start=1):
        kernel.kernel_step(grad, step, **hyper)
        reference.reference_step(grad, step, **hyper)
        assert_same_state(kernel, reference)


def test_element_offset_crossing_2_pow_32():
    """The index's high word enters the hash: elements on either side of 2^32 round as the reference says."""
    n = 100
    kernel = State(n, torch.bfloat16, remainders=False, amsgrad=True)
    reference = kernel.clone()
    for step, grad in enumerate(_grads(n, 2, torch.float32), start=1):
        kernel.kernel_step(grad, step, offset=2**32 - 50)
        reference.reference_step(grad, step, offset=2**32 - 50)
        assert_same_state(kernel, reference)
    high, low = stochastic_rounding.random_bits(1, 1, 2**32, 1), stochastic_rounding.random_bits(1, 1, 0, 1)
    assert not torch.equal(high, low)


@pytest.mark.parametrize("remainders", [False, True])
def test_a_call_split_at_any_point_rounds_the_same(remainders):
    """Two calls over [0, k) and [k, n) with element_offset o and o + k give the one call's bits: an element's
    rounding depends on its canonical index only (what lets the engine agree across world sizes and stages)."""
    n, k, offset = 1000, 389, 7 * 2**20
    whole = State(n, torch.bfloat16, remainders, amsgrad=True, param_out=False)
    parts = whole.clone()
    grad = _grads(n, 1, torch.bfloat16)[0]
    whole.kernel_step(grad, 4, offset=offset)
    for lo, hi in ((0, k), (k, n)):
        first = parts.param if remainders else parts.master
        rest = [t[lo:hi] for t in (parts.exp_avg, parts.exp_avg_sq)]
        ops.fused_adamw_(first[lo:hi], grad[lo:hi], *rest, **HYPER, step=4, max_exp_avg_sq=parts.max_exp_avg_sq[lo:hi],
                         remainder=parts.remainder[lo:hi] if remainders else None, rounding_seed=SEED,
                         element_offset=offset + lo)  # fmt: skip
    assert_same_state(whole, parts)


def test_seed_and_step_change_the_rounding():
    n = 4096
    results = []
    for seed, step in ((1, 5), (2, 5), (1, 6), (1 + 2**32, 5)):
        state = State(n, torch.bfloat16, remainders=False, amsgrad=False, param_out=False)
        state.kernel_step(_grads(n, 1, torch.float32)[0], step, seed=seed)
        results.append(state.exp_avg.view(torch.int16))
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])
    assert torch.equal(results[0], results[3])  # the seed's low 32 bits only


def test_stochastic_rounding_is_unbiased():
    """Over all 2^16 random values, sr_bf16 averages to x exactly (finite x below bf16's max)."""
    x = torch.tensor([1.0 + 2.0**-20, -3.14159, 1e-30, 6.5e4 + 3.0, 0.0, float("inf")])
    r = torch.arange(1 << 16)
    rounded = stochastic_rounding.sr_bf16(x[:, None].expand(-1, 1 << 16).contiguous(), r[None, :].expand(x.numel(), -1))
    mean = rounded.double().mean(dim=1)
    assert torch.equal(mean[:-1], x[:-1].double()) and mean[-1] == math.inf
    assert stochastic_rounding.sr_bf16(torch.tensor([float("nan")]), torch.tensor([5])).view(torch.int16) == -1


def test_reference_hash_matches_the_formula():
    """random_bits against the spec's formula written with Python ints (independent of the torch arithmetic)."""

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seed, step, offset = -7, 2**32 + 3, 2**32 - 2
    key = mix((seed & 0xFFFFFFFF) ^ mix((step & 0xFFFFFFFF) ^ 0x9E3779B9))
    expected = [mix(mix(key ^ (i >> 32)) ^ (i & 0xFFFFFFFF)) for i in range(offset, offset + 5)]
    assert stochastic_rounding.random_bits(seed, step, offset, 5).tolist() == expected


@pytest.mark.parametrize("remainders", [False, True])
def test_found_inf_changes_no_byte(remainders):
    state = State(33, torch.bfloat16, remainders, amsgrad=True)
    before = state.clone()
    state.kernel_step(torch.ones(33), 1, found_inf=torch.tensor(float("nan")))
    assert_same_state(state, before)


@pytest.mark.parametrize(
    "case,match",
    [
        ("fp16_moments", "`exp_avg` must be float32 or bfloat16"),
        ("mixed_sq", "`exp_avg_sq` must have `exp_avg`'s dtype"),
        ("mixed_max", "`max_exp_avg_sq` \\(amsgrad\\) must have `exp_avg`'s dtype"),
        ("negative_offset", "`element_offset` must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_write(case, match):
    n = 16
    dtype = torch.float16 if case == "fp16_moments" else torch.bfloat16
    master, m = torch.zeros(n), torch.zeros(n, dtype=dtype)
    v = torch.zeros(n, dtype=torch.float32 if case == "mixed_sq" else dtype)
    v_max = torch.zeros(n, dtype=torch.float32 if case == "mixed_max" else dtype)
    offset = -1 if case == "negative_offset" else 0
    with pytest.raises(RuntimeError, match=match):
        ops.fused_adamw_(master, torch.ones(n), m, v, **HYPER, step=1, max_exp_avg_sq=v_max, element_offset=offset)
    assert not master.any() and not m.any() and not v.any() and not v_max.any()


@pytest.mark.cuda
@pytest.mark.parametrize("shift", [0, 1], ids=["vector", "unaligned"])
@pytest.mark.parametrize("amsgrad,maximize", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("moment_dtype,remainders", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("n", [1, 7, 1025, 65536 + 17])
def test_cuda_is_the_reference_bitwise(n, moment_dtype, remainders, amsgrad, maximize, shift):
    """The CUDA kernel (vector path and scalar tail; shift 1 forces the scalar loop) against the same reference:
    bitwise, as the CPU paths (its coefficients agree with the CPU's unless a double lies within ~1e-16 of a float
    rounding boundary: none here), so the stochastic rounding draws the same bits on both devices."""
    reference = State(n, moment_dtype, remainders, amsgrad, seed=n)
    gpu = reference.to("cuda", shift)
    for step, grad in enumerate(_grads(n, 3, torch.bfloat16), start=1):
        gpu.kernel_step(grad.cuda(), step, offset=2**32 - 3, maximize=maximize)
        reference.reference_step(grad, step, offset=2**32 - 3, maximize=maximize)
    assert_same_state(reference, gpu.to("cpu"))


@pytest.mark.cuda
def test_cuda_step_as_a_device_tensor_keys_the_same_rounding():
    """The engine passes the step as a device tensor: the kernel derives the key from it (no host sync)."""
    n = 4099
    reference = State(n, torch.bfloat16, remainders=True, amsgrad=False)
    gpu = reference.to("cuda")
    grad = _grads(n, 1, torch.float32)[0]
    gpu.kernel_step(grad.cuda(), torch.tensor(7.0, device="cuda"), offset=99)
    reference.reference_step(grad, 7, offset=99)
    assert_same_state(reference, gpu.to("cpu"))
