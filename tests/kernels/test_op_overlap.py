"""Memory-overlap checks of fused_adamw_, flatten_ and unflatten_, property-tested.

Every tensor is a view at a random byte offset into ONE shared storage (the arena). Whenever a range an op writes
shares a byte with any other argument's range, the call must fail with a message naming both arguments and leave
the arena bitwise unchanged; otherwise it must run and leave the arena exactly as the op run on independent
copies would. The rules (csrc/torch/checks.h, check_no_overlap):
  fused_adamw_: no two of master, grad, exp_avg, exp_avg_sq, param_out share a byte;
  flatten_:     the destination ranges in flat share no byte with each other or with any of `tensors`;
  unflatten_:   the outputs share no byte with each other or with flat.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zero_ext import ops

ARENA = 256  # bytes
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2)
SETTINGS = settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGE = re.compile(r"^zero_ext\.\w+: (.+?) and (.+?) overlap in memory", re.M)


def arena(seed: int) -> torch.Tensor:
    """Random bytes in which every aligned fp32, bf16 and fp16 element is a finite normal number: each 16-bit
    half-word has the exponent bits 0b01111 (fp16: [1, 2)), which bf16 reads as an exponent in [2^-7, 1) and which,
    as the upper half of an fp32 word, gives that word the same exponent. No NaN can make bits ambiguous."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, 1 << 10, (ARENA // 2,), generator=g) | (0b01111 << 10)
    half |= torch.randint(0, 2, (ARENA // 2,), generator=g) << 15
    return torch.where(half >= 1 << 15, half - (1 << 16), half).to(torch.int16).view(torch.uint8)


def view(storage: torch.Tensor, byte_offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return storage[byte_offset : byte_offset + numel * dtype.itemsize].view(dtype)


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def conflicts(writes: dict, reads: dict) -> set:
    """The unordered name pairs the op must refuse: a write against any other range."""
    found = set()
    items = list(writes.items())
    for i, (a, ra) in enumerate(items):
        for b, rb in items[i + 1 :] + list(reads.items()):
            if overlaps(ra, rb):
                found.add(frozenset((a, b)))
    return found


def assert_rejected(call, pairs: set, storage: torch.Tensor) -> None:
    before = storage.clone()
    with pytest.raises(RuntimeError, match="overlap in memory") as err:
        call()
    named = MESSAGE.search(str(err.value))
    assert named is not None, str(err.value)
    assert frozenset(named.groups()) in pairs, f"{named.groups()} is not an overlapping pair of {pairs}"
    assert torch.equal(storage, before), "a rejected call modified memory"


def place(draw, lengths: dict, align: dict) -> dict:
    """Byte offsets in the arena: packed (disjoint by construction, random order, gaps possibly zero so ranges
    touch) or anywhere (overlapping or not, as it falls)."""
    if draw(st.booleans()):
        offsets, pos = {}, 0
        for name in draw(st.permutations(list(lengths))):
            pos += 2 * draw(st.integers(0, 2))
            pos = -(-pos // align[name]) * align[name]
            offsets[name] = pos
            pos += lengths[name]
        assert pos <= ARENA
        return offsets
    span = draw(st.integers(max(lengths.values()), ARENA))  # a small span makes overlaps likely
    return {name: align[name] * draw(st.integers(0, (span - lengths[name]) // align[name])) for name in lengths}


# ----------------------------------------------------------------------------------------------------- fused_adamw_
ADAMW_WRITES = ("master", "exp_avg", "exp_avg_sq", "param_out")


@st.composite
def adamw_layouts(draw):
    n = draw(st.integers(0, 8))
    dtypes = {"master": torch.float32, "grad": draw(st.sampled_from(FLOATS)), "exp_avg": torch.float32}
    dtypes["exp_avg_sq"] = torch.float32
    out = draw(st.sampled_from([None, torch.bfloat16, torch.float16]))
    if out is not None:
        dtypes["param_out"] = out
    offsets = place(draw, {k: n * d.itemsize for k, d in dtypes.items()}, {k: d.itemsize for k, d in dtypes.items()})
    return n, dtypes, offsets, draw(st.integers(0, 2**31))


def _adamw(t: dict) -> None:
    ops.fused_adamw_(
        t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], param_out=t.get("param_out"), **HYPER
    )  # fmt: skip


@SETTINGS
@given(adamw_layouts())
def test_fused_adamw_overlap_property(layout):
    n, dtypes, offsets, seed = layout
    storage = arena(seed)
    t = {k: view(storage, offsets[k], n, d) for k, d in dtypes.items()}
    t["exp_avg_sq"].abs_()  # a second moment is >= 0 (else sqrt gives NaN)
    ranges = {f"`{k}`": (offsets[k], offsets[k] + n * d.itemsize) for k, d in dtypes.items()}
    pairs = conflicts({f"`{k}`": ranges[f"`{k}`"] for k in ADAMW_WRITES if k in t}, {"`grad`": ranges["`grad`"]})
    event("rejected" if pairs else "ran")
    if pairs:
        assert_rejected(lambda: _adamw(t), pairs, storage)
        return
    copies = {k: v.clone() for k, v in t.items()}  # independent storages: the reference
    _adamw(copies)
    expected = storage.clone()
    for k in ADAMW_WRITES:
        if k in t:
            view(expected, offsets[k], n, dtypes[k]).copy_(copies[k])
    _adamw(t)
    assert torch.equal(storage, expected)


# ------------------------------------------------------------------------------------------- flatten_ / unflatten_
@st.composite
def flatten_layouts(draw):
    flat_dtype, k = draw(st.sampled_from(FLOATS)), draw(st.integers(1, 3))
    dtypes = [draw(st.sampled_from(FLOATS)) for _ in range(k)]
    if draw(st.booleans()):  # destination ranges disjoint by construction
        sizes, flat_offsets, pos = [], [], 0
        for _ in range(k):
            pos += draw(st.integers(0, 2))
            sizes.append(draw(st.integers(0, 4)))
            flat_offsets.append(pos)
            pos += sizes[-1]
        flat_numel = pos + draw(st.integers(0, 2))
    else:
        flat_numel = draw(st.integers(0, 12))
        sizes = [draw(st.integers(0, flat_numel)) for _ in range(k)]
        flat_offsets = [draw(st.integers(0, flat_numel - n)) for n in sizes]
    names = ["flat"] + [f"tensors[{i}]" for i in range(k)]
    all_dtypes = dict(zip(names, [flat_dtype] + dtypes))
    numels = dict(zip(names, [flat_numel] + sizes))
    offsets = place(draw, {m: numels[m] * all_dtypes[m].itemsize for m in names},
                    {m: all_dtypes[m].itemsize for m in names})  # fmt: skip
    return all_dtypes, numels, offsets, flat_offsets, draw(st.sampled_from([1.0, 0.5, 3.0])), draw(st.integers(0, 99))


def _views(storage, dtypes, numels, offsets):
    flat = view(storage, offsets["flat"], numels["flat"], dtypes["flat"])
    tensors = [view(storage, offsets[m], numels[m], dtypes[m]) for m in dtypes if m != "flat"]
    return flat, tensors


def _byte_range(offsets, dtypes, numels, name):
    return offsets[name], offsets[name] + numels[name] * dtypes[name].itemsize


@SETTINGS
@given(flatten_layouts())
def test_flatten_overlap_property(layout):
    dtypes, numels, offsets, flat_offsets, scale, seed = layout
    storage = arena(seed)
    flat, tensors = _views(storage, dtypes, numels, offsets)
    es = dtypes["flat"].itemsize
    writes = {
        f"`flat` (the range of `tensors[{i}]`)": (offsets["flat"] + o * es, offsets["flat"] + (o + t.numel()) * es)
        for i, (t, o) in enumerate(zip(tensors, flat_offsets))
    }
    reads = {f"`tensors[{i}]`": _byte_range(offsets, dtypes, numels, f"tensors[{i}]") for i in range(len(tensors))}
    pairs = conflicts(writes, reads)
    call = lambda: ops.flatten_(flat, tensors, flat_offsets, scale)  # noqa: E731
    event("rejected" if pairs else "ran")
    if pairs:
        assert_rejected(call, pairs, storage)
        return
    expected = storage.clone()
    expected_flat, _ = _views(expected, dtypes, numels, offsets)
    for t, o in zip(tensors, flat_offsets):
        expected_flat[o : o + t.numel()] = (t.float() * scale).to(flat.dtype)
    call()
    assert torch.equal(storage, expected)


@SETTINGS
@given(flatten_layouts())
def test_unflatten_overlap_property(layout):
    dtypes, numels, offsets, flat_offsets, scale, seed = layout
    storage = arena(seed)
    flat, tensors = _views(storage, dtypes, numels, offsets)
    writes = {f"`tensors[{i}]`": _byte_range(offsets, dtypes, numels, f"tensors[{i}]") for i in range(len(tensors))}
    pairs = conflicts(writes, {"`flat`": _byte_range(offsets, dtypes, numels, "flat")})
    call = lambda: ops.unflatten_(flat, tensors, flat_offsets, scale)  # noqa: E731
    event("rejected" if pairs else "ran")
    if pairs:
        assert_rejected(call, pairs, storage)
        return
    expected = storage.clone()
    expected_flat, expected_tensors = _views(expected, dtypes, numels, offsets)
    for t, o in zip(expected_tensors, flat_offsets):
        t.copy_((expected_flat[o : o + t.numel()].float() * scale).to(t.dtype))
    call()
    assert torch.equal(storage, expected)


# ------------------------------------------------------------------------------------------------ named examples
def test_param_out_partly_over_master_is_rejected():
    """The issue's case: a bf16 param_out whose bytes start in the middle of master."""
    storage = arena(0)
    master, grad = view(storage, 0, 8, torch.float32), view(storage, 200, 8, torch.bfloat16)
    exp_avg, exp_avg_sq = view(storage, 64, 8, torch.float32), view(storage, 96, 8, torch.float32)
    out = view(storage, 16, 8, torch.bfloat16)  # bytes [16, 32) inside master's [0, 32)
    t = dict(master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq.abs_(), param_out=out)
    assert_rejected(lambda: _adamw(t), {frozenset(("`master`", "`param_out`"))}, storage)


def test_touching_ranges_are_not_overlapping():
    storage = arena(1)
    t = {k: view(storage, 32 * i, 8, torch.float32) for i, k in enumerate(("master", "grad", "exp_avg", "exp_avg_sq"))}
    t["exp_avg_sq"].abs_()
    t["param_out"] = view(storage, 128, 8, torch.bfloat16)
    _adamw(t)  # runs
    flat = view(storage, 144, 16, torch.bfloat16)  # bytes [144, 176)
    ops.flatten_(flat, [t["grad"], t["master"]], [0, 8])
    ops.unflatten_(flat, [view(storage, 176, 4, torch.float32), view(storage, 192, 4, torch.bfloat16)], [0, 4])


def test_flatten_source_outside_its_destination_may_be_in_flat():
    """flatten_ reads its sources before nothing else writes there: a source inside flat but outside every
    destination range is fine; unflatten_ is strict: no output may touch flat at all."""
    flat = torch.arange(12, dtype=torch.float32)
    ops.flatten_(flat, [flat[8:12]], [0])
    assert flat[:4].tolist() == [8.0, 9.0, 10.0, 11.0]
    with pytest.raises(RuntimeError, match=r"`tensors\[0\]` and `flat` overlap in memory"):
        ops.unflatten_(flat, [flat[8:12]], [0])
