"""OwnerLayout (zero_ext/owner_layout.py): every parameter whole inside one rank's slice, slices even, owners
deterministic and balanced by cost; the disk placement's chunks of such a shard (placement/disk.py) cut only at
parameters and tile the shard; Newton-Schulz and the learning-rate adjustment bitwise torch.optim.Muon's."""

import random

import pytest
import torch
import torch.optim._muon as torch_muon

from zero_ext.layout import Layout
from zero_ext.owner_layout import OwnerLayout, newton_schulz_cost
from zero_ext.placement.disk import parameter_chunks
from zero_ext.update.muon import Muon, adjusted_lr, newton_schulz

GPT_SHAPES = [(37, 24)] + [(72, 24), (24, 24), (93, 24), (24, 93)] * 2 + [(24, 37)]


def shapes_of(seed: int, count: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([1, 3, 17, 64, 100, 257]), rng.choice([1, 5, 33, 64, 200])) for _ in range(count)]


def layouts():
    for seed in range(6):
        shapes = shapes_of(seed, 1 + seed * 5)
        for world in (1, 2, 3, 4, 8):
            for bucket in (100, 1500, 10**6):
                for align in (None, 1024):
                    numels = [a * b for a, b in shapes]
                    costs = [newton_schulz_cost(s) for s in shapes]
                    yield shapes, OwnerLayout(numels, world, bucket, costs=costs, slot_align=align)


def test_every_parameter_is_whole_inside_one_rank_slice():
    count = 0
    for shapes, layout in layouts():
        count += 1
        seen = set()
        for rank in range(layout.world_size):
            for piece in layout.owned_pieces(rank):
                assert piece.start == 0 and piece.end == layout.numels[piece.index], "a parameter is cut"
                assert layout.owners[piece.index] == rank
                seen.add(piece.index)
        assert seen == set(range(len(shapes)))
        for b in layout.buckets:
            assert b.numel == b.shard_numel * layout.world_size and b.shard_numel % 64 == 0
            for i in b.slots:
                slot = layout.slots[i]
                r = layout.owners[i]
                inside = b.rank_range(r)
                assert inside.start <= slot.offset and slot.offset + slot.numel <= inside.end
                assert slot.offset % layout.slot_align == 0
        assert layout.numel == sum(b.numel for b in layout.buckets)
        assert layout.bucket_limit >= max(b.numel for b in layout.buckets)
        assert all(len(layout.runs[layout.run_of[b.index]].slots) == len(b.slots) for b in layout.buckets)
    assert count == 6 * 5 * 3 * 2


def test_slots_do_not_overlap():
    for _, layout in layouts():
        spans = sorted((s.offset, s.offset + s.numel) for s in layout.slots)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_owners_are_deterministic_and_balanced_on_a_transformer():
    numels = [a * b for a, b in GPT_SHAPES * 4]
    costs = [newton_schulz_cost(s) for s in GPT_SHAPES * 4]
    for world in (2, 3, 4):
        a = OwnerLayout(numels, world, 10**6, costs=costs)
        b = OwnerLayout(numels, world, 10**6, costs=costs)
        assert a.owners == b.owners
        assert sum(a.rank_costs) == sum(costs)
        assert a.balance() < 1.15, (world, a.rank_costs)
        # the padding that evens the slices: a few percent of the parameters with buckets of whole blocks
        assert a.numel <= 1.1 * sum(numels) + world * 64 * len(a.buckets)


def test_a_matrix_larger_than_a_slice_shares_its_bucket_with_equal_ones():
    numels = [4096] * 4
    layout = OwnerLayout(numels, 4, 1024)
    assert len(layout.buckets) == 1 and layout.buckets[0].shard_numel == 4096
    assert sorted(layout.owners) == [0, 1, 2, 3]


def test_cost_breaks_ties_between_equal_slices():
    # equal sizes, different costs: the costly ones spread over ranks
    numels = [64] * 8
    costs = [100, 1, 100, 1, 100, 1, 100, 1]
    layout = OwnerLayout(numels, 2, 64, costs=costs)
    assert layout.rank_costs == (202, 202)


def test_one_rank_matches_the_element_layout_shard_size():
    numels = [a * b for a, b in GPT_SHAPES]
    owner = OwnerLayout(numels, 1, 10**6)
    plain = Layout(numels, 1, 10**6)
    assert owner.real_numel == plain.real_numel
    assert owner.canonical == plain.canonical


@pytest.mark.parametrize("chunk", [1024, 2048, 5000, 10**6])
def test_disk_chunks_cut_only_at_parameters(chunk):
    for _, layout in layouts():
        if layout.slot_align != 1024:
            continue
        for rank in range(layout.world_size):
            chunks = parameter_chunks(layout, rank, chunk)
            if layout.shard_numel == 0:
                assert chunks == []
                continue
            assert chunks[0].start == 0 and chunks[-1].end == layout.shard_numel
            assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
            for piece in layout.owned_pieces(rank):
                r = piece.shard_range
                assert sum(1 for c in chunks if c.intersect(r).numel) == 1, "a parameter is cut"
            for c in chunks:
                assert c.start % 1024 == 0
                inside = [p.shard_range for p in layout.owned_pieces(rank) if c.intersect(p.shard_range).numel]
                # what the update reads is at most a chunk (or one parameter); padding may follow the last one
                assert not inside or max(r.end for r in inside) - c.start <= chunk or len(inside) == 1


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (7, 3), (64, 64), (100, 33), (33, 257), (257, 100)])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_newton_schulz_is_torch_muons_bitwise(shape, steps):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    grad = torch.randn(shape, generator=g)
    coefficients = (3.4445, -4.775, 2.0315)
    ours = newton_schulz(grad, coefficients, steps, 1e-7)
    theirs = torch_muon._zeropower_via_newtonschulz(grad, coefficients, steps, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(3, 7), (7, 3), (64, 64), (1000, 10)])
def test_adjusted_lr_is_torch_muons(fn, shape):
    assert adjusted_lr(0.02, fn, torch.Size(shape)) == torch_muon._adjust_lr(0.02, fn, torch.Size(shape))


def test_muon_refuses_what_torch_refuses():
    rule = Muon(torch.float32)
    for shape in [(3,), (2, 3, 4), ()]:
        with pytest.raises(ValueError, match=r"'w'.*2-D"):
            rule.check_shape("param group 0", "w", shape)
    good = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4, -4.7, 2.0),
                eps=1e-7, ns_steps=5, adjust_lr_fn=None)  # fmt: skip
    rule.check_group("g", good)
    for key, bad in [("lr", -1.0), ("momentum", "x"), ("nesterov", 1), ("ns_steps", 100), ("ns_steps", 2.5),
                     ("ns_coefficients", (1, 2)), ("adjust_lr_fn", "cosine"), ("weight_decay", -0.1)]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            rule.check_group("g", {**good, key: bad})
