"""Where the (bf16/fp16/fp32) parameters live, per stage: the param half of a stage's strategy.

Stages 1 and 2 keep the whole flat param buffer on every rank (:class:`FullParams`); each ``param.data`` is a
view into it. The AdamW kernel writes a rank's updated slice of each bucket straight into it, and that slice is
the in-place all-gather's input. Stage 3 shards the parameters themselves: ``sharded_params.ShardedParams``
keeps the rank's slices and a bucket's full buffer only while it is gathered.

:class:`ParamEdits` (below): parameters changed outside the optimizer at stages 1 and 2 (``model.load_state_dict``
after the optimizer was built, an in-place re-initialisation, weights swapped in and out for an EMA evaluation): the
fp32 master must follow, else the next step writes ``master + update`` over the change and it is silently lost.

Each parameter's autograd version counter moves with every in-place write through it (``copy_``, ``mul_``, what
``load_state_dict`` does) and with nothing the optimizer does: its kernels and all-gathers write the flat buffer
through other views. Where a counter moved since the last look, the elements of this rank's shard whose value
differs from the master rounded to the parameter's dtype become the master's; unchanged elements keep their fp32
bits. A write through ``p.data`` bypasses the counter and is not seen, as torch's own in-place checks do not see it.

Stage 3 needs none of this: outside forward its parameters are shards, and edits go through
``gathered_params(modifier_rank=...)``; nor do fp32 parameters updated in memory, which are their own master.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..layout import Bucket, Layout


class AfterUpdate(NamedTuple):
    """The gather an update of ``own`` (a slice of ``into``) needs before the next use: every rank's ``own`` into
    ``into``, over all the layout's ranks (``over="all"``) or over the replicas of a mesh chunk (``"replicas"``). This
    layer only says what; the engine starts the collective (engine/param_sync.py ``start_after_update``)."""

    over: str
    into: torch.Tensor
    own: torch.Tensor


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

    def after_update(self, bucket: Bucket) -> Optional[AfterUpdate]:
        """Every rank's updated slice into the full buffer (an in-place all-gather)."""
        return AfterUpdate("all", self.gathered(bucket), self.rank_slice(bucket))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.buffer}


class ParamEdits:
    def __init__(self, groups: Sequence):
        # The groups whose master is not the parameters themselves (bf16/fp16 params, or offloaded state).
        self.groups = [g for g in groups if g.state.master_copy]
        self.versions: list[list[int]] = []
        self.unchecked = False  # adopted outside a step: the next step still checks every rank changed them
        self.record()

    def extend(self, groups: Sequence) -> None:
        """Flat groups added (``add_param_group``): followed from their values now (the others' record, and whether a
        local adoption is still unchecked, stay as they are)."""
        added = [g for g in groups if g.state.master_copy]
        self.groups += added
        self.versions += [[p._version for p in g.params] for g in added]

    def record(self, unchecked: bool = False) -> None:
        """The parameters and the master agree now: on every rank (after a load or a write-back, collectives), or,
        ``unchecked``, on this rank only so far."""
        self.versions = [[p._version for p in g.params] for g in self.groups]
        self.unchecked = unchecked

    def changed(self) -> bool:
        """Whether some parameter was written in place since the last step (or load, or write-back)."""
        return self.unchecked or any(self._moved(g, seen) for g, seen in zip(self.groups, self.versions))

    @staticmethod
    def _moved(group, seen: list[int]) -> bool:
        return any(p._version != v for p, v in zip(group.params, seen))

    @torch.no_grad()
    def adopt(self, checked: bool) -> None:
        """This rank's master follows every element of its shard that was changed (local: no collective).
        ``checked``: the step agreed that every rank or none changed its parameters (else, e.g. before a
        ``state_dict()``, the next step still checks)."""
        moved = False
        for group, seen in zip(self.groups, self.versions):
            if self._moved(group, seen):
                moved = True
                for bucket in group.layout.buckets:
                    master_follows(group, bucket, group.flat_params.rank_slice(bucket))
        self.record(unchecked=(self.unchecked or moved) and not checked)


def master_follows(group, bucket, values: torch.Tensor) -> None:
    """``bucket``'s master on this rank := ``values`` (this rank's slice, in the parameters' dtype) wherever they
    differ from the master rounded to that dtype (the value the optimizer last gave the parameter); through the
    placement, since the master may live on the host or on disk."""
    master = group.state.read("master", bucket.shard_range)
    values = values.to(master.device)
    changed = values != master.to(values.dtype)
    if bool(changed.any()):
        master = master.clone()
        master[changed] = values[changed].float()
        group.state.write("master", bucket.shard_range, master)
