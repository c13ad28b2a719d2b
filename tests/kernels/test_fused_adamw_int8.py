"""zero_ext.ops.int8.fused_adamw_int8_ (int8 block-quantized moments) against its plain-torch reference
(tests/helpers/int8_reference.py's fused_adamw_int8_reference): bitwise on every CPU path (scalar, AVX2, AVX-512), odd
sizes and block tails, every grad dtype and param output, param_remainders' tie bit; found_inf, bad input, opcheck.

Why bitwise: the kernel performs the reference's IEEE fp32 operations one for one (map value * scale; adamw_math.h's
update, which the reference runs through the fp32 op; |x| max; x / scale; comparisons with the same fp32
thresholds, csrc/fused_adamw_int8_maps.h, generated from the reference's maps)."""

import pytest
import torch
from int8_reference import fused_adamw_int8_reference

from zero_ext import ops
from zero_ext.ops.int8 import fused_adamw_int8_
from zero_ext.update import blockwise_int8 as q8
from zero_ext.update import master_split

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
ISAS = ["scalar", "avx2", "avx512"]
OP = torch.ops.zero_ext.fused_adamw_int8_.default


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    ops.cpu_isa("auto")


def _bits(t):
    size = t.element_size()
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[size])


class State:
    """One shard's int8 state (plus master, param and remainder) built from random fp32 moments."""

    def __init__(self, n, block, out="none", seed=0):
        g = torch.Generator().manual_seed(seed)
        self.n, self.block, self.out = n, block, out
        master = torch.randn(n, generator=g)
        self.m_codes, self.m_scales = q8.quantize(torch.randn(n, generator=g) * 1e-2, block, q8.EXP_AVG_MAP)
        self.v_codes, self.v_scales = q8.quantize(torch.rand(n, generator=g) ** 4 * 1e-4, block, q8.EXP_AVG_SQ_MAP)
        self.param_out, self.remainder = None, None
        if out == "remainder":
            self.master, self.remainder, tie = master_split.split(master)
            self.v_codes = (self.v_codes.view(torch.uint8) | (tie.to(torch.uint8) << 7)).view(torch.int8)
        else:
            self.master = master
            if out in ("bf16", "fp16"):
                self.param_out = torch.zeros(n, dtype=torch.bfloat16 if out == "bf16" else torch.float16)

    def clone(self):
        c = State.__new__(State)
        c.__dict__ = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return c

    def tensors(self):
        return [t for t in (self.master, self.m_codes, self.m_scales, self.v_codes, self.v_scales, self.param_out,
                            self.remainder) if t is not None]  # fmt: skip

    def step(self, fn, grad, step, **kw):
        fn(self.master, grad, self.m_codes, self.m_scales, self.v_codes, self.v_scales, step=step, block=self.block,
           param_out=self.param_out, remainder=self.remainder, **{**HP, **kw})  # fmt: skip


def assert_same_state(a: State, b: State):
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(_bits(x), _bits(y)), (x, y)


def _grad(n, dtype, step):
    return (torch.randn(n, generator=torch.Generator().manual_seed(100 + step)) * 1e-2).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,block", [(1, 64), (15, 16), (16, 16), (63, 64), (64, 64), (97, 64), (1025, 64),
                                     (1000, 256), (4096 + 7, 2048), (3 * 65536 + 40, 64), (16 * 131 + 5, 16),
                                     (128 * 21, 128)])  # fmt: skip
@pytest.mark.parametrize("out", ["none", "bf16", "fp16", "remainder"])
def test_bitwise_the_reference(isa, n, block, out):
    """Three steps on every path, odd sizes and block tails (n not a multiple of block), several OpenMP chunks at
    the largest size: every byte of master/param/remainder, codes and scales equals the reference's."""
    ops.cpu_isa(isa)
    kernel, ref = State(n, block, out), State(n, block, out)
    for step in (1, 2, 3):
        grad = _grad(n, torch.float32, step)
        kernel.step(fused_adamw_int8_, grad, step)
        ref.step(fused_adamw_int8_reference, grad, step)
        assert_same_state(kernel, ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("maximize,grad_scale,beta1", [(False, 0.5, 0.9), (True, 1.0, 0.3)])
def test_grad_dtypes_maximize_and_lerp_branches(isa, grad_dtype, maximize, grad_scale, beta1):
    """Low-precision grads, maximize, grad_scale, and both of lerp's branches (weight 1 - beta1 below or above
    0.5) on every path."""
    ops.cpu_isa(isa)
    n, block = 64 * 5 + 9, 64
    kernel, ref = State(n, block, "bf16"), State(n, block, "bf16")
    for step in (1, 2):
        grad = _grad(n, grad_dtype, step)
        kw = dict(maximize=maximize, grad_scale=grad_scale, beta1=beta1)
        kernel.step(fused_adamw_int8_, grad, step, **kw)
        ref.step(fused_adamw_int8_reference, grad, step, **kw)
        assert_same_state(kernel, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_nan_and_inf_gradients_poison_their_blocks_like_the_reference(isa):
    ops.cpu_isa(isa)
    n, block = 64 * 4, 64
    grad = _grad(n, torch.float32, 1)
    grad[10], grad[100] = float("nan"), float("inf")
    kernel, ref = State(n, block, "bf16"), State(n, block, "bf16")
    kernel.step(fused_adamw_int8_, grad, 1)
    ref.step(fused_adamw_int8_reference, grad, 1)
    assert_same_state(kernel, ref)
    assert bool(kernel.m_scales[0].isnan()) and float(kernel.m_scales[1]) == float("inf")  # a NaN, an inf block
    assert bool(kernel.m_scales[2:].isfinite().all())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out", ["bf16", "remainder"])
def test_subnormal_blocks_like_the_reference(isa, out):
    """Blocks whose absmax is subnormal, on both sides of its reciprocal's overflow: 3e-39's is finite (the SIMD codes
    run on subnormal x), 2e-39's and 1e-40's are inf (y = x * inf: +-inf, and a NaN at x = 0; the SIMD path hands
    such a block to the scalar codes). beta1 = 0 makes the new exp_avg the gradient itself; every byte equals the
    reference's."""
    ops.cpu_isa(isa)
    n, block = 64 * 6, 64
    grad = _grad(n, torch.float32, 1)
    for k, tiny in enumerate((3e-39, 2e-39, 1e-40)):
        grad[64 * (k + 1) : 64 * (k + 2)] = tiny * torch.linspace(-1, 1, 64)
        grad[64 * (k + 1) + 5] = 0.0  # 0 * inf: a NaN y, whose code is 0
    kernel, ref = State(n, block, out), State(n, block, out)
    kernel.step(fused_adamw_int8_, grad, 1, beta1=0.0)
    ref.step(fused_adamw_int8_reference, grad, 1, beta1=0.0)
    assert_same_state(kernel, ref)
    rcp = 1.0 / kernel.m_scales[1:4]
    assert bool(rcp[0].isfinite()) and not bool(rcp[1:].isfinite().any())  # both sides of the overflow


def _grad_on_the_thresholds(block: int) -> torch.Tensor:
    """Each block: +-1.0 first (so the block absmax is 1 and x / absmax is x), then exp_avg's thresholds, the
    floats next to them on both sides and its map values, +-0 and subnormals, zero-padded to whole blocks."""
    t = q8.thresholds(q8.EXP_AVG_MAP)
    two = torch.tensor(2.0)
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38])
    values = torch.cat([t, torch.nextafter(t, two), torch.nextafter(t, -two), q8.EXP_AVG_MAP, tiny])
    values = values[values.abs() <= 1]
    per = block - 1
    blocks = -(-values.numel() // per)
    rest = torch.zeros(blocks * per)
    rest[: values.numel()] = values
    heads = torch.tensor([1.0, -1.0]).repeat(blocks)[:blocks, None]
    return torch.cat([heads, rest.view(blocks, per)], dim=1).view(-1)


@pytest.mark.parametrize("isa", ISAS)
def test_codes_on_and_next_to_every_threshold(isa):
    """beta1 = 0 makes the new exp_avg the gradient itself, and the +-1.0 heading each block its absmax, so
    exp_avg is requantized from exactly these values: every threshold of its map, the floats on both sides of each
    and every map value (the quantizer's hardest inputs; test_int8_quantizer.cpp runs all of them, this runs them
    through the step)."""
    ops.cpu_isa(isa)
    grad = _grad_on_the_thresholds(64)
    n = grad.numel()
    kernel, ref = State(n, 64, "bf16"), State(n, 64, "bf16")
    kernel.step(fused_adamw_int8_, grad, 1, beta1=0.0)
    ref.step(fused_adamw_int8_reference, grad, 1, beta1=0.0)
    assert_same_state(kernel, ref)
    assert torch.equal(kernel.m_codes, q8.quantize(grad, 64, q8.EXP_AVG_MAP)[0])


def test_tie_bit_is_set_where_the_master_is_a_tie():
    """param_remainders: bit 7 of exp_avg_sq's codes is the tie bit; the joined master is the fp32-master run's."""
    n, block = 64 * 8, 64
    split, full = State(n, block, "remainder", seed=3), State(n, block, "none", seed=3)
    for step in (1, 2, 3):
        grad = _grad(n, torch.float32, step)
        # plant ties before each step: masters whose low 16 bits are 0x8000 with bit 16 = 0
        tied = (_bits(full.master) & ~0x1FFFF | 0x8000).view(torch.float32)
        full.master.copy_(tied)
        p, r, t = master_split.split(tied)
        split.master.copy_(p)
        split.remainder.copy_(r)
        split.v_codes.copy_(((split.v_codes.view(torch.uint8) & 0x7F) | (t.to(torch.uint8) << 7)).view(torch.int8))
        assert bool(t.all())
        split.step(fused_adamw_int8_, grad, step)
        full.step(fused_adamw_int8_, grad, step)
        joined = master_split.join(split.master, split.remainder, master_split.tie_of(split.v_codes))
        assert torch.equal(_bits(joined), _bits(full.master))
        assert torch.equal(_bits(split.master), _bits(full.master.to(torch.bfloat16)))
        assert torch.equal(split.v_codes.view(torch.uint8) & 0x7F, full.v_codes.view(torch.uint8))


@pytest.mark.parametrize("isa", ISAS)
def test_tie_bit_is_written_for_a_master_that_stays_a_tie(isa):
    """lr = 0 and weight_decay = 0 leave every master as it was: masters planted on bf16 ties (rounded down by
    RNE) must come back with bit 7 set in every exp_avg_sq code, the rest of the code untouched by it, on every
    path (the random states of the other tests have a tie in about 2^-16 of their elements)."""
    ops.cpu_isa(isa)
    n, block = 64 * 6 + 5, 64
    s = State(n, block, "remainder", seed=4)
    master = (_bits(master_split.join(s.master, s.remainder, master_split.tie_of(s.v_codes))) & ~0x1FFFF | 0x8000).view(
        torch.float32
    )
    p, r, t = master_split.split(master)
    s.master.copy_(p)
    s.remainder.copy_(r)
    s.v_codes.copy_((s.v_codes.view(torch.uint8) | 0x80).view(torch.int8))
    ref = s.clone()
    s.step(fused_adamw_int8_, _grad(n, torch.float32, 1), 1, lr=0.0, weight_decay=0.0)
    ref.step(fused_adamw_int8_reference, _grad(n, torch.float32, 1), 1, lr=0.0, weight_decay=0.0)
    assert_same_state(s, ref)
    assert bool(master_split.tie_of(s.v_codes).all())
    assert torch.equal(_bits(master_split.join(s.master, s.remainder, master_split.tie_of(s.v_codes))), _bits(master))


def test_found_inf_changes_no_byte():
    s = State(200, 64, "remainder")
    before = s.clone()
    s.step(fused_adamw_int8_, _grad(200, torch.float32, 1), 1, found_inf=torch.tensor(1.0))
    assert_same_state(s, before)


def test_tensor_scalars_give_the_numbers_bits():
    a, b = State(300, 64, "bf16"), State(300, 64, "bf16")
    grad = _grad(300, torch.float32, 1)
    a.step(fused_adamw_int8_, grad, 2)
    kw = {k: torch.tensor(v, dtype=torch.float64) for k, v in HP.items()}  # fp64: the numbers' exact values
    b.step(fused_adamw_int8_, grad, torch.tensor(2.0), **kw)
    assert_same_state(a, b)


def test_empty_shard():
    s = State(0, 64)
    s.step(fused_adamw_int8_, torch.zeros(0), 1)


def _bad_cases():
    def set_(name, fn):
        return lambda kw: kw.__setitem__(name, fn(kw[name]))

    return [
        ("block", set_("block", lambda b: 24), "`block` must be a multiple of 16"),
        ("block_big", set_("block", lambda b: 8192), "`block` must be a multiple of 16"),
        ("m_codes_dtype", set_("exp_avg_codes", lambda t: t.to(torch.uint8)), "`exp_avg_codes` must be"),
        ("v_codes_numel", set_("exp_avg_sq_codes", lambda t: t[:-1].clone()), "`exp_avg_sq_codes` must have"),
        ("scales_numel", set_("exp_avg_scales", lambda t: t[:-1].clone()), "`exp_avg_scales` must have"),
        ("scales_dtype", set_("exp_avg_sq_scales", lambda t: t.double()), "`exp_avg_sq_scales` must be"),
        ("master_dtype", set_("master", lambda t: t.double()), "`master` must be float32"),
        ("grad_numel", set_("grad", lambda t: t[:-1].clone()), "`grad` must have"),
        ("param_out_dtype", set_("param_out", lambda t: torch.zeros(t.numel())), "`param_out` must be bfloat16"),
        ("lr", set_("lr", lambda v: -1.0), "lr"),
        ("overlap", lambda kw: kw.__setitem__("exp_avg_sq_codes", kw["exp_avg_codes"]), "overlap"),
    ]


@pytest.mark.parametrize("name,mutate,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_and_modifies_nothing(name, mutate, match):
    s = State(130, 64, "bf16")
    kw = dict(master=s.master, grad=_grad(130, torch.float32, 1), exp_avg_codes=s.m_codes, exp_avg_scales=s.m_scales,
              exp_avg_sq_codes=s.v_codes, exp_avg_sq_scales=s.v_scales, param_out=s.param_out, block=64, step=1,
              **HP)  # fmt: skip
    mutate(kw)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((RuntimeError, ValueError), match=match):
        fused_adamw_int8_(**kw)
    for k, v in before.items():
        assert torch.equal(_bits(kw[k]), _bits(v)), k


@pytest.mark.parametrize("variant", ["plain", "param_out", "remainder", "tensor_scalars_found_inf"])
def test_opcheck(variant):
    s = State(97, 16, {"plain": "none", "param_out": "bf16", "remainder": "remainder"}.get(variant, "none"))
    kw = dict(HP, step=3.0, block=16, param_out=s.param_out, remainder=s.remainder)
    if variant == "tensor_scalars_found_inf":
        kw.update({f"{k}_tensor": torch.tensor(v) for k, v in HP.items()}, found_inf=torch.zeros(()))
    args = (s.master, _grad(97, torch.bfloat16, 1), s.m_codes, s.m_scales, s.v_codes, s.v_scales)
    torch.library.opcheck(OP, args, kw)


def test_fake_rejects_a_bad_block_under_meta():
    s = State(97, 64)
    meta = [t.to("meta") for t in (s.master, torch.zeros(97), s.m_codes, s.m_scales, s.v_codes, s.v_scales)]
    with pytest.raises(RuntimeError, match="`block` must be a multiple of 16"):
        OP(*meta, block=24, step=1.0, **HP)


def _to(state: State, device: str) -> State:
    c = state.clone()
    c.__dict__ = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in c.__dict__.items()}
    return c


@pytest.mark.cuda
@pytest.mark.parametrize("n,block", [(97, 16), (1025, 64), (4096 + 7, 2048), (3 * 65536 + 40, 64), (64 * 37 + 13, 64),
                                     (3, 64)])  # fmt: skip
@pytest.mark.parametrize("out", ["none", "bf16", "fp16", "remainder"])
def test_cuda_matches_the_cpu_kernel(n, block, out):
    """The CUDA kernel against the CPU kernel, three steps, with block tails. Written without a GPU and never run:
    expected bitwise (same IEEE operations; explicit fmaf only). If it fails by an ulp, check whether ptxas
    contracted a mul+add of adamw_update (adamw_math.h) into an FMA (-fmad=true): codes then differ where a
    moment sits on a threshold, and the fp32 op's CUDA tests would show the same."""
    cpu = State(n, block, out)
    gpu = _to(cpu, "cuda")
    for step in (1, 2, 3):
        grad = _grad(n, torch.bfloat16, step)
        cpu.step(fused_adamw_int8_, grad, step)
        gpu.step(fused_adamw_int8_, grad.cuda(), step, found_inf=torch.zeros((), device="cuda"))
        assert_same_state(_to(gpu, "cpu"), cpu)
    before = _to(gpu, "cpu")
    gpu.step(fused_adamw_int8_, _grad(n, torch.bfloat16, 4).cuda(), 4, found_inf=torch.ones((), device="cuda"))
    assert_same_state(_to(gpu, "cpu"), before)


@pytest.mark.cuda
@pytest.mark.parametrize("out", ["none", "bf16", "remainder"])
def test_cuda_misaligned_views_match_the_cpu_kernel(out):
    """64-element blocks run the register kernel (one half-warp per block, 4 elements a lane, vector loads) when every
    stream's base allows its vector accesses, and its element-by-element path when one does not: each buffer here is a
    view one element into a larger one (no base 16-byte aligned), two steps against the CPU kernel. Never run yet."""
    n, block = 64 * 21 + 9, 64
    cpu = State(n, block, out)
    gpu = State.__new__(State)
    gpu.__dict__ = dict(cpu.__dict__)
    for k, v in cpu.__dict__.items():
        if isinstance(v, torch.Tensor):
            wide = torch.zeros(v.numel() + 1, dtype=v.dtype, device="cuda")
            wide[1:] = v.cuda()
            gpu.__dict__[k] = wide[1:]
    for step in (1, 2):
        grad = _grad(n, torch.bfloat16, step)
        wide_grad = torch.zeros(n + 1, dtype=grad.dtype, device="cuda")
        wide_grad[1:] = grad.cuda()
        cpu.step(fused_adamw_int8_, grad, step)
        gpu.step(fused_adamw_int8_, wide_grad[1:], step)
        assert_same_state(_to(gpu, "cpu"), cpu)


@pytest.mark.cuda
def test_cuda_codes_on_and_next_to_every_threshold():
    """test_codes_on_and_next_to_every_threshold on the GPU, against the CPU kernel (the quantizer's hardest inputs
    through the CUDA step; cuda_test_launchers runs every pattern through the quantizer alone). Never run yet."""
    grad = _grad_on_the_thresholds(64)
    cpu = State(grad.numel(), 64, "bf16")
    gpu = _to(cpu, "cuda")
    cpu.step(fused_adamw_int8_, grad, 1, beta1=0.0)
    gpu.step(fused_adamw_int8_, grad.cuda(), 1, beta1=0.0)
    assert_same_state(_to(gpu, "cpu"), cpu)
