"""Where the (bf16/fp16/fp32) parameters live, per stage: the param half of a stage's strategy.

Stages 1 and 2 keep the whole flat param buffer on every rank (:class:`FullParams`); each ``param.data`` is a
view into it. The AdamW kernel writes a rank's updated slice of each bucket straight into it, and that slice is
the in-place all-gather's input. Stage 3 shards the parameters themselves: ``sharded_params.ShardedParams``
keeps the rank's slices and a bucket's full buffer only while it is gathered.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..layout import Bucket, Layout


class FullParams:
    """Stages 1 and 2: the whole flat param buffer, persistent; parameters are views into it."""

    gathers_after_update = True  # every rank's slice must be gathered back into the full buffer
    shards_params = False  # the full values always exist (a bucket is never SHARDED)

    def __init__(self, layout: Layout, rank: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.rank, self.dtype = layout, rank, dtype
        self.buffer = torch.zeros(layout.numel, dtype=dtype, device=device)

    def adopt(self, params: Sequence[torch.Tensor]) -> None:
        """Copy every parameter into its slot and make ``param.data`` a view of it."""
        with torch.no_grad():
            for p, slot in zip(params, self.layout.slots):
                view = self.view(slot.index, p.shape)
                view.copy_(p.detach())
                p.data = view

    def misplaced(self, params: Sequence[torch.Tensor]) -> Optional[int]:
        """The index of a parameter whose ``.data`` is no longer its view of the buffer (the model was moved, cast
        or given new tensors after the optimizer was built), else None."""
        base, itemsize = self.buffer.data_ptr(), self.buffer.element_size()
        for slot, p in zip(self.layout.slots, params):
            if (
                p.device != self.buffer.device
                or p.dtype != self.dtype
                or (slot.numel and p.data_ptr() != base + slot.offset * itemsize)
            ):
                return slot.index
        return None

    def view(self, index: int, shape) -> torch.Tensor:
        """Parameter ``index`` in the buffer, shaped ``shape``."""
        return self.layout.slots[index].param_range.of(self.buffer).view(shape)

    def rank_slice(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket``: where the AdamW kernel writes, and the all-gather's input."""
        return bucket.rank_range(self.rank).of(self.buffer)

    def gathered(self, bucket: Bucket) -> torch.Tensor:
        """The whole of ``bucket``: the all-gather's output."""
        return bucket.bucket_range.of(self.buffer)

    def unshard(self, bucket: Bucket) -> torch.Tensor:
        """The all-gather's output for ``bucket``: its part of the flat buffer (always there)."""
        return self.gathered(bucket)

    def gather_input(self, bucket: Bucket, full: torch.Tensor) -> torch.Tensor:
        """The all-gather's input: this rank's slice, inside ``full`` (an in-place all-gather)."""
        return self.rank_slice(bucket)

    def rank_values(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket`` in the param dtype (to read: a checkpoint's ``param`` section)."""
        return self.rank_slice(bucket)

    def follow(self, bucket: Bucket, full: torch.Tensor) -> None:
        """Nothing: the slice is part of ``full``."""

    def sync_after_update(self, comm, bucket: Bucket):
        """Every rank's updated slice into the full buffer (in place); its Pending."""
        return comm.start_all_gather(self.gathered(bucket), self.rank_slice(bucket))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.buffer}
