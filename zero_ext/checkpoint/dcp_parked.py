"""Reading a flat group's state while ``offload_states()`` has parked it: from the host copies the parking lot holds.

A parked storage holds no bytes (``placement/parking.py``), so no view of it can even be made; its bytes are in the
lot's host buffer, the same layout. :func:`host_mirror` makes a shallow copy of a placement whose parked tensors (its
buffers, the grad shard, and those of its parameters object: the flat param buffer or the stage-3 shard) are replaced
by their host views (:meth:`ParkingLot.host_view`). The mirror answers ``read`` with the placement's own code (its
views, the codec: bf16 widened, int8 dequantized, the master joined from parameters and remainder), only over host
memory: nothing is copied to read it, nothing is moved back, and the mirror writes nothing (``set_state_dict`` is
refused while parked: ``dcp_state_dict.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..placement.parking import ParkingLot


def _swapped(value: Any, lot: ParkingLot) -> Any:
    """``value`` with each parked tensor in it (itself, or in a dict / list / tuple) replaced by its host view;
    ``value`` itself where it holds none."""
    if isinstance(value, torch.Tensor):
        return lot.host_view(value) if lot.is_parked(value) else value
    if isinstance(value, dict):
        out = {k: _swapped(v, lot) for k, v in value.items()}
        return out if any(out[k] is not v for k, v in value.items()) else value
    if type(value) in (list, tuple):
        items = [_swapped(v, lot) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    return value


def _holds_parked(obj: Any, lot: ParkingLot) -> bool:
    return any(_swapped(v, lot) is not v for v in getattr(obj, "__dict__", {}).values())


def _mirror(obj: Any, lot: ParkingLot, depth: int) -> Any:
    out = copy.copy(obj)
    for name, value in vars(obj).items():
        swapped = _swapped(value, lot)
        if swapped is value and depth and not isinstance(value, torch.Tensor) and _holds_parked(value, lot):
            swapped = _mirror(value, lot, depth - 1)  # the parameters object (its flat buffer or stage-3 shard)
        if swapped is not value:
            setattr(out, name, swapped)
    return out


def host_mirror(placement: Any, lot: ParkingLot) -> Any:
    """A read-only stand-in for ``placement`` whose parked tensors are their host copies (module docstring)."""
    return _mirror(placement, lot, depth=1)
