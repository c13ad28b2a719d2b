"""Storages parked in host memory: the mechanism under ``ZeroAdamW.offload_states`` / ``reload_states``.

A tensor's bytes are moved by its *storage*, not by the tensor: the storage's bytes are copied into a host buffer of
their own, then the storage is resized to zero bytes (FSDP2's ``untyped_storage().resize_(0)``); reloading resizes it
back and copies the bytes in. Every view of the storage (a parameter's ``.data`` in the flat buffer, a bucket's slice
of the master, a view autograd or the engine keeps) stays the same Python object with the same shape, stride and
offset, and sees the bytes again after the reload: nothing is re-pointed, no bookkeeping of views is needed, and the
values come back bit for bit whatever the dtype or encoding (bf16, int8 codes, remainders). Freed means freed: on
CUDA the caching allocator gets the blocks back at once (``memory_allocated`` drops), and the caller empties its
cache so that another process can have them (``memory_reserved`` drops). Reading a parked storage through one of
its views is undefined (it holds no bytes): the owner refuses every call that would (``engine/sleep.py``).

Host buffers are made once per storage, pinned on CUDA when asked, and reused by every later cycle: 100 offload /
reload cycles allocate nothing after the first (no growth of the process's resident memory; DeepSpeed's offload
allocated new pinned buffers per call). A storage that no longer exists (a staging pool grown, a group added) loses
its buffer at the next offload. Without a GPU the buffers are freed by each reload instead (:attr:`keeps_buffers`).

Streams ([Note: parking streams]): a non-blocking park queues the device-to-host copies on one side stream that first
waits for the current stream (the copies read the last values written); each storage is then freed with the side
stream recorded on its block (``record_stream``), so the allocator hands the block to nobody before its copy read it.
A reload (blocking or not) first makes its stream wait for the side stream, so it never reads a host buffer a copy is
still filling; a non-blocking reload queues its host-to-device copies on the side stream and the current stream waits
for them (work queued after the call reads the reloaded bytes; no host synchronisation). A host read of a parked
buffer (:meth:`ParkingLot.host_view`) synchronises with the last copies first. Without a GPU every copy is synchronous.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


class _Slot:
    """One storage this lot knows: its tensor (a strong reference: the storage, and so its identity, stays alive while
    the slot does), its host buffer (made at its first park, then reused) and whether it is parked now."""

    __slots__ = ("tensor", "host", "nbytes", "parked", "freed")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.host: Optional[torch.Tensor] = None
        self.nbytes = 0
        self.parked = False
        self.freed = False  # its storage was resized to zero (not a CPU storage numpy shares: see park)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (made fresh: one made before a resize would outlive its bytes)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the same for every view of it, and across resizes)."""
    with torch._C.DisableTorchFunctionSubclass():  # (stage 3's parameters check every op; this reads no data)
        return t.untyped_storage()._cdata


class ParkingLot:
    """Parks storages of tensors on ``device`` in host buffers, and brings them back."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: dict[int, _Slot] = {}  # storage key -> slot
        # Host buffers outlive the reload where they are worth keeping: on CUDA (pinning is slow, and the next cycle
        # needs them again). On a CPU-only run the device is host memory too, and keeping them would double the
        # optimizer's memory while training: they are freed by the reload (the tests set this to check the reuse).
        self.keeps_buffers = self.cuda
        self._stream = None  # the side stream of non-blocking copies: one, so that they stay in order
        self._queued = None  # an event after the last copies queued on the side stream

    # ---------------------------------------------------------------- what is where
    def parked_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values() if s.parked)

    def kept_bytes(self) -> int:
        """Bytes parked but still allocated (CPU storages numpy shares: they cannot be resized)."""
        return sum(s.nbytes for s in self.slots.values() if s.parked and not s.freed)

    def host_bytes(self) -> int:
        """Bytes of host buffers this lot holds (kept for the next cycle while the storages are back)."""
        return sum(s.host.numel() for s in self.slots.values() if s.host is not None)

    def is_parked(self, t: torch.Tensor) -> bool:
        slot = self.slots.get(storage_key(t))
        return slot is not None and slot.parked

    def host_view(self, t: torch.Tensor, wait: bool = True) -> torch.Tensor:
        """``t`` itself while its storage is on the device; while parked, the same elements in its host buffer, after
        the copies in flight finished (``wait``; else the caller reads nothing before they did). Writes to it are
        written back by the reload. ``t`` must exist already (a buffer, not a view made now): no view of a parked
        storage can be made, since it holds no bytes; slice the host view instead."""
        slot = self.slots.get(storage_key(t))
        if slot is None or not slot.parked:
            return t
        if wait:
            self.synchronize()
        with torch._C.DisableTorchFunctionSubclass():
            typed = slot.host.view(t.dtype)
            return typed.as_strided(t.shape, t.stride(), t.storage_offset())

    def synchronize(self) -> None:
        """The host waits for the copies queued on the side stream."""
        if self._queued is not None:
            self._queued.synchronize()
            self._queued = None

    # ---------------------------------------------------------------- the two moves
    def park(self, tensors: Iterable[torch.Tensor], pin_memory: bool, non_blocking: bool) -> int:
        """Copy the storage of every tensor in ``tensors`` (each storage once) to its host buffer and free it on the
        device; storages parked already or holding no bytes are skipped. Returns the bytes freed."""
        todo: list[_Slot] = []
        for t in tensors:
            key = storage_key(t)
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(t)
            if slot.parked or slot in todo:
                continue
            with torch._C.DisableTorchFunctionSubclass():
                nbytes = t.untyped_storage().nbytes()
            if nbytes == 0:  # (a released stage-3 storage: nothing to keep)
                continue
            if slot.host is None or slot.host.numel() != nbytes:
                pin = pin_memory and self.cuda
                slot.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            slot.nbytes = nbytes
            todo.append(slot)
        if not todo:
            return 0
        side = self._side_stream() if (self.cuda and non_blocking) else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch._C.DisableTorchFunctionSubclass():
            for slot in todo:
                storage = slot.tensor.untyped_storage()
                src = _bytes_of(storage, self.device)
                if side is not None:
                    with torch.cuda.stream(side):
                        slot.host.copy_(src, non_blocking=True)
                    src.record_stream(side)  # the block is reused by nobody before this copy read it
                else:
                    slot.host.copy_(src)
                del src
                # A CPU storage numpy shared once (a checkpoint's ``.numpy()`` views) can never be resized again: its
                # bytes are copied but stay allocated (no GPU storage is ever in that case).
                slot.freed = storage.resizable()
                if slot.freed:
                    storage.resize_(0)
                slot.parked = True
        if side is not None:
            self._queued = torch.cuda.Event()
            self._queued.record(side)
        return sum(s.nbytes for s in todo)

    def unpark(self, non_blocking: bool) -> int:
        """Every parked storage back on the device with its bytes. Returns the bytes brought back."""
        todo = [s for s in self.slots.values() if s.parked]
        if not todo:
            return 0
        current = torch.cuda.current_stream(self.device) if self.cuda else None
        side = self._side_stream() if (self.cuda and non_blocking) else None
        if self.cuda and self._stream is not None:
            current.wait_stream(self._stream)  # a non-blocking park may still be filling the host buffers
        if side is not None:
            side.wait_stream(current)
        with torch._C.DisableTorchFunctionSubclass():
            for slot in todo:
                storage = slot.tensor.untyped_storage()
                if slot.freed:
                    storage.resize_(slot.nbytes)  # allocated on the current stream
                dst = _bytes_of(storage, self.device)
                if side is not None:
                    with torch.cuda.stream(side):
                        dst.copy_(slot.host, non_blocking=True)
                else:
                    dst.copy_(slot.host)
                slot.parked = False
                if not self.keeps_buffers:
                    slot.host = None
        if side is not None:
            current.wait_stream(side)  # work queued after the call reads the bytes (no host wait)
            self._queued = torch.cuda.Event()
            self._queued.record(side)
        return sum(s.nbytes for s in todo)

    def forget_except(self, keys: set[int]) -> None:
        """Drop the slots (and host buffers) of storages not in ``keys`` and not parked: they are gone or no longer
        the owner's (a staging pool that grew)."""
        for key in [k for k, s in self.slots.items() if k not in keys and not s.parked]:
            del self.slots[key]

    def _side_stream(self):
        if self._stream is None:
            # one stream for every parking copy: they stay in order with each other, off the compute stream
            self._stream = torch.cuda.Stream(self.device)
        return self._stream
