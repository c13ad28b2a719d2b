"""Device checks: an op called with one tensor on `meta` and the rest on the CPU is routed by the dispatcher to
its fake impl (zero_ext/ops.py, kernels/), which must fail the call with an error naming that argument instead of
returning having done nothing; the CPU tensors stay bitwise unchanged."""

import re

import pytest
import torch

from zero_ext import ops

ADAMW_TENSORS = ("master", "grad", "exp_avg", "exp_avg_sq", "param_out", "found_inf")
ADAMW_SCALARS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "grad_scale")
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0)


def _on(t: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_like(t, device=device) if device == "meta" else t


def _assert_unchanged(tensors, before):
    for t, b in zip(tensors, before):
        if t.device.type != "meta":
            assert torch.equal(t.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("meta_arg", ADAMW_TENSORS + ADAMW_SCALARS)
def test_fused_adamw_meta_argument_rejected(meta_arg):
    n = 33
    args = dict(
        master=torch.randn(n), grad=torch.randn(n).bfloat16(), exp_avg=torch.randn(n), exp_avg_sq=torch.rand(n),
        param_out=torch.zeros(n, dtype=torch.bfloat16), found_inf=torch.zeros(()),
    )  # fmt: skip
    scalars = dict(HYPER)
    if meta_arg in ADAMW_SCALARS:
        scalars[meta_arg] = torch.tensor(float(HYPER[meta_arg]), device="meta")
    else:
        args[meta_arg] = _on(args[meta_arg], "meta")
    tensors = list(args.values())
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=f"`{meta_arg}`"):
        ops.fused_adamw_(*tensors[:4], param_out=args["param_out"], found_inf=args["found_inf"], **scalars)
    _assert_unchanged(tensors, before)


@pytest.mark.parametrize("op", ["flatten_", "unflatten_"])
@pytest.mark.parametrize("meta_arg", ["flat", "tensors[0]", "tensors[1]"])
def test_flatten_meta_argument_rejected(op, meta_arg):
    flat = torch.randn(16)
    tensors = [torch.randn(5), torch.randn(7).half()]
    if meta_arg == "flat":
        flat = _on(flat, "meta")
    else:
        i = int(meta_arg[-2])
        tensors[i] = _on(tensors[i], "meta")
    before = [t.clone() for t in [flat, *tensors]]
    with pytest.raises(RuntimeError, match=re.escape(f"`{meta_arg}`")):
        getattr(ops, op)(flat, tensors, [0, 8])
    _assert_unchanged([flat, *tensors], before)


def test_sum_squares_on_meta_is_a_shape_computation():
    """One tensor argument, so nothing to mix: a meta `x` gives meta outputs (the fake), a CPU `x` real ones."""
    sumsq, nonfinite = ops.sum_squares(torch.ones(5, device="meta"))
    for t in (sumsq, nonfinite):
        assert t.device.type == "meta" and t.shape == () and t.dtype == torch.float32
    assert ops.sum_squares(torch.ones(5))[0].item() == 5.0
    with pytest.raises(RuntimeError, match="`x`"):
        ops.sum_squares(torch.ones(5, dtype=torch.int32, device="meta"))


# The Triton ops as registered (the public launchers check devices themselves before calling them).
@pytest.mark.parametrize(
    "op,make,meta_index,name",
    [
        ("cast_scale_into", lambda: [torch.randn(9), torch.zeros(9), 0.5, None], 0, "x"),
        ("cast_scale_into", lambda: [torch.randn(9), torch.zeros(9), 0.5, None], 1, "out"),
        ("cast_scale_into", lambda: [torch.randn(9), torch.zeros(9), 1.0, torch.tensor(2.0)], 3, "scale_tensor"),
        ("cast_scale", lambda: [torch.randn(9), 1.0, torch.tensor(2.0), torch.bfloat16], 2, "scale_tensor"),
        ("accumulate_", lambda: [torch.zeros(9), torch.randn(9), 0.5, None], 0, "acc"),
        ("accumulate_", lambda: [torch.zeros(9), torch.randn(9), 0.5, None], 1, "x"),
        ("accumulate_", lambda: [torch.zeros(9), torch.randn(9), 1.0, torch.tensor(2.0)], 3, "scale_tensor"),
    ],
)
def test_triton_op_meta_argument_rejected(op, make, meta_index, name):
    pytest.importorskip("triton")
    import zero_ext.kernels  # noqa: F401  (registers the ops)

    args = make()
    args[meta_index] = _on(args[meta_index], "meta")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=f"`{name}`"):
        getattr(torch.ops.zero_ext, op)(*args)
    _assert_unchanged(tensors, before)
