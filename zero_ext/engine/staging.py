"""The staging pool: byte buffers that carry buckets of gradients onto the wire.

An entry holds what one bucket's reduce-scatter needs while it is in flight: the send buffer (the gradients cast
to the wire dtype and pre-scaled, when the gradient strategy stages them) followed by the communicator's
workspace (gloo's receive buffer, NCCL's output shard). Entries are sized once, for the largest bucket, and
viewed in whatever dtype a bucket travels in, so fp32 and bf16 flat groups share one pool.

The pool is made with the sharded state and sized by the reducer (:meth:`StagingPool.size`), which knows the
wire dtypes: at construction, and again when ``add_param_group`` adds buckets. It then holds ``capacity`` entries and reuses them in launch order: a bucket that needs an entry takes a
free one, else waits for the oldest in flight (whose collective then has to finish first). Only when every entry
is held by a bucket still filling (gradients arriving far out of layout order) does the pool grow by one; it
never shrinks, so that happens in the first steps only, and ``nbytes`` is what the ledger reports.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import Pending


class StagingEntry:
    """One byte buffer of the pool: ``send_bytes`` of send buffer, then the workspace."""

    __slots__ = ("buffer", "send_bytes", "workspace", "send_view", "holder", "pending")

    def __init__(self, send_bytes: int, workspace_bytes: int, device: torch.device):
        total = send_bytes + workspace_bytes
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device) if total else None
        self.send_bytes = send_bytes
        # Views made once (offload_states() resizes the storage in place, which every view follows): the
        # communicator's workspace, and the send buffer as the holder's bucket travels (set by acquire)
        self.workspace: Optional[torch.Tensor] = None if self.buffer is None else self.buffer[send_bytes:]
        self.send_view: Optional[torch.Tensor] = None
        self.holder: Optional[object] = None  # the bucket filling or sending from this entry
        self.pending: Optional[Pending] = None  # the collective reading/writing it

    def send(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The send buffer as ``numel`` elements of ``dtype``."""
        return self.buffer[: numel * dtype.itemsize].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


class StagingPool:
    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self.send_bytes = self.workspace_bytes = 0
        self.used = False
        self.entries: list[StagingEntry] = []
        self._inflight: list[StagingEntry] = []  # launched entries, oldest first

    def size(self, send_bytes: int, workspace_bytes: int) -> None:
        """Entries of ``send_bytes`` of send buffer and ``workspace_bytes`` of workspace each (the largest bucket's),
        ``capacity`` of them at least: before the first bucket is staged, and again when ``add_param_group`` added
        buckets (nothing in flight then). Entries of that size already here are kept; a larger size replaces them."""
        if self._inflight or any(e.holder is not None for e in self.entries):
            raise RuntimeError("StagingPool.size: entries are in use")
        if (send_bytes, workspace_bytes) != (self.send_bytes, self.workspace_bytes):
            self.entries = []
        self.send_bytes, self.workspace_bytes = send_bytes, workspace_bytes
        self.used = send_bytes + workspace_bytes > 0
        if not self.used:
            self.entries = []
        missing = max(0, self.capacity - len(self.entries)) if self.used else 0
        self.entries += [StagingEntry(send_bytes, workspace_bytes, self.device) for _ in range(missing)]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def tensors(self) -> list[torch.Tensor]:
        return [e.buffer for e in self.entries if e.buffer is not None]

    def acquire(self, holder: object, dtype: Optional[torch.dtype] = None, numel: int = 0) -> Optional[StagingEntry]:
        """An entry for ``holder``: a free one, else the oldest in flight (the current stream waits for its
        collective), else a new one. None when nothing needs staging. With ``dtype``, its ``send_view`` is the send
        buffer as ``numel`` elements of it (the holder's bucket as it travels)."""
        if not self.used:
            return None
        entry = next((e for e in self.entries if e.holder is None and e.pending is None), None)
        if entry is None and self._inflight:
            entry = self._inflight.pop(0)
            entry.pending.wait()
            entry.pending = None
        if entry is None:
            entry = StagingEntry(self.send_bytes, self.workspace_bytes, self.device)
            self.entries.append(entry)
        entry.holder = holder
        entry.send_view = None if dtype is None else entry.send(dtype, numel)
        return entry

    def launched(self, entry: Optional[StagingEntry], pending: Pending) -> None:
        """``entry``'s bucket is on the wire: it is busy until ``pending`` is waited for."""
        if entry is None:
            return
        entry.holder = None
        entry.pending = pending
        self._inflight.append(entry)

    def wait_all(self) -> None:
        """The current stream waits for every collective still using an entry."""
        for entry in self._inflight:
            entry.pending.wait()
            entry.pending = None
        self._inflight.clear()
