"""zero_ext.ops.flatten_ / unflatten_: bitwise against `(t.float() * scale).to(dtype)`."""

import pytest
import torch

from zero_ext import ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SIZES = [0, 1, 7, 97, 1025, 2**20 + 3]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _layout(sizes, gap=3):
    """Offsets of tensors of `sizes` packed into a flat buffer with `gap` unused elements around each."""
    offsets, end = [], gap
    for n in sizes:
        offsets.append(end)
        end += n + gap
    return offsets, end


def _tensors(device, sizes):
    return [torch.randn(n, device=device).to(DTYPES[i % 3]) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
@pytest.mark.parametrize("flat_dtype", [torch.bfloat16, torch.float32])
def test_round_trip_mixed_dtypes(device, flat_dtype, scale):
    sizes = SIZES + [5, 2**16 + 1]
    tensors = _tensors(device, sizes)
    offsets, total = _layout(sizes)
    flat = torch.full((total,), 7.0, dtype=flat_dtype, device=device)
    ops.flatten_(flat, tensors, offsets, scale=scale)
    expected = torch.full((total,), 7.0, dtype=flat_dtype, device=device)
    for t, off in zip(tensors, offsets):
        expected[off : off + t.numel()] = (t.float() * scale).to(flat_dtype)
    assert torch.equal(_bits(flat), _bits(expected)), "flatten_ differs from the torch reference"

    outs = [torch.empty_like(t) for t in tensors]
    ops.unflatten_(flat, outs, offsets, scale=1.0 / scale)
    for out, off in zip(outs, offsets):
        ref = (flat[off : off + out.numel()].float() * (1.0 / scale)).to(out.dtype)
        assert torch.equal(_bits(out), _bits(ref)), f"unflatten_ differs for {out.dtype}"
    if scale == 1.0 and flat_dtype == torch.float32:  # fp32 holds bf16/fp16/fp32 exactly
        for out, t in zip(outs, tensors):
            assert torch.equal(_bits(out), _bits(t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_one_same_dtype_copies_bits(device, dtype):
    n = 2**16 + 7
    src = torch.randint(0, 2**15, (n,), dtype=torch.int16, device=device)
    src = (
        src.view(dtype)
        if dtype != torch.float32
        else torch.randint(0, 2**31 - 1, (n,), device=device).int().view(dtype)
    )
    flat = torch.zeros(n + 1, dtype=dtype, device=device)
    ops.flatten_(flat, [src], [1])
    assert torch.equal(_bits(flat[1:]), _bits(src))  # NaN payloads and all
    back = torch.zeros_like(src)
    ops.unflatten_(flat, [back], [1])
    assert torch.equal(_bits(back), _bits(src))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_list_and_empty_tensors(device):
    flat = torch.arange(10, dtype=torch.float32, device=device)
    before = flat.clone()
    ops.flatten_(flat, [], [])
    ops.unflatten_(flat, [], [])
    ops.flatten_(flat, [torch.empty(0, device=device), torch.empty(0, dtype=torch.bfloat16, device=device)], [10, 0])
    ops.flatten_(torch.empty(0, device=device), [torch.empty(0, device=device)], [0])
    assert torch.equal(flat, before)


@pytest.mark.parametrize(
    "sizes,offsets,match",
    [
        ([4, 4], [0, 3], "overlap"),
        ([4, 4], [4, 1], "overlap"),
        ([4], [7], "does not fit"),
        ([4], [-1], "does not fit"),
        ([4, 4], [0], "offsets"),
    ],
)
def test_bad_offsets_rejected_and_nothing_written(sizes, offsets, match):
    flat = torch.zeros(10)
    tensors = [torch.ones(n) for n in sizes]
    with pytest.raises(RuntimeError, match=match):
        ops.flatten_(flat, tensors, offsets)
    assert torch.equal(flat, torch.zeros(10))


def test_bad_tensors_rejected_and_nothing_written():
    flat = torch.zeros(10)
    cases = [
        ([torch.ones(4), torch.ones(4, dtype=torch.int32)], "tensors\\[1\\]"),
        ([torch.ones(8)[::2]], "tensors\\[0\\]"),
        ([torch.ones(4, dtype=torch.float64)], "tensors\\[0\\]"),
    ]
    for tensors, match in cases:
        with pytest.raises(RuntimeError, match=match):
            ops.flatten_(flat, tensors, [0] * len(tensors))
    with pytest.raises(RuntimeError, match="`flat`"):
        ops.flatten_(torch.zeros(20)[::2], [torch.ones(4)], [0])
    outs = [torch.full((4,), 5.0), torch.full((4,), 5.0)]
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.unflatten_(flat, outs, [0, 8])
    assert torch.equal(flat, torch.zeros(10))
    assert all(torch.equal(o, torch.full((4,), 5.0)) for o in outs)


def test_unflatten_overlapping_reads_allowed():
    flat = torch.arange(6, dtype=torch.float32)
    a, b = torch.empty(4), torch.empty(4)
    ops.unflatten_(flat, [a, b], [0, 2])
    assert torch.equal(a, flat[:4]) and torch.equal(b, flat[2:])


def test_threads_do_not_change_the_result():
    sizes = [3, 2**18 + 1, 9, 2**17 + 5]
    tensors = _tensors("cpu", sizes)
    offsets, total = _layout(sizes)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            flat = torch.zeros(total, dtype=torch.bfloat16)
            ops.flatten_(flat, tensors, offsets, scale=0.3)
            results.append(flat)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(results[0]), _bits(results[1]))
