"""torch.library.opcheck on every zero_ext op: schema (mutations declared), fake impls, autograd
registration and AOT dispatch, so torch.compile can trace code that calls them."""

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
@pytest.mark.parametrize("variant", ["plain", "param_out", "found_inf", "tensor_scalars", "everything"])
def test_fused_adamw_opcheck(device, variant):
    kwargs = dict(SCALARS)
    if variant in ("param_out", "everything"):
        kwargs["param_out"] = torch.empty(97, device=device, dtype=torch.bfloat16)
    if variant in ("found_inf", "everything"):
        kwargs["found_inf"] = torch.zeros((), device=device)
    if variant in ("tensor_scalars", "everything"):
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step"):
            kwargs[f"{name}_tensor"] = torch.tensor(kwargs[name], device=device)
        kwargs["grad_scale_tensor"] = torch.tensor(0.5, device=device)
    torch.library.opcheck(ADAMW, _adamw_args(device), kwargs)


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
