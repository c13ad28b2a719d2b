"""Flat-buffer layout: where every parameter, bucket and shard lives. Pure arithmetic: no tensors, no devices.

Parameters of one (param group, dtype) share one flat buffer. They are placed in *reverse* registration order
(about the order backward produces their gradients), each at an offset aligned to ``PARAM_ALIGN`` elements, and
cut into buckets of about ``bucket_size`` elements. Every bucket is padded to a multiple of
``world_size * BUCKET_ALIGN`` elements and split into ``world_size`` equal slices: rank r owns slice r of every
bucket. A rank's optimizer state is one contiguous buffer per kind: the concatenation of its slices of all
buckets, in bucket order (its *shard*).

Every range has a name and one place that computes it (apex's ``ParameterFragment``, Megatron's ``Range``):

- ``Slot.param_range``: a parameter's elements in the flat buffer;
- ``Bucket.bucket_range``: a bucket's elements in the flat buffer; ``Bucket.rank_range(r)``: rank r's slice of it;
- ``Bucket.shard_range``: a bucket's slice in a rank's shard buffers (the same for every rank);
- ``Bucket.slot_range(slot)``: a parameter's elements relative to its bucket's start (its place in a
  bucket-sized staging buffer);
- ``OwnedPiece.param_range`` / ``OwnedPiece.shard_range``: the elements of one parameter a rank owns, in the
  flattened parameter and in the rank's shard buffers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Sequence

# Every shard slice is a multiple of 64 elements: 256-byte aligned in fp32, and a whole number of 128-bit
# vectors in every dtype.
BUCKET_ALIGN = 64
# Parameter views start 16-element aligned (32 bytes in bf16) so kernels that read the params (matmuls,
# vectorised elementwise ops) see aligned memory; the gaps are zeros that never change. It also means that a
# 16-element run of a shard never holds elements of two parameters.
PARAM_ALIGN = 16


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Range(NamedTuple):
    """``[start, end)`` in some buffer's element coordinates."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def of(self, buffer):
        """This range of a 1-D buffer (a view for a tensor)."""
        return buffer[self.start : self.end]

    def shifted(self, by: int) -> "Range":
        return Range(self.start + by, self.end + by)

    def intersect(self, other: "Range") -> "Range":
        start = max(self.start, other.start)
        return Range(start, max(start, min(self.end, other.end)))


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    index: int  # position of the parameter in its flat group's registration order
    offset: int  # element offset in the flat buffer
    numel: int
    bucket: int

    @property
    def param_range(self) -> Range:
        return Range(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of the flat buffer reduced and gathered as one collective."""

    index: int
    offset: int  # first element in the flat buffer
    numel: int  # padded size: a multiple of world_size * BUCKET_ALIGN
    slots: tuple[int, ...]  # parameter indices, in placement order
    shard_numel: int  # numel // world_size: one rank's slice
    shard_offset: int  # where this bucket's slice starts in a rank's contiguous shard buffers

    @property
    def bucket_range(self) -> Range:
        return Range(self.offset, self.offset + self.numel)

    @property
    def shard_range(self) -> Range:
        return Range(self.shard_offset, self.shard_offset + self.shard_numel)

    def rank_range(self, rank: int) -> Range:
        """Rank ``rank``'s slice of this bucket in the flat buffer."""
        start = self.offset + rank * self.shard_numel
        return Range(start, start + self.shard_numel)

    def slot_range(self, slot: Slot) -> Range:
        """``slot``'s elements relative to this bucket's first element."""
        return slot.param_range.shifted(-self.offset)


@dataclass(frozen=True)
class OwnedPiece:
    """The elements of one parameter that one rank owns: one contiguous run of the flattened parameter."""

    index: int  # parameter index in the flat group
    start: int  # first owned element of the flattened parameter
    end: int  # one past the last
    shard_offset: int  # where element ``start`` lives in the rank's contiguous shard buffers
    bucket: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def param_range(self) -> Range:
        return Range(self.start, self.end)

    @property
    def shard_range(self) -> Range:
        return Range(self.shard_offset, self.shard_offset + self.end - self.start)


class Layout:
    """The placement of a list of parameter sizes into padded buckets for ``world_size`` ranks."""

    def __init__(self, numels: Sequence[int], world_size: int, bucket_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
        self.world_size = world_size
        self.bucket_size = bucket_size
        self.numels = tuple(int(n) for n in numels)
        granule = world_size * BUCKET_ALIGN
        slots: list[Slot | None] = [None] * len(self.numels)
        buckets: list[Bucket] = []
        members: list[int] = []
        start = 0  # flat offset where the open bucket starts
        fill = 0  # elements used in the open bucket (aligned placement)
        shard_offset = 0

        def close_bucket() -> None:
            nonlocal start, fill, members, shard_offset
            numel = max(round_up(fill, granule), granule)
            b = Bucket(len(buckets), start, numel, tuple(members), numel // world_size, shard_offset)
            buckets.append(b)
            shard_offset += b.shard_numel
            start += numel
            fill = 0
            members = []

        for index in reversed(range(len(self.numels))):
            numel = self.numels[index]
            at = round_up(fill, PARAM_ALIGN)
            if members and at + numel > bucket_size:
                close_bucket()
                at = 0
            slots[index] = Slot(index, start + at, numel, len(buckets))
            members.append(index)
            fill = at + numel
        if members:
            close_bucket()
        self.slots: tuple[Slot, ...] = tuple(slots)  # type: ignore[arg-type]
        self.buckets: tuple[Bucket, ...] = tuple(buckets)
        self.numel = start
        self.shard_numel = shard_offset
        self.real_numel = sum(self.numels)
        self._pieces: dict[int, tuple[OwnedPiece, ...]] = {}

    def single_rank_shard_range(self, slot: Slot) -> Range:
        """``slot``'s elements in the shard buffers of a world of one, where a rank's shard is every bucket."""
        if self.world_size != 1:
            raise ValueError(f"single_rank_shard_range: the layout is for {self.world_size} ranks, not one")
        bucket = self.buckets[slot.bucket]
        return bucket.slot_range(slot).shifted(bucket.shard_offset)

    def owned_pieces(self, rank: int) -> tuple[OwnedPiece, ...]:
        """Every parameter run that ``rank`` owns, in shard order (empty runs left out)."""
        if rank not in self._pieces:
            pieces = []
            for bucket in self.buckets:
                mine = bucket.rank_range(rank)
                for index in bucket.slots:
                    run = self.slots[index].param_range.intersect(mine)
                    if run.numel:
                        offset = self.slots[index].offset
                        shard_at = bucket.shard_offset + run.start - mine.start
                        pieces.append(OwnedPiece(index, run.start - offset, run.end - offset, shard_at, bucket.index))
            self._pieces[rank] = tuple(pieces)
        return self._pieces[rank]

    def owned_real_numel(self, rank: int) -> int:
        """Elements of real parameters (not padding or gaps) in ``rank``'s shard."""
        return sum(p.numel for p in self.owned_pieces(rank))


def fingerprint(parts: Sequence[str]) -> int:
    """A 63-bit hash of layout descriptions, cheap to compare across ranks."""
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
