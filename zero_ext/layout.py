"""Flat-buffer layout: where every parameter, bucket and shard lives. Pure arithmetic: no tensors, no devices.

Parameters of one (param group, dtype) share one flat buffer. They are placed in *reverse* registration order
(about the order backward produces their gradients), each at an offset aligned to ``PARAM_ALIGN`` elements, and
cut into buckets of at most ``bucket_size`` elements (rounded to whole granules of ``world_size * BUCKET_ALIGN``).
Every bucket is padded to a multiple of that granule and split into ``world_size`` equal slices: rank r owns slice
r of every bucket. A rank's optimizer state is one contiguous buffer per kind: the concatenation of its slices of
all buckets, in bucket order (its *shard*).

A parameter larger than ``bucket_size`` is *split*: it starts a new bucket and is cut into fragments of
``fragment_numel`` elements (a whole number of granules), one bucket each, the last padded; the next parameter
starts a new bucket again. The cuts fall inside the parameter, where no padding is added, so the parameter stays
one contiguous run of the flat buffer across its buckets. So no bucket (nor anything sized from one: the staging
pool, the offload landing ring) grows with the largest parameter (apex's DistributedFusedAdam fragments its
parameters for the same reason). A parameter that fits a bucket is never split: a split ties its buckets together
at stage 3 (its view must be contiguous, so they share one gathered storage: a *run*), and splitting only what
must be split keeps every run one parameter's (``Layout.runs``). Every element is still reduced once, in its own
bucket, by the same collective as with one bucket larger than every parameter, so the reduced values, and the
training, are bitwise the same whatever ``bucket_size`` is.

Every range has a name and one place that computes it (apex's ``ParameterFragment``, Megatron's ``Range``):

- ``Slot.param_range``: a parameter's elements in the flat buffer;
- ``Bucket.bucket_range``: a bucket's elements in the flat buffer; ``Bucket.rank_range(r)``: rank r's slice of it;
- ``Bucket.shard_range``: a bucket's slice in a rank's shard buffers (the same for every rank);
- ``Bucket.slot_range(slot)``: the parameter's elements in this bucket (its fragment: the whole parameter unless it
  is split) relative to the bucket's start (their place in a bucket-sized staging buffer);
  ``Bucket.fragment_range(slot)``: the same elements in the flattened parameter;
- ``Run.run_range``: the buckets of a split parameter (or one bucket) in the flat buffer;
  ``Run.slot_range(slot)``: a parameter's elements relative to its run's start (its view of a stage-3 storage);
- ``OwnedPiece.param_range`` / ``OwnedPiece.shard_range``: the elements of one parameter a rank owns, in the
  flattened parameter and in the rank's shard buffers.

Every element also has a *canonical* index: its place in the layout of one rank with one bucket larger than every
parameter (``canonical_offsets``: the parameters in placement order, each 16-aligned). bf16 moments' stochastic
rounding keys on it (:mod:`zero_ext.update.adamw`), so an element rounds the same way whatever the world size, stage or
bucket size. Inside a bucket the parameters are packed as they are there (from a 64-aligned start, each 16-aligned;
a split parameter is one contiguous run across its buckets), so a bucket's canonical indices are its flat offsets
plus one shift per bucket (``Layout.canonical_start``). Padding gets the indices that follow; it is zero, and zero
rounds to zero whatever the random bits.
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
# 16-element run of a shard never holds elements of two parameters. A flat group with int8 moments aligns its
# parameters to 64 (``Layout(param_align=)``, its rule's ``param_align``): a quantization block of 64 elements then
# never holds elements of two parameters, and every layout (world size, bucket size) cuts the same blocks.
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

    def blocks(self, block: int) -> "Range":
        """The blocks of ``block`` elements this range touches, in block coordinates (a kind stored one item per
        block: int8 moments' scales)."""
        return Range(self.start // block, -(-self.end // block))

    def whole_blocks(self, block: int) -> "Range":
        """This range widened to whole blocks of ``block`` elements, in element coordinates."""
        b = self.blocks(block)
        return Range(b.start * block, b.end * block)


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    index: int  # position of the parameter in its flat group's registration order
    offset: int  # element offset in the flat buffer
    numel: int
    bucket: int  # the (first) bucket holding its elements
    last_bucket: int  # the last one: > bucket when the parameter is split

    @property
    def param_range(self) -> Range:
        return Range(self.offset, self.offset + self.numel)

    @property
    def buckets(self) -> range:
        """The indices of the buckets holding its fragments, in order."""
        return range(self.bucket, self.last_bucket + 1)

    @property
    def split(self) -> bool:
        return self.last_bucket != self.bucket


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of the flat buffer reduced and gathered as one collective."""

    index: int
    offset: int  # first element in the flat buffer
    numel: int  # padded size: a multiple of world_size * BUCKET_ALIGN
    slots: tuple[int, ...]  # indices of the parameters with elements in it (whole or a fragment), in placement order
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
        """``slot``'s elements in this bucket (its fragment), relative to this bucket's first element."""
        return slot.param_range.intersect(self.bucket_range).shifted(-self.offset)

    def fragment_range(self, slot: Slot) -> Range:
        """``slot``'s elements in this bucket, in the flattened parameter's coordinates."""
        return slot.param_range.intersect(self.bucket_range).shifted(-slot.offset)


@dataclass(frozen=True)
class Run:
    """Consecutive buckets joined by a split parameter (or one bucket): stage 3 gives them one gathered storage, so
    that the parameter's view of it is contiguous."""

    index: int
    first: int  # bucket index
    last: int
    offset: int  # the first bucket's
    numel: int  # the buckets' together
    slots: tuple[int, ...]

    @property
    def buckets(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def run_range(self) -> Range:
        return Range(self.offset, self.offset + self.numel)

    def slot_range(self, slot: Slot) -> Range:
        """``slot``'s elements relative to this run's first element (the parameter is wholly inside its run)."""
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

    def __init__(self, numels: Sequence[int], world_size: int, bucket_size: int, param_align: int = PARAM_ALIGN):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
        self._check_align(param_align)
        self.world_size = world_size
        self.bucket_size = bucket_size
        self.param_align = param_align
        self.numels = tuple(int(n) for n in numels)
        granule = world_size * BUCKET_ALIGN
        # A split parameter's fragments: the most whole granules a bucket of ``bucket_size`` holds (one at least).
        self.fragment_numel = max(granule, bucket_size // granule * granule)
        # The most elements any bucket holds, whatever the parameters: every buffer sized from a bucket is a multiple.
        self.bucket_limit = max(granule, round_up(bucket_size, granule))
        slots, buckets, self.numel, self.shard_numel = self._place()
        # Only a layout of whole parameters (:mod:`zero_ext.owner_layout`) lets a bucket exceed it.
        self.bucket_limit = max(self.bucket_limit, max((b.numel for b in buckets), default=0))
        self.slots: tuple[Slot, ...] = tuple(slots)  # type: ignore[arg-type]
        self.buckets: tuple[Bucket, ...] = tuple(buckets)
        self.real_numel = sum(self.numels)
        self._pieces: dict[int, tuple[OwnedPiece, ...]] = {}
        runs: list[Run] = []
        self.run_of: list[int] = []  # bucket index -> its run's index
        for b in self.buckets:
            split = [self.slots[i] for i in b.slots if self.slots[i].split]
            if split and split[0].bucket != b.index:  # a later fragment: the run started at the parameter's first
                self.run_of.append(len(runs) - 1)
                continue
            last = split[0].last_bucket if split else b.index
            numel = sum(self.buckets[i].numel for i in range(b.index, last + 1))
            runs.append(Run(len(runs), b.index, last, b.offset, numel, b.slots))
            self.run_of.append(len(runs) - 1)
        self.runs: tuple[Run, ...] = tuple(runs)
        # each parameter's canonical index of its first element (a rule of whole parameters is handed it)
        canonical = canonical_offsets(self.numels, param_align)
        self.canonical: tuple[int, ...] = canonical
        # flat offset + shift = canonical index, for every element of a bucket (see the module docstring)
        self.canonical_shift: tuple[int, ...] = tuple(
            canonical[b.slots[0]] - self.slots[b.slots[0]].offset for b in self.buckets
        )

    @staticmethod
    def _check_align(param_align: int) -> None:
        if param_align not in (PARAM_ALIGN, BUCKET_ALIGN):
            raise ValueError(f"param_align must be {PARAM_ALIGN} or {BUCKET_ALIGN} elements, got {param_align}")

    def _place(self) -> tuple[list[Slot], list[Bucket], int, int]:
        """Every parameter's slot and every bucket, in placement order; the flat and the shard numel."""
        world_size, bucket_size, param_align = self.world_size, self.bucket_size, self.param_align
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
            if numel > bucket_size:  # split: buckets of its own, cut every fragment_numel elements
                if members:
                    close_bucket()
                first, offset = len(buckets), start
                for at in range(0, numel, self.fragment_numel):
                    members, fill = [index], min(self.fragment_numel, numel - at)
                    close_bucket()
                slots[index] = Slot(index, offset, numel, first, len(buckets) - 1)
                continue
            at = round_up(fill, param_align)
            if members and at + numel > bucket_size:
                close_bucket()
                at = 0
            slots[index] = Slot(index, start + at, numel, len(buckets), len(buckets))
            members.append(index)
            fill = at + numel
        if members:
            close_bucket()
        return slots, buckets, start, shard_offset  # type: ignore[return-value]

    def canonical_start(self, bucket: Bucket, rank: int) -> int:
        """The canonical index (see the module docstring) of the first element of ``rank``'s slice of ``bucket``;
        the slice's element j has index ``canonical_start + j``."""
        return bucket.rank_range(rank).start + self.canonical_shift[bucket.index]

    def single_rank_shard_range(self, slot: Slot) -> Range:
        """``slot``'s elements in the shard buffers of a world of one, where a rank's shard is every bucket."""
        if self.world_size != 1:
            raise ValueError(f"single_rank_shard_range: the layout is for {self.world_size} ranks, not one")
        bucket = self.buckets[slot.bucket]  # (its later buckets follow it in the shard, as in the flat buffer)
        return slot.param_range.shifted(bucket.shard_offset - bucket.offset)

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


def canonical_offsets(numels: Sequence[int], param_align: int = PARAM_ALIGN) -> tuple[int, ...]:
    """Each parameter's offset in the layout of one rank with one unbounded bucket: in placement order (reverse
    registration), each at the next ``param_align``-aligned element."""
    offsets, fill = [0] * len(numels), 0
    for index in reversed(range(len(numels))):
        offsets[index] = round_up(fill, param_align)
        fill = offsets[index] + int(numels[index])
    return tuple(offsets)


def fingerprint(parts: Sequence[str]) -> int:
    """A 63-bit hash of layout descriptions, cheap to compare across ranks."""
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
