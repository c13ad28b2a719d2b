"""Collectives of one process group, one class per backend; each backend answers its own policy questions.

- :class:`NcclCommunicator`: CUDA tensors on NCCL. A real reduce-scatter that sums inside the collective, so
  gradients travel in ``reduce_dtype`` pre-scaled by 1/N (a low-precision sum then cannot overflow).
- :class:`GlooCommunicator`: everything else. torch's gloo ``reduce_scatter_tensor`` is slower than its
  ``all_reduce`` of the same buffer although it needs half the bytes (``bench/results/collectives_cpu.md``: 3.3M
  fp32 elements over 2 ranks, 18.5 ms vs 14.8 ms), so a reduce-scatter is one ``all_to_all_single`` (rank j gets
  slice j of every rank's bucket) into a receive buffer and a local sum of the N slices in rank order (9.8 ms,
  sum included). With an fp32 ``reduce_dtype`` a gradient then travels in its own dtype, unscaled, and the sum
  is taken in fp32 and divided by N once: exactly the reference's ``sum(grads) / N``, at half the bytes for
  bf16/fp16 gradients.
- :class:`LocalCommunicator`: one process (no process group, or a group of one): nothing to communicate; the
  mean of one rank's gradient is that gradient, and gradients go straight into the grad shard.

:func:`communicator_for` picks one. A test or a user who wants the communicating path on one rank (the only way
one GPU exercises NCCL) passes ``ZeroAdamW(..., communicator=NcclCommunicator(group, device))``.

The streams and the lifetime of a collective in flight: ``base.py``, [Note: streams].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .base import DONE, CollectiveTimeout, CommCounts, Communicator, Pending
from .gloo import GlooCommunicator
from .local import LocalCommunicator
from .nccl import NcclCommunicator, warn_if_blocking_wait

__all__ = [
    "DONE", "CollectiveTimeout", "CommCounts", "Communicator", "Pending", "GlooCommunicator", "LocalCommunicator",
    "NcclCommunicator", "warn_if_blocking_wait", "backend_for", "communicator_for", "fallback_device",
]  # fmt: skip


def backend_for(group: Optional[dist.ProcessGroup], device: torch.device) -> str:
    """The backend ``group`` uses for tensors on ``device``'s type ("nccl", "gloo", ...), whatever way the group
    was built: ``init_process_group("nccl")``, ``backend="cpu:gloo,cuda:nccl"`` or the default (no backend)."""
    config = dist.get_backend_config(group)  # e.g. "nccl" or "cpu:gloo,cuda:nccl"
    by_device = {}
    for part in config.split(","):
        dev, sep, name = part.partition(":")
        if not sep:
            return dev.strip().lower()
        by_device[dev.strip().lower()] = name.strip().lower()
    return by_device.get(device.type, by_device.get("cpu", next(iter(by_device.values()), "")))


def fallback_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """A device ``group`` can communicate on when the parameters' device is unknown (a failed construction)."""
    if dist.is_initialized() and backend_for(group, torch.device("cpu")) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def communicator_for(group: Optional[dist.ProcessGroup], device: torch.device) -> Communicator:
    """The communicator for ``group`` (the default group when None) and tensors on ``device``."""
    if not dist.is_initialized():
        return LocalCommunicator(device)
    if dist.get_world_size(group) == 1:
        return LocalCommunicator(device, group)
    if device.type == "cuda" and backend_for(group, device) == "nccl":
        return NcclCommunicator(group, device)
    return GlooCommunicator(group, device)
