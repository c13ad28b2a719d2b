"""The CPU side of kernels.dispatch: accumulate_into adds a low-precision gradient into an fp32 accumulator in
blocks (bounded temporaries); the sums must be those of one fp32 add, bitwise, at every size."""

import pytest
import torch

from zero_ext.kernels.dispatch import CPU_BLOCK, accumulate_into


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 1000, CPU_BLOCK - 1, CPU_BLOCK, 2 * CPU_BLOCK + 77])
def test_accumulate_into_matches_one_fp32_add(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    acc = torch.randn(numel, generator=g)
    src = torch.randn(numel, generator=g).mul_(3).to(dtype)
    src2d = src.reshape(1, numel) if numel % 2 else src.reshape(2, numel // 2)  # any shape, same size
    expected = acc + src.float()
    before = acc.data_ptr()
    accumulate_into(acc, src2d)
    assert acc.data_ptr() == before and acc.dtype == torch.float32
    assert torch.equal(acc, expected)
