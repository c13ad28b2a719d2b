"""One process: nothing to communicate. The mean of one rank's gradient is that gradient."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.dispatch import accumulate_into
from .base import DONE, Communicator, Pending


class LocalCommunicator(Communicator):
    """One process: nothing is communicated or counted; a reduce-scatter is a copy (or add) into ``out``."""

    name = "local"
    communicates = False

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None):
        super().__init__(group, device, 1, 0)

    def wire_dtype(self, grad_dtype, reduce_dtype):
        return grad_dtype

    def prescale(self, grad_dtype, reduce_dtype) -> float:
        return 1.0

    def start_reduce_scatter(
        self, send, out, *, reduce_dtype, accumulate, workspace=None, bucket=None, phase=None
    ) -> Pending:
        if phase is not None:  # (nothing is issued on one rank, but the position still says where it is)
            self.position.at(phase)
        if accumulate:
            accumulate_into(out, send)
        else:
            out.copy_(send)
        return DONE

    def start_all_gather(self, output, input, bucket=None) -> Pending:
        if output.data_ptr() != input.data_ptr():  # in place (the engine's case) there is nothing to do
            output.copy_(input)
        return DONE

    def start_all_reduce(self, tensor) -> Pending:
        return DONE

    def reduce_step_stats(self, flags: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        return flags

    def agree(self, value: int, timeout: Optional[float] = None) -> list[int]:
        return [value]
