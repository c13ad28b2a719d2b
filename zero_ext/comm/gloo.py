"""gloo: a reduce-scatter as one all-to-all and a local sum in rank order.

torch's gloo ``reduce_scatter_tensor`` is slower than its ``all_reduce`` of the same buffer although it needs half
the bytes (``bench/results/collectives_cpu.md``: 3.3M fp32 elements over 2 ranks, 18.5 ms vs 14.8 ms), so a
reduce-scatter is one ``all_to_all_single`` (rank j gets slice j of every rank's bucket) into a receive buffer and
a local sum of the N slices in rank order (9.8 ms, sum included). With an fp32 ``reduce_dtype`` a gradient then
travels in its own dtype, unscaled, and the sum is taken in fp32 and divided by N once: exactly the reference's
``sum(grads) / N``, at half the bytes for bf16/fp16 gradients.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.dispatch import accumulate_into
from .base import Communicator, Pending


class GlooCommunicator(Communicator):
    """gloo (CPU tensors, or any device whose group backend is not NCCL): all-to-all + a local rank-order sum."""

    name = "gloo"
    # Every gloo collective costs a fixed ~0.5-1 ms of thread hand-offs on cores that backward keeps busy; on
    # the 3.3M-param benchmark GPT at 2 ranks, 8 buckets took 1.05x DDP's step, 2-4 buckets 0.92-1.01x
    # (bench/results/engine_step_cpu.md, Findings; per-collective costs: bench/results/collectives_cpu.md).
    buckets_per_model = 4

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        warn_if_device_syncs(torch.device(device))
        super().__init__(group, device, dist.get_world_size(group), dist.get_rank(group))

    def _exact(self, reduce_dtype) -> bool:
        return reduce_dtype == torch.float32

    def wire_dtype(self, grad_dtype, reduce_dtype):
        # bf16/fp16 -> fp32 is exact: sending the gradient as it is loses nothing and halves the bytes.
        return grad_dtype if self._exact(reduce_dtype) else reduce_dtype

    def prescale(self, grad_dtype, reduce_dtype) -> float:
        return 1.0 if self._exact(reduce_dtype) else 1.0 / self.world_size

    def _needs_temp(self, wire_dtype, reduce_dtype, accumulate) -> bool:
        """A separate fp32/reduce_dtype shard for the sum: when it must be added to (or cast into) ``out`` and
        the consumed ``send`` buffer cannot hold it (one shard of sums in the sum dtype)."""
        sum_dtype = torch.float32 if self._exact(reduce_dtype) else reduce_dtype
        if not accumulate and sum_dtype == torch.float32:
            return False
        return not (accumulate and self.world_size * wire_dtype.itemsize >= sum_dtype.itemsize)

    def workspace_bytes(self, bucket_numel, wire_dtype, reduce_dtype, accumulate) -> int:
        receive = bucket_numel * wire_dtype.itemsize
        if not self._needs_temp(wire_dtype, reduce_dtype, accumulate):
            return receive
        sum_dtype = torch.float32 if self._exact(reduce_dtype) else reduce_dtype
        return receive + bucket_numel // self.world_size * sum_dtype.itemsize

    def start_reduce_scatter(
        self, send, out, *, reduce_dtype, accumulate, workspace=None, bucket=None, phase=None
    ) -> Pending:
        n, world = send.numel(), self.world_size
        shard = n // world
        need = self.workspace_bytes(n, send.dtype, reduce_dtype, accumulate)
        if workspace is None or workspace.dtype != torch.uint8 or workspace.numel() < need:
            raise ValueError(f"start_reduce_scatter: `workspace` must be a uint8 buffer of at least {need} bytes")
        exact = self._exact(reduce_dtype)
        sum_dtype = torch.float32 if exact else reduce_dtype
        received = workspace[: n * send.element_size()].view(send.dtype)
        slices = received.view(world, shard).unbind(0)
        if not accumulate and out.dtype == sum_dtype:
            total = out
        elif self._needs_temp(send.dtype, reduce_dtype, accumulate):
            start = n * send.element_size()
            total = workspace[start : start + shard * sum_dtype.itemsize].view(sum_dtype)
        else:  # accumulate: the sent buffer is free once transferred
            total = send.view(torch.uint8)[: shard * sum_dtype.itemsize].view(sum_dtype)

        def epilogue() -> None:
            # Rank order, one slice at a time, in the sum dtype (a bf16 slice is added to an fp32 total in fp32):
            # the same association on every rank and for every stage.
            if world == 1:
                total.copy_(slices[0])
            elif total.dtype == send.dtype:
                torch.add(slices[0], slices[1], out=total)
            else:
                total.copy_(slices[0])
                total.add_(slices[1])
            for s in slices[2:]:
                total.add_(s)
            if exact and world != 1:
                total.div_(world)
            if accumulate:
                accumulate_into(out, total)
            elif total is not out:
                out.copy_(total)

        collective = functools.partial(dist.all_to_all_single, received, send, group=self.group, async_op=True)
        return self._on_stream(
            self.reduce_scatter_stream, "reduce_scatter", collective, epilogue, (send, out, workspace), bucket, phase
        )

    def reduce_step_stats(self, flags: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        # One collective for both (every gloo collective has a fixed cost): the device is the host here.
        both = torch.cat([stats.to("cpu"), flags])
        self.start_all_reduce(both).wait()
        stats.copy_(both[: stats.numel()])
        return both[stats.numel() :]

    def agree(self, value: int, timeout: Optional[float] = None) -> list[int]:
        return self._agree_on(torch.device("cpu"), value, timeout)


_warned_device_syncs = False


def warn_if_device_syncs(device: torch.device) -> bool:
    """Warn once per process when gloo serves parameters on a GPU; returns whether it does.

    Warned, not refused: the results are right, and gloo is what a GPU job falls back to where NCCL is missing or
    being ruled out while debugging (torch's DDP accepts the same setup). But it costs what ZeroAdamW exists to
    avoid: ``reduce_step_stats`` moves the step's norm statistics to the host, one device synchronisation per
    ``step()``, and every gradient bucket goes through gloo's host copies instead of overlapping backward on the
    GPU. Whoever chose gloo by accident (a CPU example's ``init_process_group("gloo")``) learns what to change."""
    global _warned_device_syncs
    syncs = device.type == "cuda"
    if syncs and not _warned_device_syncs:
        _warned_device_syncs = True
        warnings.warn(
            f"zero_ext.ZeroAdamW: the parameters are on {device} but the process group's backend for them is gloo: "
            "every step() synchronises the host with the GPU (the step's statistics are reduced on the host) and "
            "the gradients travel through gloo's host copies, so nothing overlaps backward. Use NCCL for CUDA "
            'parameters: init_process_group("nccl") or init_process_group("cpu:gloo,cuda:nccl"), or pass '
            "process_group= an NCCL group.",
            stacklevel=5,  # ZeroAdamW(...) -> communicator_for -> GlooCommunicator -> here
        )
    return syncs
