"""Per-parameter step counts, as ``torch.optim.AdamW`` keeps them, without reading the device in ``step()``.

torch skips a parameter whose gradient is None: no decay, no moment update, and its step count (so its bias
correction) does not advance. ``step()`` learns on the host which parameters got a gradient on some rank (their
flags, summed over ranks in a host-side agreement), so the host knows exactly which parameters update. What it
cannot know without a device sync is whether the whole step is skipped for a non-finite gradient (``found_inf``
lives on the device). So parameters are grouped into *classes* whose update histories are identical: each class
has one step counter on the device, advanced by ``1 - found_inf`` in every step its parameters update. Two
parameters of one class always have the same count, so a run of a shard whose pieces share a class is one kernel
call. A class splits when some of its parameters update and others do not; classes never merge (their counts may
differ by device-side skips the host cannot see). A model whose parameters all get gradients every step keeps one
class: one kernel call per bucket.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..layout import Bucket, OwnedPiece, Range


class StepCounts:
    def __init__(self, trainable: Iterable[int], device: torch.device):
        self.indices = sorted(trainable)  # global indices of the trainable parameters
        self.class_of = dict.fromkeys(self.indices, 0)
        self.num_classes = 1
        # One slot per possible class (a class per parameter at most): splitting never reallocates.
        self.steps = torch.zeros(max(1, len(self.indices)), dtype=torch.float32, device=device)

    def step_of(self, gidx: int) -> torch.Tensor:
        """Parameter ``gidx``'s step count: a 0-d view of its class's device counter."""
        return self.steps[self.class_of[gidx]]

    def uniform(self, active: set[int]) -> bool:
        """Every parameter updates this step and all share one class (the usual step: one run per bucket)."""
        return self.num_classes == 1 and len(active) == len(self.indices)

    def advance(self, active: set[int], not_skipped: torch.Tensor) -> None:
        """Parameters ``active`` update this step (unless ``not_skipped`` is 0 on the device): split every class
        that has both updating and resting members, then advance each updating class's counter."""
        if self.uniform(active):
            self.steps[0].add_(not_skipped)
            return
        members: dict[int, tuple[list[int], list[int]]] = {}
        for gidx, c in self.class_of.items():
            members.setdefault(c, ([], []))[0 if gidx in active else 1].append(gidx)
        for c, (moving, resting) in members.items():
            if moving and resting:
                new = self.num_classes
                self.num_classes += 1
                self.steps[new].copy_(self.steps[c])
                for gidx in resting:
                    self.class_of[gidx] = new
            if moving:
                self.steps[c].add_(not_skipped)

    def load(self, values: dict[int, float]) -> None:
        """Set every parameter's count (host values, e.g. from a checkpoint): parameters with equal counts share
        a class, since their future updates are then identical."""
        classes: dict[float, int] = {}
        host = torch.zeros(self.steps.numel(), dtype=torch.float32)
        for gidx in self.indices:
            value = float(values[gidx])
            if value not in classes:
                classes[value] = len(classes)
                host[classes[value]] = value
            self.class_of[gidx] = classes[value]
        self.num_classes = max(1, len(classes))
        self.steps.copy_(host)

    def extend(self, added: Iterable[int]) -> None:
        """Parameters ``added`` (``add_param_group``) at step 0, torch's count for a parameter that never stepped; every
        other keeps its count. One host read, outside ``step()``: parameters with equal counts share a class again, as
        after a :meth:`load`."""
        counts = self.values()
        counts.update(dict.fromkeys(added, 0.0))
        self.indices = sorted(counts)
        self.steps = torch.zeros(max(1, len(self.indices)), dtype=torch.float32, device=self.steps.device)
        self.load(counts)

    def values(self, indices: Sequence[int] | None = None) -> dict[int, float]:
        """Every parameter's count on the host (reads the device: for checkpoints, not for ``step()``)."""
        host = self.steps[: self.num_classes].detach().to("cpu")
        return {gidx: float(host[self.class_of[gidx]]) for gidx in (self.indices if indices is None else indices)}


def update_runs(
    pieces: Sequence[OwnedPiece], param_indices: Sequence[int], bucket: Bucket, active: set[int], counts: StepCounts
) -> list[tuple[Range, int]]:
    """The runs of this rank's slice of ``bucket`` (relative to its start) that update, each with its step class.
    ``pieces``: this rank's owned pieces of the bucket (``FlatGroup.pieces_by_bucket``), ``param_indices``: the flat
    group's global parameter indices by position. The runs are maximal runs of consecutive owned pieces whose parameters update and share a class (the padding between two
    such pieces goes with them; it stays zero). When every piece updates with one class the whole slice is one
    run: one kernel call, as without any resting parameter."""
    if counts.uniform(active):  # the usual step, without a pass over the pieces
        return [(Range(0, bucket.shard_numel), 0)] if pieces else []
    keys = []
    for piece in pieces:
        gidx = param_indices[piece.index]
        keys.append((gidx in active, counts.class_of[gidx], piece.shard_range.shifted(-bucket.shard_offset)))
    if not keys:
        return []
    if all(k[0] for k in keys) and len({k[1] for k in keys}) == 1:
        return [(Range(0, bucket.shard_numel), keys[0][1])]
    runs: list[list] = []
    for moving, cls, r in keys:
        if runs and runs[-1][0] == moving and runs[-1][1] == cls:
            runs[-1][3] = r.end
        else:
            runs.append([moving, cls, r.start, r.end])
    return [(Range(start, end), cls) for moving, cls, start, end in runs if moving]
