"""Every rank's random number generators, as a checkpoint's ``extra`` can hold them (JSON-like values and tensors,
no pickle): Python's ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is in use, the
current CUDA device's generator.

``gather`` collects every rank's state (a collective, on the host); ``restore(states, rank)`` sets this process's
generators from saved rank ``rank % len(states)``: at the world size of the save every rank gets its own state back;
at another one the ranks reuse the saved states in turn (documented where it is used)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..comm import Communicator


def capture() -> dict[str, Any]:
    """This process's generators."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def apply(state: dict[str, Any]) -> None:
    """Set this process's generators from one :func:`capture` (as a checkpoint returns it)."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather(comm: Communicator) -> list[dict[str, Any]]:
    """Collective over ``comm``'s ranks: every rank's :func:`capture`, in rank order (the caller's alone on one rank).
    Through ``comm.cpu_group``, never an NCCL group: ``all_gather_object`` there would pickle into CUDA tensors and
    wait for the device."""
    mine = capture()
    if comm.process_count == 1:
        return [mine]
    states: list[Any] = [None] * comm.process_count
    dist.all_gather_object(states, mine, group=comm.cpu_group)
    return states


def restore(states: list[dict[str, Any]], rank: int) -> int:
    """Apply saved rank ``rank % len(states)``'s state here; returns which saved rank that was."""
    source = rank % len(states)
    apply(states[source])
    return source
