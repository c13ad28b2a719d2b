"""amsgrad in zero_ext.ops.int8.fused_adamw_int8_ (``max_exp_avg_sq_codes`` / ``max_exp_avg_sq_scales``: max_exp_avg_sq
quantized as exp_avg_sq is) against its plain-torch reference (tests/helpers/int8_reference.py's
fused_adamw_int8_reference with ``max_codes`` / ``max_scales``): bitwise on every CPU path, odd sizes and block tails,
every param output and param_remainders, maximize, NaN/inf; against torch.optim.AdamW(amsgrad=True) on the dequantized
moments; found_inf, bad input, opcheck.

The random states put the old max above the new exp_avg_sq in some elements and below it in others
(test_both_sides_of_the_max_are_exercised), so a kernel that ignores either side of the max, or divides by
exp_avg_sq instead of the max, fails the bitwise tests."""

import pytest
import torch
from int8_reference import fused_adamw_int8_reference
from test_fused_adamw_int8 import HP, ISAS, OP, State, _bits, _grad, _to, assert_same_state

from zero_ext import ops
from zero_ext.ops.int8 import fused_adamw_int8_
from zero_ext.update import blockwise_int8 as q8
from zero_ext.update import master_split


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    ops.cpu_isa("auto")


class AmsState(State):
    """State plus max_exp_avg_sq's codes and scales: the dequantized exp_avg_sq times a random factor in
    [0.25, 4) (zero: an all-zero max, the state's start)."""

    def __init__(self, n, block, out="none", seed=0, zero=False):
        super().__init__(n, block, out, seed)
        v = q8.dequantize(self.v_codes, self.v_scales, block, q8.EXP_AVG_SQ_MAP)
        factor = 4.0 ** (2 * torch.rand(n, generator=torch.Generator().manual_seed(seed + 50)) - 1)
        self.x_codes, self.x_scales = q8.quantize(v * factor * (0.0 if zero else 1.0), block, q8.EXP_AVG_SQ_MAP)

    def clone(self):
        c = AmsState.__new__(AmsState)
        c.__dict__ = super().clone().__dict__
        return c

    def tensors(self):
        return super().tensors() + [self.x_codes, self.x_scales]

    def step(self, fn, grad, step, **kw):
        if fn is fused_adamw_int8_reference:
            kw.update(max_codes=self.x_codes, max_scales=self.x_scales)
        else:
            kw.update(max_exp_avg_sq_codes=self.x_codes, max_exp_avg_sq_scales=self.x_scales)
        super().step(fn, grad, step, **kw)

    def v_max(self):
        return q8.dequantize(self.x_codes, self.x_scales, self.block, q8.EXP_AVG_SQ_MAP)


def _run_both(n, block, out, steps, grad_dtype=torch.float32, seed=0, **kw):
    kernel, ref = AmsState(n, block, out, seed), AmsState(n, block, out, seed)
    for step in steps:
        grad = _grad(n, grad_dtype, step)
        kernel.step(fused_adamw_int8_, grad, step, **kw)
        ref.step(fused_adamw_int8_reference, grad, step, **kw)
        assert_same_state(kernel, ref)
        assert not bool((kernel.x_codes.view(torch.uint8) & 0x80).any())  # bit 7 of the max's codes stays 0
    return kernel


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,block", [(1, 64), (15, 16), (16, 16), (63, 64), (64, 64), (97, 64), (1025, 64),
                                     (1000, 256), (4096 + 7, 2048), (3 * 65536 + 40, 64)])  # fmt: skip
@pytest.mark.parametrize("out", ["none", "bf16", "fp16", "remainder"])
def test_bitwise_the_reference(isa, n, block, out):
    """Three steps on every path, odd sizes and block tails, several OpenMP chunks at the largest size: every byte
    of master/param/remainder, the three moments' codes and scales equals the reference's."""
    ops.cpu_isa(isa)
    _run_both(n, block, out, (1, 2, 3))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("maximize,grad_scale,beta1", [(False, 0.5, 0.9), (True, 1.0, 0.3)])
def test_grad_dtypes_maximize_and_lerp_branches(isa, grad_dtype, maximize, grad_scale, beta1):
    ops.cpu_isa(isa)
    _run_both(64 * 5 + 9, 64, "bf16", (1, 2), grad_dtype, maximize=maximize, grad_scale=grad_scale, beta1=beta1)


def test_both_sides_of_the_max_are_exercised():
    """The states above: the old max wins in some elements of every block, the new exp_avg_sq in others, and the
    step changes the update (so the bitwise tests see a kernel that takes the max wrongly)."""
    n, block = 64 * 8, 64
    s = AmsState(n, block, "none")
    plain = s.clone()
    old = s.v_max()
    s.step(fused_adamw_int8_, _grad(n, torch.float32, 2), 2)
    State.step(plain, fused_adamw_int8_, _grad(n, torch.float32, 2), 2)
    v = q8.dequantize(plain.v_codes, plain.v_scales, block, q8.EXP_AVG_SQ_MAP)  # exp_avg_sq is the same in both
    assert torch.equal(s.v_codes, plain.v_codes) and torch.equal(s.v_scales, plain.v_scales)
    wins = (old > v).view(-1, block).float().mean(dim=1)
    assert bool(((wins > 0.1) & (wins < 0.9)).all()), wins
    assert int((_bits(s.master) != _bits(plain.master)).sum()) > n // 4


@pytest.mark.parametrize("isa", ISAS)
def test_bit7_of_the_max_codes_is_ignored_and_written_0(isa):
    ops.cpu_isa(isa)
    n, block = 64 * 3 + 5, 64
    clean, dirty = AmsState(n, block, "remainder"), AmsState(n, block, "remainder")
    dirty.x_codes.copy_((dirty.x_codes.view(torch.uint8) | 0x80).view(torch.int8))
    grad = _grad(n, torch.float32, 1)
    clean.step(fused_adamw_int8_, grad, 1)
    dirty.step(fused_adamw_int8_, grad, 1)
    assert_same_state(clean, dirty)


def test_zero_max_is_the_state_start():
    """From an all-zero max (codes 0, scales 0) the first step's max is the new exp_avg_sq: same codes (without
    param_remainders' tie bit) and scales."""
    n, block = 64 * 4 + 3, 64
    s = AmsState(n, block, "none", zero=True)
    assert float(s.v_max().abs().max()) == 0.0
    s.step(fused_adamw_int8_, _grad(n, torch.float32, 1), 1)
    assert torch.equal(s.x_codes, s.v_codes) and torch.equal(_bits(s.x_scales), _bits(s.v_scales))


@pytest.mark.parametrize("isa", ISAS)
def test_torch_adamw_amsgrad_on_the_dequantized_moments(isa):
    """Independent of the reference: torch.optim.AdamW(amsgrad=True), one step from the dequantized moments, gives
    the kernel's master (torch's default tolerance: its fp32 sqrt is not always correctly rounded) and, quantized,
    the kernel's max_exp_avg_sq and exp_avg_sq codes and scales."""
    ops.cpu_isa(isa)
    n, block, step = 64 * 6 + 11, 64, 3
    s = AmsState(n, block, "none", seed=7)
    p = torch.nn.Parameter(s.master.clone())
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], amsgrad=True, foreach=False)  # fmt: skip
    opt.state[p] = dict(step=torch.tensor(float(step - 1)),
                        exp_avg=q8.dequantize(s.m_codes, s.m_scales, block, q8.EXP_AVG_MAP),
                        exp_avg_sq=q8.dequantize(s.v_codes, s.v_scales, block, q8.EXP_AVG_SQ_MAP),
                        max_exp_avg_sq=s.v_max())  # fmt: skip
    p.grad = _grad(n, torch.float32, step)
    opt.step()
    s.step(fused_adamw_int8_, p.grad, step)
    torch.testing.assert_close(s.master, p.detach())
    for name, codes, scales in (("max_exp_avg_sq", s.x_codes, s.x_scales), ("exp_avg_sq", s.v_codes, s.v_scales)):
        want_codes, want_scales = q8.quantize(opt.state[p][name], block, q8.EXP_AVG_SQ_MAP)
        assert torch.equal(codes, want_codes) and torch.equal(_bits(scales), _bits(want_scales)), name


@pytest.mark.parametrize("isa", ISAS)
def test_nan_and_inf_poison_the_max_like_the_reference(isa):
    """NaN/inf gradients make the max NaN/inf (NaN-propagating maximum, as torch.maximum); a block whose old max
    is NaN stays NaN whatever the new exp_avg_sq."""
    ops.cpu_isa(isa)
    n, block = 64 * 4, 64
    grad = _grad(n, torch.float32, 1)
    grad[10], grad[100] = float("nan"), float("inf")
    kernel, ref = AmsState(n, block, "bf16"), AmsState(n, block, "bf16")
    for s in (kernel, ref):
        s.x_scales[3] = float("nan")
    kernel.step(fused_adamw_int8_, grad, 1)
    ref.step(fused_adamw_int8_reference, grad, 1)
    assert_same_state(kernel, ref)
    assert bool(kernel.x_scales[0].isnan()) and float(kernel.x_scales[1]) == float("inf")
    assert bool(kernel.x_scales[3].isnan()) and bool(kernel.x_scales[2].isfinite())


def test_remainder_joined_master_is_the_fp32_master_runs():
    """param_remainders with amsgrad: the joined master, the param and every moment's codes (exp_avg_sq's without
    the tie bit) equal the fp32-master run's."""
    n, block = 64 * 8 + 1, 64
    split, full = AmsState(n, block, "remainder", seed=3), AmsState(n, block, "none", seed=3)
    full.master = master_split.join(split.master, split.remainder, master_split.tie_of(split.v_codes))
    for step in (1, 2, 3):
        grad = _grad(n, torch.float32, step)
        split.step(fused_adamw_int8_, grad, step)
        full.step(fused_adamw_int8_, grad, step)
        joined = master_split.join(split.master, split.remainder, master_split.tie_of(split.v_codes))
        assert torch.equal(_bits(joined), _bits(full.master))
        assert torch.equal(split.v_codes.view(torch.uint8) & 0x7F, full.v_codes.view(torch.uint8))
        assert torch.equal(split.x_codes, full.x_codes) and torch.equal(_bits(split.x_scales), _bits(full.x_scales))


def test_found_inf_changes_no_byte():
    s = AmsState(200, 64, "remainder")
    before = s.clone()
    s.step(fused_adamw_int8_, _grad(200, torch.float32, 1), 1, found_inf=torch.tensor(1.0))
    assert_same_state(s, before)


def test_empty_shard():
    s = AmsState(0, 64)
    s.step(fused_adamw_int8_, torch.zeros(0), 1)


def _bad_cases():
    def set_(name, fn):
        return lambda kw: kw.__setitem__(name, fn(kw[name]))

    both = "`max_exp_avg_sq_codes` and `max_exp_avg_sq_scales` must be given together"
    return [
        ("codes_only", lambda kw: kw.pop("max_exp_avg_sq_scales"), both + r".*got only `max_exp_avg_sq_codes`"),
        ("scales_only", lambda kw: kw.pop("max_exp_avg_sq_codes"), both + r".*got only `max_exp_avg_sq_scales`"),
        ("codes_dtype", set_("max_exp_avg_sq_codes", lambda t: t.view(torch.uint8)), "`max_exp_avg_sq_codes` must be"),
        ("codes_numel", set_("max_exp_avg_sq_codes", lambda t: t[:-1].clone()), "`max_exp_avg_sq_codes` must have"),
        ("scales_numel", set_("max_exp_avg_sq_scales", lambda t: t[:-1].clone()), "`max_exp_avg_sq_scales` must have"),
        ("scales_dtype", set_("max_exp_avg_sq_scales", lambda t: t.double()), "`max_exp_avg_sq_scales` must be"),
        ("overlap", lambda kw: kw.__setitem__("max_exp_avg_sq_codes", kw["exp_avg_sq_codes"]), "overlap"),
        ("overlap_scales", lambda kw: kw.__setitem__("max_exp_avg_sq_scales", kw["exp_avg_scales"]), "overlap"),
    ]


@pytest.mark.parametrize("name,mutate,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_and_modifies_nothing(name, mutate, match):
    s = AmsState(130, 64, "bf16")
    kw = dict(master=s.master, grad=_grad(130, torch.float32, 1), exp_avg_codes=s.m_codes, exp_avg_scales=s.m_scales,
              exp_avg_sq_codes=s.v_codes, exp_avg_sq_scales=s.v_scales, param_out=s.param_out, block=64, step=1,
              max_exp_avg_sq_codes=s.x_codes, max_exp_avg_sq_scales=s.x_scales, **HP)  # fmt: skip
    mutate(kw)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((RuntimeError, ValueError), match=match):
        fused_adamw_int8_(**kw)
    for k, v in before.items():
        assert torch.equal(_bits(kw[k]), _bits(v)), k


@pytest.mark.parametrize("given", ["codes", "scales"])
def test_fake_rejects_one_of_the_pair_under_meta(given):
    s = AmsState(97, 64)
    meta = [t.to("meta") for t in (s.master, torch.zeros(97), s.m_codes, s.m_scales, s.v_codes, s.v_scales)]
    kw = {f"max_exp_avg_sq_{given}": (s.x_codes if given == "codes" else s.x_scales).to("meta")}
    with pytest.raises(RuntimeError, match="must be given together"):
        OP(*meta, block=64, step=1.0, **HP, **kw)


@pytest.mark.parametrize("variant", ["plain", "remainder", "tensor_scalars_found_inf"])
def test_opcheck(variant):
    s = AmsState(97, 16, "remainder" if variant == "remainder" else "none")
    kw = dict(HP, step=3.0, block=16, remainder=s.remainder, max_exp_avg_sq_codes=s.x_codes,
              max_exp_avg_sq_scales=s.x_scales)  # fmt: skip
    if variant == "tensor_scalars_found_inf":
        kw.update({f"{k}_tensor": torch.tensor(v) for k, v in HP.items()}, found_inf=torch.zeros(()))
    args = (s.master, _grad(97, torch.bfloat16, 1), s.m_codes, s.m_scales, s.v_codes, s.v_scales)
    torch.library.opcheck(OP, args, kw)


@pytest.mark.cuda
@pytest.mark.parametrize("n,block", [(97, 16), (1025, 64), (3 * 65536 + 40, 64), (2 * 4096 + 7, 4096)])
@pytest.mark.parametrize("out", ["none", "bf16", "remainder"])
def test_cuda_matches_the_cpu_kernel(n, block, out):
    """The CUDA kernel with amsgrad against the CPU kernel, three steps, block tails; block 4096 needs 52 KiB of
    dynamic shared memory (the kernel's opt-in above 48 KiB). Written without a GPU and never run."""
    cpu = AmsState(n, block, out)
    gpu = _to(cpu, "cuda")
    for step in (1, 2, 3):
        grad = _grad(n, torch.bfloat16, step)
        cpu.step(fused_adamw_int8_, grad, step)
        gpu.step(fused_adamw_int8_, grad.cuda(), step, found_inf=torch.zeros((), device="cuda"))
        assert_same_state(_to(gpu, "cpu"), cpu)
    before = _to(gpu, "cpu")
    gpu.step(fused_adamw_int8_, _grad(n, torch.bfloat16, 4).cuda(), 4, found_inf=torch.ones((), device="cuda"))
    assert_same_state(_to(gpu, "cpu"), before)
