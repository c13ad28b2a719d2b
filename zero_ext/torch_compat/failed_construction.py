"""A constructor argument check that fails on some ranks only fails every rank: the failing rank joins the others'
first agreement (:func:`zero_ext.construction.planning.agree_on_plan`, where every rank says whether it planned
successfully) with "failed" before it raises its own error, so they raise "construction failed on rank(s) [...]"
instead of waiting for it. Where every rank fails alike (the usual case), they agree among themselves and each raises
its error. Nothing was built before the checks: a failed constructor changes nothing."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..comm import Communicator, communicator_for, fallback_device


def tell_other_ranks(process_group, communicator: Optional[Communicator], timeout: Optional[float]) -> None:
    """Say "failed" in the ranks' first construction agreement, when there are other ranks to tell (never raises: the
    caller raises its own error next; a group this rank cannot use, or ranks that never arrive within ``timeout``
    seconds, are left alone)."""
    try:
        comm = communicator
        if comm is None:
            if not dist.is_initialized() or dist.get_world_size(process_group) <= 1:
                return
            comm = communicator_for(process_group, fallback_device(process_group))
        if comm.world_size > 1:
            comm.agree(1, timeout=timeout if isinstance(timeout, (int, float)) and timeout > 0 else None)
    except Exception:  # noqa: BLE001 (the caller's error is the one to report)
        return
