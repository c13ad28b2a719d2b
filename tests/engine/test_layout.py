"""The flat-buffer layout: buckets, padding, shard ownership."""

from hypothesis import given, settings
from hypothesis import strategies as st

from zero_ext.layout import BUCKET_ALIGN, PARAM_ALIGN, Layout


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
    world=st.integers(1, 8),
    bucket_size=st.integers(1, 20000),
)
def test_layout_invariants(numels, world, bucket_size):
    layout = Layout(numels, world, bucket_size)
    # Buckets tile the flat buffer, each padded to a multiple of world * 64.
    offset, shard_offset = 0, 0
    for b in layout.buckets:
        assert b.offset == offset and b.numel % (world * BUCKET_ALIGN) == 0 and b.numel > 0
        assert b.shard_numel * world == b.numel and b.shard_offset == shard_offset
        offset += b.numel
        shard_offset += b.shard_numel
        # No bucket is larger than bucket_size in whole granules, whatever the parameters (bounded by bytes).
        assert b.numel <= max(world * BUCKET_ALIGN, -(-bucket_size // (world * BUCKET_ALIGN)) * world * BUCKET_ALIGN)
        # Only a parameter larger than bucket_size is split, and its buckets hold nothing else.
        split = [i for i in b.slots if layout.slots[i].split]
        assert all(numels[i] > bucket_size for i in split) and (not split or b.slots == tuple(split[:1]))
    assert layout.numel == offset and layout.shard_numel == shard_offset
    # Parameters: reverse registration order, aligned, inside their buckets, never overlapping.
    order = list(dict.fromkeys(i for b in layout.buckets for i in b.slots))
    assert order == list(reversed(range(len(numels))))
    ends = 0
    for i in order:
        s = layout.slots[i]
        first, last = layout.buckets[s.bucket], layout.buckets[s.last_bucket]
        assert (s.offset - first.offset) % PARAM_ALIGN == 0 and s.offset >= ends
        assert first.offset <= s.offset and s.offset + s.numel <= last.offset + last.numel
        assert all(i in layout.buckets[b].slots for b in s.buckets)
        # Its fragments tile it, in bucket order, each inside its bucket.
        frags = [layout.buckets[b].fragment_range(s) for b in s.buckets]
        assert frags[0].start == 0 and frags[-1].end == s.numel and all(f.numel for f in frags)
        assert all(a.end == b.start for a, b in zip(frags, frags[1:]))
        for b in s.buckets:
            at = layout.buckets[b].slot_range(s)
            assert 0 <= at.start and at.end <= layout.buckets[b].numel
            assert at.numel == layout.buckets[b].fragment_range(s).numel
        # A run is one split parameter's buckets, or one bucket; the parameter lies inside its run.
        run = layout.runs[layout.run_of[s.bucket]]
        assert list(run.buckets) == list(s.buckets) or not s.split
        assert 0 <= run.slot_range(s).start and run.slot_range(s).end <= run.numel
        ends = s.offset + s.numel
    assert [b for r in layout.runs for b in r.buckets] == list(range(len(layout.buckets)))
    # Every element of every parameter is owned by exactly one rank.
    owned = {i: [] for i in range(len(numels))}
    for rank in range(world):
        pieces = layout.owned_pieces(rank)
        assert sum(p.end - p.start for p in pieces) == layout.owned_real_numel(rank)
        for p in pieces:
            assert 0 <= p.shard_offset and p.shard_offset + (p.end - p.start) <= layout.shard_numel
            owned[p.index].append((p.start, p.end))
    for i, runs in owned.items():
        runs.sort()
        assert runs[0][0] == 0 and runs[-1][1] == numels[i]
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


def test_a_parameter_larger_than_a_bucket_is_split_into_bucket_sized_fragments():
    layout = Layout([10, 100_000, 10], world_size=3, bucket_size=1000)
    # 100_000 elements in fragments of 960 (the most whole 3 * 64 granules in 1000): 104 full buckets and a tail
    # of 160 elements padded to 192; the small parameters on either side in buckets of their own.
    assert layout.fragment_numel == 960
    assert [b.slots for b in layout.buckets] == [(2,)] + [(1,)] * 105 + [(0,)]
    assert [b.numel for b in layout.buckets[1:106]] == [960] * 104 + [192]
    big = layout.slots[1]
    assert (big.bucket, big.last_bucket, big.offset) == (1, 105, 192)
    assert layout.buckets[2].fragment_range(big) == (960, 1920) and layout.buckets[2].slot_range(big) == (0, 960)
    assert [(r.first, r.last) for r in layout.runs] == [(0, 0), (1, 105), (106, 106)]
    assert layout.runs[1].numel == 104 * 960 + 192
    # A rank owns one piece of it per bucket: slice r of each.
    pieces = [p for p in layout.owned_pieces(1) if p.index == 1]
    assert len(pieces) == 105 and pieces[0].param_range == (320, 640) and pieces[1].param_range == (1280, 1600)


def test_one_bucket_larger_than_every_parameter_splits_nothing():
    layout = Layout([10, 100_000, 10], world_size=3, bucket_size=200_000)
    assert [b.slots for b in layout.buckets] == [(2, 1, 0)] and not any(s.split for s in layout.slots)
