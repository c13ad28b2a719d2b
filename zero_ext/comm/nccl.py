"""NCCL: a real reduce-scatter that sums inside the collective, so gradients travel in ``reduce_dtype`` pre-scaled
by 1/N (a low-precision sum then cannot overflow)."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.dispatch import accumulate_into
from .base import Communicator, Pending
from .collectives import reduce_scatter_flat


class NcclCommunicator(Communicator):
    """NCCL (CUDA tensors): a real reduce-scatter on the ``reduce_scatter`` side stream."""

    name = "nccl"

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        super().__init__(group, device, dist.get_world_size(group), dist.get_rank(group))
        warn_if_blocking_wait()
        # Host-side agreements (step()'s per-parameter flags, checkpoint votes, every rank's generators in a
        # checkpoint) go through gloo on CPU tensors, so the host learns them without waiting for the device: the
        # group itself when it has a CPU backend (init_process_group() with no backend, or "cpu:gloo,cuda:nccl"),
        # else a gloo group of the same ranks (created by every one of those ranks, here, collectively).
        from . import backend_for

        if backend_for(group, torch.device("cpu")) == "gloo":
            self.cpu_group = group
        else:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self.cpu_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)

    def workspace_bytes(self, bucket_numel, wire_dtype, reduce_dtype, accumulate) -> int:
        # The collective's output shard, unless it can land in the fp32 grad shard directly.
        direct = not accumulate and wire_dtype == torch.float32
        return 0 if direct else bucket_numel // self.world_size * wire_dtype.itemsize

    def start_reduce_scatter(
        self, send, out, *, reduce_dtype, accumulate, workspace=None, bucket=None, phase=None
    ) -> Pending:
        shard = send.numel() // self.world_size
        need = self.workspace_bytes(send.numel(), send.dtype, reduce_dtype, accumulate)
        if need and (workspace is None or workspace.dtype != torch.uint8 or workspace.numel() < need):
            raise ValueError(f"start_reduce_scatter: `workspace` must be a uint8 buffer of at least {need} bytes")
        target = out if need == 0 else workspace[:need].view(send.dtype)[:shard]

        def epilogue() -> None:
            if accumulate:
                accumulate_into(out, target)
            elif target is not out:
                out.copy_(target)

        collective = functools.partial(reduce_scatter_flat, target, send, group=self.group, async_op=True)
        return self._on_stream(
            self.reduce_scatter_stream, "reduce_scatter", collective, epilogue, (send, out, workspace), bucket, phase
        )

    def reduce_step_stats(self, flags: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        if stats.device.type == "cpu":  # offloaded state: the norm's sums are on the host too; one host collective
            both = torch.cat([stats, flags])
            self.host_collective("all_reduce", both, lambda: dist.all_reduce(both, group=self.cpu_group, async_op=True))
            stats.copy_(both[: stats.numel()])
            return both[stats.numel() :]
        self.host_collective("all_reduce", flags, lambda: dist.all_reduce(flags, group=self.cpu_group, async_op=True))
        self.start_all_reduce(stats).wait()
        return flags

    def abort(self) -> None:
        # The ranks diverged (divergence.py, found where the host waits: step()'s host collective): the NCCL
        # collectives queued on the device will never pair up. Aborting the communicator makes them, and every
        # later use of the group, fail now instead of at NCCL's watchdog timeout (10 minutes by default).
        dist.distributed_c10d._abort_process_group(self.group)

    def agree(self, value: int, timeout: Optional[float] = None) -> list[int]:
        # On the host, through the CPU group: no device sync, and no dependence on torch.cuda.current_device()
        # (without set_device every rank would otherwise gather on cuda:0).
        return self._agree_on(torch.device("cpu"), value, timeout, group=self.cpu_group)


_warned_blocking_wait = False


def warn_if_blocking_wait() -> bool:
    """Warn once when ``TORCH_NCCL_BLOCKING_WAIT`` (or the older ``NCCL_BLOCKING_WAIT``) is set: it turns every
    ``work.wait()`` into a host block, so nothing overlaps and ``step()`` synchronises with the host."""
    global _warned_blocking_wait
    value = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("NCCL_BLOCKING_WAIT", "0"))
    blocking = value.strip().lower() in ("1", "true", "yes", "on")
    if blocking and not _warned_blocking_wait:
        _warned_blocking_wait = True
        warnings.warn(
            "zero_ext.ZeroAdamW: TORCH_NCCL_BLOCKING_WAIT is set, so every NCCL wait blocks the host: gradient "
            "reduction no longer overlaps backward and step() synchronises with the host. Unset it (use "
            "TORCH_NCCL_ASYNC_ERROR_HANDLING for error handling instead) unless you need it for debugging.",
            stacklevel=3,
        )
    return blocking
