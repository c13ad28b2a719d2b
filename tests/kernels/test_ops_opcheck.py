"""torch.library.opcheck on every zero_ext op: schema (mutations declared), fake impls, autograd
registration and AOT dispatch, so torch.compile can trace code that calls them.

The C++ ops (fused_adamw_, flatten_, unflatten_, sum_squares) and the Triton ops (cast_scale, cast_scale_into,
accumulate_). Inputs are finite: opcheck compares outputs, and NaN != NaN."""

import pytest
import torch

import zero_ext.ops  # noqa: F401  (registers torch.ops.zero_ext.*)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ADAMW = torch.ops.zero_ext.fused_adamw_.default
SCALARS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3.0)


def _adamw_args(device, n=97):
    master, exp_avg = torch.randn(n, device=device), torch.randn(n, device=device) * 0.1
    exp_avg_sq = torch.rand(n, device=device) * 0.01
    grad = torch.randn(n, device=device, dtype=torch.bfloat16)
    return (master, grad, exp_avg, exp_avg_sq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "variant", ["plain", "param_out", "found_inf", "tensor_scalars", "amsgrad", "maximize", "everything"]
)
def test_fused_adamw_opcheck(device, variant):
    kwargs = dict(SCALARS)
    if variant in ("param_out", "everything"):
        kwargs["param_out"] = torch.empty(97, device=device, dtype=torch.bfloat16)
    if variant in ("amsgrad", "everything"):  # a fourth mutated tensor, Tensor(e!)? in the schema
        kwargs["max_exp_avg_sq"] = torch.rand(97, device=device) * 0.01
    if variant in ("maximize", "everything"):
        kwargs["maximize"] = True
    if variant in ("found_inf", "everything"):
        kwargs["found_inf"] = torch.zeros((), device=device)
    if variant in ("tensor_scalars", "everything"):
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step"):
            kwargs[f"{name}_tensor"] = torch.tensor(kwargs[name], device=device)
        kwargs["grad_scale_tensor"] = torch.tensor(0.5, device=device)
    torch.library.opcheck(ADAMW, _adamw_args(device), kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["plain", "amsgrad_found_inf"])
def test_fused_adamw_remainder_opcheck(device, variant):
    """param_remainders' mode: `master` is the bf16 parameter, `remainder` (int16) a fifth mutated tensor,
    Tensor(f!)? in the schema."""
    master, grad, exp_avg, exp_avg_sq = _adamw_args(device)
    kwargs = dict(SCALARS, remainder=torch.randint(-(2**15), 2**15, (97,), device=device, dtype=torch.int16))
    if variant == "amsgrad_found_inf":
        kwargs.update(max_exp_avg_sq=torch.rand(97, device=device) * 0.01, found_inf=torch.zeros((), device=device))
    torch.library.opcheck(ADAMW, (master.to(torch.bfloat16), grad, exp_avg, exp_avg_sq), kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "variant", ["bf16_moments", "bf16_moments_amsgrad_param_out", "bf16_moments_remainder", "tensor_step_offset"]
)
def test_fused_adamw_bf16_moments_opcheck(device, variant):
    """bf16 moments (moment_dtype=torch.bfloat16): exp_avg, exp_avg_sq (and max_exp_avg_sq) in bf16, with the new
    int arguments rounding_seed and element_offset (past 2^32: int64 in the schema)."""
    master, grad, exp_avg, exp_avg_sq = _adamw_args(device)
    kwargs = dict(SCALARS, rounding_seed=-12345, element_offset=2**32 + 5)
    if variant == "bf16_moments_amsgrad_param_out":
        kwargs.update(max_exp_avg_sq=(torch.rand(97, device=device) * 0.01).to(torch.bfloat16), maximize=True,
                      param_out=torch.empty(97, device=device, dtype=torch.bfloat16))  # fmt: skip
    if variant == "bf16_moments_remainder":
        master = master.to(torch.bfloat16)
        kwargs["remainder"] = torch.randint(-(2**15), 2**15, (97,), device=device, dtype=torch.int16)
    if variant == "tensor_step_offset":
        kwargs.update(step_tensor=torch.tensor(7.0, device=device), found_inf=torch.zeros((), device=device))
    moments = (exp_avg.to(torch.bfloat16), exp_avg_sq.to(torch.bfloat16))
    torch.library.opcheck(ADAMW, (master, grad, *moments), kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_fp32_moments_ignore_the_rounding_arguments(device):
    """rounding_seed / element_offset with fp32 moments: accepted, no effect (the same bits as without them)."""
    args = _adamw_args(device)
    twin = [t.clone() for t in args]
    torch.library.opcheck(ADAMW, [t.clone() for t in args], dict(SCALARS, rounding_seed=3, element_offset=10))
    ADAMW(*args, **SCALARS, rounding_seed=3, element_offset=10)
    ADAMW(*twin, **SCALARS)
    assert all(torch.equal(a, b) for a, b in zip(args, twin))


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_opcheck(device):
    tensors = [torch.randn(5, device=device), torch.randn(7, device=device, dtype=torch.float16)]
    flat = torch.zeros(16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.zero_ext.flatten_.default, (flat, tensors, [0, 8], 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_unflatten_opcheck(device):
    tensors = [torch.empty(5, device=device), torch.empty(7, device=device, dtype=torch.bfloat16)]
    flat = torch.randn(16, device=device)
    torch.library.opcheck(torch.ops.zero_ext.unflatten_.default, (flat, tensors, [0, 8], 2.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_opcheck(device, dtype):
    x = torch.randn(1025, device=device).to(dtype)
    torch.library.opcheck(torch.ops.zero_ext.sum_squares.default, (x,))


# ----------------------------------------------------------------------------------------------------- Triton ops
# On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py), where zero_ext.kernels._launch.register_op registers
# each op as an opaque torch.library.custom_op (torch.compile cannot trace the interpreter); the cuda variants check the
# torch.library.triton_op registration that compiled code uses. Same schema, same fake, both checked here.
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SCALES = ["number", "tensor"]


@pytest.fixture
def triton_ops():
    pytest.importorskip("triton")
    import zero_ext.kernels  # noqa: F401  (registers torch.ops.zero_ext.cast_scale / cast_scale_into / accumulate_)


def _scale(kind, device):
    return (0.5, None) if kind == "number" else (1.0, torch.tensor(0.25, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("x_dtype", FLOATS)
def test_cast_scale_into_opcheck(triton_ops, x_dtype, out_dtype, scale_kind, device):
    x = torch.randn(97, device=device).to(x_dtype)
    out = torch.zeros(200, dtype=out_dtype, device=device)[3:100]  # a view at an odd offset, as the engine passes
    torch.library.opcheck(torch.ops.zero_ext.cast_scale_into.default, (x, out, *_scale(scale_kind, device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("x_dtype", FLOATS)
def test_cast_scale_opcheck(triton_ops, x_dtype, out_dtype, scale_kind, device):
    x = torch.randn(7, 13, device=device).to(x_dtype)  # any shape; the result has x's
    torch.library.opcheck(torch.ops.zero_ext.cast_scale.default, (x, *_scale(scale_kind, device), out_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", SCALES)
@pytest.mark.parametrize("x_dtype", FLOATS)
def test_accumulate_opcheck(triton_ops, x_dtype, scale_kind, device):
    acc = torch.randn(1025, device=device)
    x = torch.randn(1025, device=device).to(x_dtype)
    torch.library.opcheck(torch.ops.zero_ext.accumulate_.default, (acc, x, *_scale(scale_kind, device)))
