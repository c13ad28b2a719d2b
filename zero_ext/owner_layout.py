"""A flat-buffer layout of whole parameters: every parameter belongs, whole, to one *owner* rank.

An update rule whose unit is a whole parameter (Muon orthogonalises each weight matrix: its update needs the whole
mean gradient) cannot use :class:`~zero_ext.layout.Layout`'s element slices, which cut matrices at rank
boundaries. :class:`OwnerLayout` keeps everything else of a layout (buckets reduced and gathered as one collective,
equal rank slices, a rank's shard the concatenation of its slices, ``owned_pieces``), but packs the parameters of
a bucket so that each lies inside one rank's slice: the bucket's reduce-scatter then delivers each matrix's mean
gradient whole to its owner, and its all-gather brings the owner's update to every rank, at DDP's volume plus the
padding that evens the slices. Nothing downstream needs to know: a parameter is one contiguous run of the flat
buffer, inside one run (a bucket: nothing is split), and ``owned_pieces(r)`` lists whole parameters.

Owners are chosen once, deterministically, from the parameter sizes and a cost per parameter (Muon: its
Newton-Schulz work, about rows x cols x min(rows, cols): :func:`newton_schulz_cost`). Parameters go into buckets in
placement order (reverse registration, as :class:`~zero_ext.layout.Layout`: about the order backward produces
their gradients); inside a bucket, largest (then costliest) first, each goes to the rank whose slice is least filled, ties to the
rank with the least cost so far (this bucket's and all before), then the lowest rank. So slices stay even (the
padding, which every collective carries, stays small) and the cost rotates across ranks from bucket to bucket.
A bucket closes when adding the next parameter would make its slices exceed ``bucket_size / world_size``, unless
the slices are already as large as the bucket's largest parameter needs: a matrix larger than a slice takes a bucket
whose slices are its size, shared with up to ``world_size - 1`` others of about its size (the layers of a model
repeat: equal matrices then fill every slice). Such a bucket is larger than ``bucket_size`` (``bucket_limit`` says
by how much; every buffer sized from a bucket follows it).

Canonical indices (bf16 state's stochastic rounding) are per parameter here: a rule of whole parameters is handed
each parameter with ``canonical_offsets``' index of its first element, whatever the layout.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from .layout import BUCKET_ALIGN, PARAM_ALIGN, Bucket, Layout, Slot, round_up


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """About the multiply-adds of one Newton-Schulz iteration on a ``rows x cols`` matrix (its Gram matrix and the
    two products with it): rows * cols * min(rows, cols). Other shapes: their element count."""
    if len(shape) != 2:
        return max(1, math.prod(int(d) for d in shape))
    rows, cols = int(shape[0]), int(shape[1])
    return rows * cols * min(rows, cols)


class OwnerLayout(Layout):
    """The placement of whole parameters into padded buckets for ``world_size`` ranks: ``owners[i]`` is the rank
    that holds parameter i; ``costs`` (one per parameter, default its size) is what the owners balance, and
    ``rank_costs`` the sum each rank got."""

    def __init__(self, numels: Sequence[int], world_size: int, bucket_size: int, param_align: int = PARAM_ALIGN,
                 costs: Optional[Sequence[int]] = None, slot_align: Optional[int] = None):  # fmt: skip
        # slot_align: where parameters start in a slice, and what slices are multiples of (offload="nvme": a file
        # block, so that the disk placement's chunks start at a parameter: placement/disk.py); param_align still
        # sets the canonical indices
        self.slot_align = param_align if slot_align is None else slot_align
        if self.slot_align % param_align:
            raise ValueError(f"OwnerLayout: slot_align must be a multiple of {param_align}, got {slot_align}")
        self.costs = tuple(int(c) for c in (costs if costs is not None else numels))
        if len(self.costs) != len(numels):
            raise ValueError(f"OwnerLayout: {len(self.costs)} costs for {len(numels)} parameters")
        self.owners: tuple[int, ...] = ()
        self.rank_costs: tuple[int, ...] = ()
        super().__init__(numels, world_size, bucket_size, param_align)

    def _place(self) -> tuple[list[Slot], list[Bucket], int, int]:
        world, align = self.world_size, self.slot_align
        step = max(BUCKET_ALIGN, align)  # every slice is a multiple of it
        slice_limit = max(step, round_up(self.bucket_size, world * step) // world)
        totals = [0] * world  # cost per rank, buckets closed so far
        owners = [0] * len(self.numels)
        slots: list[Optional[Slot]] = [None] * len(self.numels)
        buckets: list[Bucket] = []
        start = shard_offset = 0

        def pack(members: list[int]) -> tuple[dict[int, tuple[int, int]], int, list[int]]:
            """(index -> (rank, offset in its slice)), the slice size, the ranks' costs after this bucket."""
            fill, cost, where = [0] * world, list(totals), {}
            # largest first, then costliest (to the rank with the least cost), then placement order
            for *_, i in sorted((-self.numels[i], -self.costs[i], -i, i) for i in members):
                r = min(range(world), key=lambda r: (fill[r], cost[r], r))
                at = round_up(fill[r], align)
                where[i], fill[r], cost[r] = (r, at), at + self.numels[i], cost[r] + self.costs[i]
            return where, max(step, round_up(max(fill), step)), cost

        def close(members: list[int]) -> None:
            nonlocal start, shard_offset
            where, size, cost = pack(members)
            index = len(buckets)
            for i in members:
                r, at = where[i]
                owners[i] = r
                slots[i] = Slot(i, start + r * size + at, self.numels[i], index, index)
            order = tuple(sorted(members, key=lambda i: slots[i].offset))  # type: ignore[union-attr]
            buckets.append(Bucket(index, start, size * world, order, size, shard_offset))
            totals[:] = cost
            start += size * world
            shard_offset += size

        members: list[int] = []
        for index in reversed(range(len(self.numels))):
            if members:
                largest = max(round_up(self.numels[i], step) for i in [*members, index])
                if pack([*members, index])[1] > max(slice_limit, largest):
                    close(members)
                    members = []
            members.append(index)
        if members:
            close(members)
        self.owners, self.rank_costs = tuple(owners), tuple(totals)
        return slots, buckets, start, shard_offset  # type: ignore[return-value]

    def canonical_start(self, bucket: Bucket, rank: int) -> int:
        raise ValueError(
            "OwnerLayout: a bucket slice of whole parameters has no run of canonical indices; a rule of whole "
            "parameters is given each parameter's canonical offset (layout.canonical_offsets)"
        )

    def balance(self) -> float:
        """max / mean of the ranks' costs (1.0: perfectly balanced)."""
        mean = sum(self.rank_costs) / max(1, len(self.rank_costs))
        return max(self.rank_costs, default=0) / mean if mean else 1.0


__all__ = ["OwnerLayout", "newton_schulz_cost"]
