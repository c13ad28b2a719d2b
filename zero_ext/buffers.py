"""Flat-buffer layout: where every parameter, bucket and shard lives. Pure layout, no communication.

Parameters of one (param group, dtype, device) share one flat buffer. They are placed in *reverse*
registration order (about the order backward produces their gradients), each at an offset aligned to
``PARAM_ALIGN`` elements, and cut into buckets of about ``bucket_size`` elements. Every bucket is padded
to a multiple of ``world_size * BUCKET_ALIGN`` elements and split into ``world_size`` equal slices: rank r
owns slice r of every bucket. A rank's optimizer state is one contiguous buffer per kind: the
concatenation of its slices of all buckets, in bucket order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

# Every shard slice is a multiple of 64 elements: 256-byte aligned in fp32, and a whole number of
# 128-bit vectors in every dtype.
BUCKET_ALIGN = 64
# Parameter views start 16-element aligned (32 bytes in bf16) so kernels that read the params (matmuls,
# vectorised elementwise ops) see aligned memory; the gaps are zeros that never change.
PARAM_ALIGN = 16


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    index: int  # position of the parameter in its group's registration order
    offset: int  # element offset in the flat buffer
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of the flat buffer reduced and gathered as one collective."""

    index: int
    offset: int  # first element in the flat buffer
    numel: int  # padded size: a multiple of world_size * BUCKET_ALIGN
    slots: tuple[int, ...]  # parameter indices, in placement order
    shard_numel: int  # numel // world_size: one rank's slice
    shard_offset: int  # where this bucket's slice starts in a rank's contiguous shard buffers

    def slice_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s slice of this bucket as [start, end) in the flat buffer."""
        start = self.offset + rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class OwnedPiece:
    """The elements of one parameter that one rank owns: one contiguous run of the flattened parameter."""

    index: int  # parameter index
    start: int  # first owned element of the flattened parameter
    end: int  # one past the last
    shard_offset: int  # where element ``start`` lives in the rank's contiguous shard buffers


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
            numel = max(_round_up(fill, granule), granule)
            b = Bucket(len(buckets), start, numel, tuple(members), numel // world_size, shard_offset)
            buckets.append(b)
            shard_offset += b.shard_numel
            start += numel
            fill = 0
            members = []

        for index in reversed(range(len(self.numels))):
            numel = self.numels[index]
            at = _round_up(fill, PARAM_ALIGN)
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

    def owned_pieces(self, rank: int) -> list[OwnedPiece]:
        """Every parameter run that ``rank`` owns, in shard order (empty runs left out)."""
        pieces = []
        for bucket in self.buckets:
            lo, hi = bucket.slice_range(rank)
            for index in bucket.slots:
                slot = self.slots[index]
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append(OwnedPiece(index, a - slot.offset, b - slot.offset, bucket.shard_offset + a - lo))
        return pieces

    def owned_real_numel(self, rank: int) -> int:
        """Elements of real parameters (not padding or gaps) in ``rank``'s shard."""
        return sum(p.end - p.start for p in self.owned_pieces(rank))


def fingerprint(parts: Sequence[str]) -> int:
    """A 63-bit hash of layout descriptions, cheap to compare across ranks."""
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class FlatGroup:
    """The allocated buffers of one (param group, dtype, device): the flat param buffer every parameter
    views into, and this rank's contiguous fp32 shards of master / exp_avg / exp_avg_sq / grad.

    fp32 parameters are their own master: ``master_of(bucket)`` is then a view of the param buffer.
    """

    def __init__(self, params: Sequence[torch.Tensor], group_index: int, world_size: int, rank: int, bucket_size: int):
        self.params = list(params)
        self.group_index = group_index
        self.rank = rank
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.layout = Layout([p.numel() for p in self.params], world_size, bucket_size)
        self.master_is_param = self.dtype == torch.float32
        kw = dict(device=self.device)
        self.param_buffer = torch.zeros(self.layout.numel, dtype=self.dtype, **kw)
        n = self.layout.shard_numel
        self.exp_avg = torch.zeros(n, dtype=torch.float32, **kw)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, **kw)
        self.grad_shard = torch.zeros(n, dtype=torch.float32, **kw)
        self.master = None if self.master_is_param else torch.zeros(n, dtype=torch.float32, **kw)
        self._adopt_params()

    def _adopt_params(self) -> None:
        """Copy every parameter into its slot, make ``param.data`` a view of it, and fill the master."""
        with torch.no_grad():
            for p, slot in zip(self.params, self.layout.slots):
                view = self.param_view(slot.index)
                view.copy_(p.detach())
                p.data = view
            if self.master is not None:
                for bucket in self.layout.buckets:
                    self.master_of(bucket).copy_(self.param_slice(bucket))

    def param_view(self, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return self.param_buffer[slot.offset : slot.offset + slot.numel].view(self.params[index].shape)

    def bucket_view(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s run of a full-size flat buffer (param or grad buffer)."""
        return buffer[bucket.offset : bucket.offset + bucket.numel]

    def param_slice(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket`` in the param buffer: the all-gather input."""
        lo, hi = bucket.slice_range(self.rank)
        return self.param_buffer[lo:hi]

    def shard_of(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s slice of one of this rank's contiguous shard buffers."""
        return buffer[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]

    def master_of(self, bucket: Bucket) -> torch.Tensor:
        return self.param_slice(bucket) if self.master_is_param else self.shard_of(self.master, bucket)

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this group keeps for the life of the optimizer, by kind."""
        out = {"params": self.param_buffer, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        out["grad_shard"] = self.grad_shard
        if self.master is not None:
            out["master"] = self.master
        return out
