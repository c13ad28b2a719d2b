"""Which layout a flat group gets: element slices (:class:`~zero_ext.layout.Layout`) for an element-wise rule,
whole parameters on owner ranks (:class:`~zero_ext.owner_layout.OwnerLayout`) for a rule of whole parameters,
whose shapes it checks first."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..layout import Layout
from ..owner_layout import OwnerLayout
from ..placement.disk import param_align_on_disk
from ..update.protocol import PARAMETERS, UpdateRule


def layout_for(rule: UpdateRule, params: Sequence[torch.Tensor], world_size: int, bucket_size: int,
               offload: Optional[str] = None) -> Layout:  # fmt: skip
    """The layout of one flat group of ``params`` (in registration order) kept by ``rule``, its state placed by
    ``offload`` (on disk a rule of whole parameters starts each at a file block: placement/disk.py)."""
    numels = [p.numel() for p in params]
    if rule.unit == PARAMETERS:
        costs = [rule.cost(tuple(p.shape)) for p in params]  # type: ignore[attr-defined]
        align = param_align_on_disk(rule) if offload == "nvme" else None
        return OwnerLayout(numels, world_size, bucket_size, rule.param_align, costs, slot_align=align)
    return Layout(numels, world_size, bucket_size, rule.param_align)


def shape_error(rule: UpdateRule, where: str, members: Sequence[tuple[int, torch.Tensor]],
                names: Mapping[int, str]) -> Optional[str]:  # fmt: skip
    """Why ``rule`` cannot update one of ``members`` ((global index, parameter) pairs), or None."""
    if rule.unit != PARAMETERS:
        return None
    for gidx, p in members:
        try:
            rule.check_shape(where, names.get(gidx, f"#{gidx}"), tuple(p.shape))  # type: ignore[attr-defined]
        except ValueError as e:
            return str(e)
    return None


__all__ = ["layout_for", "shape_error"]
