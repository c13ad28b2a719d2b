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
        # A bucket exceeds bucket_size only when it holds one parameter larger than that.
        fill = max(layout.slots[i].offset + layout.slots[i].numel for i in b.slots) - b.offset
        assert fill <= bucket_size or len(b.slots) == 1
    assert layout.numel == offset and layout.shard_numel == shard_offset
    # Parameters: reverse registration order, aligned, inside their bucket, never overlapping.
    order = [i for b in layout.buckets for i in b.slots]
    assert order == list(reversed(range(len(numels))))
    ends = 0
    for i in order:
        s = layout.slots[i]
        b = layout.buckets[s.bucket]
        assert (s.offset - b.offset) % PARAM_ALIGN == 0 and s.offset >= ends
        assert b.offset <= s.offset and s.offset + s.numel <= b.offset + b.numel
        ends = s.offset + s.numel
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


def test_big_param_gets_its_own_bucket():
    layout = Layout([10, 100_000, 10], world_size=3, bucket_size=1000)
    assert [b.slots for b in layout.buckets] == [(2,), (1,), (0,)]
    assert layout.buckets[1].numel == 100_032  # 100_000 rounded up to a multiple of 3 * 64
