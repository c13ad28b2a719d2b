"""zero_ext.ops.sum_squares: fp32 sum of squares vs an fp64 reference, nonfinite flag, determinism."""

import pytest
import torch

from zero_ext import ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SIZES = [0, 1, 7, 97, 1025, 2**20 + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_fp64_reference(device, n, dtype):
    x = torch.randn(n, device=device).to(dtype)
    sumsq, nonfinite = ops.sum_squares(x)
    assert sumsq.shape == () and sumsq.dtype == torch.float32 and sumsq.device == x.device
    assert nonfinite.shape == () and nonfinite.dtype == torch.float32
    expected = x.double().square().sum().float()
    torch.testing.assert_close(sumsq, expected, rtol=1e-5, atol=0.0)
    assert nonfinite.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [1, 1025, 2**20 + 3])
def test_nonfinite_flag(device, n, where, value, dtype):
    x = torch.randn(n, device=device).to(dtype)
    x[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = value
    _, nonfinite = ops.sum_squares(x)
    assert nonfinite.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_overflowing_square_is_not_nonfinite(device):
    x = torch.full((4096,), 1e30, device=device)
    sumsq, nonfinite = ops.sum_squares(x)
    assert sumsq.item() == float("inf")
    assert nonfinite.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_thread_counts(dtype):
    x = torch.randn(3 * 2**20 + 11).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            results.append(ops.sum_squares(x)[0])
    finally:
        torch.set_num_threads(threads)
    bits = {r.view(torch.int32).item() for r in results}
    assert len(bits) == 1, f"sum depends on the thread count: {[r.item() for r in results]}"


def test_rejects_bad_input():
    with pytest.raises(RuntimeError, match="`x`"):
        ops.sum_squares(torch.ones(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="`x`"):
        ops.sum_squares(torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="`x`"):
        ops.sum_squares(torch.ones(8)[::2])
