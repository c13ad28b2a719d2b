"""CUDA-specific checks of the zero_ext ops, beyond the shared cpu/cuda op tests.

No host sync with device scalars, found_inf read on the device, unaligned views (scalar fallback),
CUDA vs CPU results (amsgrad and maximize too), one launch for many tensors, deterministic sums, > 2^31 elements.

CUDA vs CPU: adamw_math.h spells its FMAs out (fmaf, as torch's lerp_/addcmul_ round) and nvcc (default
``-fmad=true``; setup.py keeps it) finds no other ``a*b + c`` to contract, so the CUDA kernel should give the
CPU kernel's bits. Until that is seen on a GPU, master/exp_avg/exp_avg_sq are compared at a few-ulp tolerance;
param_out is checked bitwise against the CUDA master rounded by torch (``master.to(bf16)`` is round-to-nearest-even).
"""

import contextlib

import pytest
import torch

from zero_ext import ops

pytestmark = pytest.mark.cuda

# Hyperparameters exactly representable in fp32, so a value passed as an fp32 device tensor and the
# same value passed as a Python float give the kernel the same double and the results are bitwise equal.
HP = dict(lr=2.0**-10, beta1=0.875, beta2=1 - 2.0**-10, eps=2.0**-20, weight_decay=0.0625, step=3.0, grad_scale=0.5)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def no_host_sync():
    """Any synchronising CUDA call inside raises (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def make_state(n, grad_dtype=torch.float32, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g).to(grad_dtype)
    exp_avg = 0.1 * torch.randn(n, generator=g)
    exp_avg_sq = 0.01 * torch.rand(n, generator=g)
    return [t.to(device) for t in (master, grad, exp_avg, exp_avg_sq)]


def clone_all(ts):
    return [t.clone() for t in ts]


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    assert torch.equal(a.view(view), b.view(view))


def test_device_scalars_no_host_sync():
    n = 4099
    ref = make_state(n)
    ops.fused_adamw_(*ref, **HP)
    state = make_state(n)
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    # fp32, fp64 and int64 device tensors: the non-fp32 ones are converted on the stream.
    scalars = {k: torch.tensor(v, device="cuda") for k, v in HP.items()}
    scalars["step"] = torch.tensor(3, device="cuda")
    scalars["lr"] = torch.tensor(HP["lr"], dtype=torch.float64, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    with no_host_sync():
        ops.fused_adamw_(*state, **scalars, param_out=out, found_inf=found_inf)
    for a, b in zip(state, ref):
        assert_bitwise(a, b)
    assert_bitwise(out, state[0].to(torch.bfloat16))


def test_cpu_scalar_tensors_are_read_without_device_sync():
    state, ref = make_state(1000), make_state(1000)
    ops.fused_adamw_(*ref, **HP)
    with no_host_sync():
        ops.fused_adamw_(*state, **{k: torch.tensor(v) for k, v in HP.items()})
    for a, b in zip(state, ref):
        assert_bitwise(a, b)


def test_cpu_tensor_scalars_validated_device_tensor_scalars_trusted():
    state = make_state(100)
    before = clone_all(state)
    # A CPU tensor is read (no device sync) and validated like a number, even with master on the GPU.
    for name, bad in (("grad_scale", float("nan")), ("grad_scale", float("inf")), ("lr", -1.0), ("step", 0.0)):
        with pytest.raises(RuntimeError, match=f"`{name}`"):
            ops.fused_adamw_(*state, **dict(HP, **{name: torch.tensor(bad)}))
    for a, b in zip(state, before):
        assert_bitwise(a, b)
    # A device tensor is read by the kernel and not validated (that would synchronise): the caller vouches for it.
    with no_host_sync():
        ops.fused_adamw_(*state, **dict(HP, grad_scale=torch.tensor(float("nan"), device="cuda")))
    assert state[0].isnan().all()


def test_other_ops_no_host_sync():
    tensors = [torch.randn(n, device="cuda") for n in (5, 1000, 33)]
    flat = torch.zeros(1038, device="cuda")
    with no_host_sync():
        ops.flatten_(flat, tensors, [0, 5, 1005])
        ops.unflatten_(flat, tensors, [0, 5, 1005], 2.0)
        ops.sum_squares(flat)


@pytest.mark.parametrize("value, skipped", [(0.0, False), (1.0, True), (float("nan"), True)])
def test_found_inf_on_device(value, skipped):
    n = 1025
    state = make_state(n)
    before = clone_all(state)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16, device="cuda")
    out_before = out.clone()
    ops.fused_adamw_(*state, **HP, param_out=out, found_inf=torch.tensor(value, device="cuda"))
    if skipped:  # a bitwise no-op, param_out included
        for a, b in zip(state + [out], before + [out_before]):
            assert_bitwise(a, b)
    else:
        ref = before
        ops.fused_adamw_(*ref, **HP)
        for a, b in zip(state, ref):
            assert_bitwise(a, b)
        assert_bitwise(out, state[0].to(torch.bfloat16))


@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shift", [1, 2, 3])
def test_unaligned_views_take_the_scalar_path(grad_dtype, shift):
    # Views `shift` elements into their storage are not 16-byte (fp32) / 8-byte (16-bit) aligned.
    n = 4096 + 7
    aligned = make_state(n, grad_dtype)
    out_aligned = torch.empty(n, dtype=torch.float16, device="cuda")
    storage = [torch.empty(n + shift, dtype=t.dtype, device="cuda") for t in aligned]
    views = [s[shift:] for s in storage]
    for v, a in zip(views, aligned):
        v.copy_(a)
    out_view = torch.empty(n + shift, dtype=torch.float16, device="cuda")[shift:]
    ops.fused_adamw_(*aligned, **HP, param_out=out_aligned)
    ops.fused_adamw_(*views, **HP, param_out=out_view)
    # Same adamw_update on both paths: bitwise equal (vector and scalar loops inline the same code).
    for a, v in zip(aligned + [out_aligned], views + [out_view]):
        assert_bitwise(a, v)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16_out", "fp16_out"])
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [1, 7, 97, 1025, 2**20 + 3])
def test_cuda_matches_cpu(n, grad_dtype, out_dtype):
    cuda_state = make_state(n, grad_dtype)
    cpu_state = [t.cpu() for t in cuda_state]
    cuda_out = torch.empty(n, dtype=out_dtype, device="cuda")
    cpu_out = torch.empty(n, dtype=out_dtype)
    hp = dict(HP, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)  # torch's defaults
    for step in (1, 2, 3):
        ops.fused_adamw_(*cuda_state, **dict(hp, step=step), param_out=cuda_out)
        ops.fused_adamw_(*cpu_state, **dict(hp, step=step), param_out=cpu_out)
    for name, c, h in zip(
        ("master", "exp_avg", "exp_avg_sq"), (cuda_state[0], *cuda_state[2:]), (cpu_state[0], *cpu_state[2:])
    ):
        # A few ulp at most (module docstring).
        torch.testing.assert_close(c.cpu(), h, rtol=1e-6, atol=1e-12, msg=name)
    assert_bitwise(cuda_out, cuda_state[0].to(out_dtype))


@pytest.mark.parametrize("amsgrad,maximize", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [1, 7, 97, 1025, 2**20 + 3])
def test_cuda_matches_cpu_amsgrad_maximize(n, grad_dtype, amsgrad, maximize):
    """The CUDA kernel's amsgrad/maximize (templated on amsgrad; maximize folded into grad_scale's sign) against the
    CPU kernel, which tests/kernels/test_fused_adamw.py checks against torch.optim.AdamW. A gradient 2^-6 times smaller
    on the later steps makes exp_avg_sq fall below amsgrad's running max."""
    cuda_state = make_state(n, grad_dtype)
    cuda_max = 0.01 * torch.rand(n, generator=torch.Generator().manual_seed(2)).cuda() if amsgrad else None
    cpu_state = [t.cpu() for t in cuda_state]
    cpu_max = cuda_max.cpu() if amsgrad else None
    cuda_out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    hp = dict(HP, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    for step in (1, 2, 3):
        if step == 2:
            cuda_state[1].mul_(2.0**-6), cpu_state[1].mul_(2.0**-6)
        flags = dict(maximize=maximize)
        ops.fused_adamw_(*cuda_state, **dict(hp, step=step), param_out=cuda_out, max_exp_avg_sq=cuda_max, **flags)
        ops.fused_adamw_(*cpu_state, **dict(hp, step=step), max_exp_avg_sq=cpu_max, **flags)
    pairs = [("master", cuda_state[0], cpu_state[0]), ("exp_avg", cuda_state[2], cpu_state[2])]
    pairs += [("exp_avg_sq", cuda_state[3], cpu_state[3])] + ([("max", cuda_max, cpu_max)] if amsgrad else [])
    for name, c, h in pairs:
        torch.testing.assert_close(c.cpu(), h, rtol=1e-6, atol=1e-12, msg=name)  # see the module docstring
    assert_bitwise(cuda_out, cuda_state[0].to(torch.bfloat16))


def test_amsgrad_found_inf_on_device_changes_nothing():
    state = make_state(1025)
    v_max = torch.rand(1025, device="cuda")
    before = clone_all(state + [v_max])
    with no_host_sync():
        ops.fused_adamw_(*state, **HP, max_exp_avg_sq=v_max, maximize=True, found_inf=torch.ones((), device="cuda"))
    for a, b in zip(state + [v_max], before):
        assert_bitwise(a, b)


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_amsgrad_unaligned_max_exp_avg_sq_takes_the_scalar_path(shift):
    """Only max_exp_avg_sq misaligned: the launcher must drop to the scalar loop, with the vector loop's bits."""
    n = 4096 + 7
    aligned, shifted = make_state(n), make_state(n)
    max_aligned = torch.rand(n, device="cuda") * 0.01
    max_shifted = torch.empty(n + shift, device="cuda")[shift:]
    max_shifted.copy_(max_aligned)
    ops.fused_adamw_(*aligned, **HP, max_exp_avg_sq=max_aligned)
    ops.fused_adamw_(*shifted, **HP, max_exp_avg_sq=max_shifted)
    for a, b in zip(aligned + [max_aligned], shifted + [max_shifted]):
        assert_bitwise(a, b)


def count_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memcpy", "Memset"))]


@pytest.mark.parametrize("to_flat", [True, False], ids=["flatten", "unflatten"])
def test_hundreds_of_tensors_in_one_launch(to_flat):
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 3000, (300,), generator=g).tolist() + [2**20 + 5]
    dtypes = [list(DTYPES.values())[i % 3] for i in range(len(sizes))]
    tensors = [torch.randn(s, generator=g).to(dt).cuda() for s, dt in zip(sizes, dtypes)]
    offsets, off = [], 0
    for s in sizes:
        off += 3  # gaps: unaligned and non-adjacent slices
        offsets.append(off)
        off += s
    flat = torch.randn(off, generator=g).cuda()
    scale = 0.5
    if to_flat:
        expected = flat.clone()
        for t, o in zip(tensors, offsets):
            expected[o : o + t.numel()] = t.float() * scale
        kernels = count_kernels(lambda: ops.flatten_(flat, tensors, offsets, scale))
        assert_bitwise(flat, expected)
    else:
        expected = [(flat[o : o + t.numel()] * scale).to(t.dtype) for t, o in zip(tensors, offsets)]
        kernels = count_kernels(lambda: ops.unflatten_(flat, tensors, offsets, scale))
        for t, e in zip(tensors, expected):
            assert_bitwise(t, e)
    assert len(kernels) == 1 and "flatten" in kernels[0], kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_flatten_scale_one_copies_bits_exactly(dtype):
    # Quiet and signalling NaNs with payloads, subnormals, negative zero: a trip through fp32 and
    # __float2bfloat16_rn would canonicalise the NaNs; scale 1 between equal dtypes must not.
    if dtype == torch.bfloat16:
        bits = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001, -32767, -32768], dtype=torch.int16)
    else:
        bits = torch.tensor([0x7FC00001, 0x7F800001, -1, 0x00000001, -(2**31) + 1, -(2**31)], dtype=torch.int32)
    t = bits.view(dtype).cuda()
    flat = torch.zeros(8, dtype=dtype, device="cuda")
    ops.flatten_(flat, [t], [1])
    assert_bitwise(flat[1:7], t)
    back = torch.zeros_like(t)
    ops.unflatten_(flat, [back], [1])
    assert_bitwise(back, t)


def test_flatten_pinned_records_survive_queued_work():
    # Delay the stream so the host runs far ahead: a pinned staging buffer reused before its copy ran
    # would scramble the slice records of an earlier call.
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    flats, expected = [], []
    for i in range(40):
        tensors = [torch.full((i + 1 + k,), float(i * 100 + k), device="cuda") for k in range(i % 5 + 1)]
        offsets = [sum(t.numel() for t in tensors[:k]) for k in range(len(tensors))]
        flat = torch.zeros(sum(t.numel() for t in tensors), device="cuda")
        ops.flatten_(flat, tensors, offsets)
        flats.append(flat)
        expected.append(torch.cat(tensors))
    torch.cuda.synchronize()
    for f, e in zip(flats, expected):
        assert_bitwise(f, e)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sum_squares_deterministic_and_large(dtype):
    n = 2**25 + 3  # 32M elements, many blocks per SM, and a tail
    x = torch.randn(n, device="cuda").to(dtype)
    s1, f1 = ops.sum_squares(x)
    s2, f2 = ops.sum_squares(x)
    assert_bitwise(s1, s2)
    assert f1.item() == 0.0 and f2.item() == 0.0
    ref = x.double().square().sum()
    torch.testing.assert_close(s1.double(), ref, rtol=1e-5, atol=0)
    # Unaligned start (scalar path) of the same data sums the same elements.
    s3, _ = ops.sum_squares(x[1:])
    torch.testing.assert_close(s3.double(), x[1:].double().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_sum_squares_nonfinite_flag(bad):
    x = torch.ones(4099, device="cuda")
    x[-1] = bad  # in the scalar tail
    _, flag = ops.sum_squares(x)
    assert flag.item() == 1.0
    big = torch.full((10,), 3e38, device="cuda")  # overflows the sum, but every input is finite
    s, flag = ops.sum_squares(big)
    assert s.item() == float("inf") and flag.item() == 0.0
    s, flag = ops.sum_squares(torch.empty(0, device="cuda"))
    assert s.item() == 0.0 and flag.item() == 0.0


def test_rejected_call_modifies_nothing():
    state = make_state(100)
    before = clone_all(state)
    with pytest.raises(RuntimeError):
        ops.fused_adamw_(*state, **HP, param_out=torch.empty(99, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(RuntimeError):
        ops.fused_adamw_(state[0], state[1].cpu(), state[2], state[3], **HP)
    for a, b in zip(state, before):
        assert_bitwise(a, b)


def test_overlapping_arguments_rejected_before_any_launch():
    state = make_state(100)
    before = clone_all(state)
    out = state[0].view(torch.bfloat16)[50:150]  # param_out inside master's bytes
    with pytest.raises(RuntimeError, match="`master` and `param_out` overlap"):
        ops.fused_adamw_(*state, **HP, param_out=out)
    flat = torch.zeros(64, device="cuda")
    with pytest.raises(RuntimeError, match=r"`tensors\[0\]` and `flat` overlap"):
        ops.unflatten_(flat, [flat[8:16]], [0])
    torch.cuda.synchronize()
    for a, b in zip(state, before):
        assert_bitwise(a, b)


def _free_bytes():
    free, _ = torch.cuda.mem_get_info()
    return free


@pytest.mark.slow
def test_more_than_2_to_31_elements():
    n = 2**31 + 5
    idx = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, n - 1])
    if _free_bytes() < 16 * n + 2**30:  # fp32 master/m/v, bf16 grad and param_out
        pytest.skip("needs ~35 GB of free GPU memory")
    master = torch.zeros(n, device="cuda")
    exp_avg = torch.zeros(n, device="cuda")
    exp_avg_sq = torch.zeros(n, device="cuda")
    grad = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    vals = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0])
    master[idx.cuda()] = vals.cuda()
    grad[idx.cuda()] = (vals / 8).to(torch.bfloat16).cuda()
    ref = [vals.clone(), (vals / 8).to(torch.bfloat16), torch.zeros(6), torch.zeros(6)]
    ops.fused_adamw_(master, grad, exp_avg, exp_avg_sq, **HP, param_out=out)
    ops.fused_adamw_(*ref, **HP)
    for got, want in ((master, ref[0]), (exp_avg, ref[2]), (exp_avg_sq, ref[3])):
        torch.testing.assert_close(got[idx.cuda()].cpu(), want, rtol=1e-6, atol=0)
    assert_bitwise(out[idx.cuda()], master[idx.cuda()].to(torch.bfloat16))
    del master, exp_avg, exp_avg_sq, out
    # sum_squares: only the elements past 2^31 are nonzero, so a 32-bit index would miss them.
    grad.zero_()
    grad[2**31] = 3.0
    grad[n - 1] = 4.0
    s, flag = ops.sum_squares(grad)
    assert s.item() == 25.0 and flag.item() == 0.0
