"""``offload="cpu"`` (ZeRO-Offload): the update rule's state (fp32 master and moments) and grad shard in host memory, updated
there by the CPU fused AdamW kernel (AVX-512/AVX2 + OpenMP).

Backward: a bucket's reduce-scatter lands in a small ring of device buffers (:class:`LandingRing`); right after it
is launched, a copy stream waits for it and for the stream that launched it (no host wait: on one rank the
"reduce-scatter" is a copy on that stream, with no event of its own) and copies the mean to pinned host memory, so
the device-to-host copies overlap the rest of backward. Before the step reads the grad shard, each copy is waited for
(the host must see the bytes) and added to (stages 2 and 3 accumulate over micro-batches) or written into the
shard. A landing slot is reused only after its copy finished.

Step: bucket by bucket, the CPU kernel updates the host state and writes the new low-precision parameters into a
pinned staging buffer (:class:`ParamOutRing`); the runs it wrote are copied host-to-device (asynchronously: the next
bucket's CPU update overlaps the copy) into the rank's slice of the parameters, before the bucket's all-gather.
fp32 parameters keep a separate fp32 master on the host and are copied from it; the CPU writes the master again
(the next update, a loaded state) only after an event says that copy read it.

Without a GPU the same path runs with the landing ring and the host state as separate CPU buffers: the same copies,
synchronous, no streams; on one process the gradients are instead added straight into the grad shard, as in memory
(no ring, no staging pool).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from ..layout import Bucket, Layout, Range
from ..update.adamw import MASTER, UpdateRule
from .device import BucketState, DeviceState, Unit, items_of, views_of

# Bucket shards in flight between their reduce-scatter and the host grad shard: on CUDA, the fifth launch waits for
# the first one's copy (device memory; the pinned twins are host memory). Without a GPU the landing completes at
# the collective's own wait, so two suffice.
LANDING_SLOTS = {"cuda": 4, "cpu": 2}


class LandingRing:
    """``slots`` device buffers of ``numel`` fp32 each (a bucket's shard of the reduced gradient), with pinned host
    twins on CUDA (the device-to-host copies' destinations)."""

    def __init__(self, numel: int, device: torch.device):
        slots = LANDING_SLOTS["cuda" if device.type == "cuda" else "cpu"]
        self.free = list(range(slots))
        self.device_buffers = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(slots)]
        cuda = device.type == "cuda"
        self.host_buffers = (
            [torch.empty(numel, dtype=torch.float32, pin_memory=True) for _ in range(slots)] if cuda else []
        )


class ParamOutRing:
    """Host buffers (pinned on CUDA) the kernel writes a unit's new low-precision parameters into, before they are
    copied to the device; a slot is reused only once its copy finished (an event per slot)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, slots: int = 2):
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=cuda) for _ in range(slots)]
        self.events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        slot = self._next
        self._next = (slot + 1) % len(self.buffers)
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # its previous host-to-device copy has read it
            self.events[slot] = None
        return slot, self.buffers[slot][:numel]

    def copied(self, slot: int, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events[slot] = event


def copy_runs_to_device(params, unit: Unit, source: torch.Tensor, updated: Sequence[Range]) -> None:
    """The ``updated`` runs of ``source`` (the unit's new parameters, on the host) into the rank's slice of the
    parameters, asynchronously from pinned memory."""
    with torch._C.DisableTorchFunctionSubclass():  # stage 3's shard is a ShardedParameter's storage
        target = unit.rows.of(params.rank_slice(unit.bucket))
        for r in updated:
            r.of(target).copy_(r.of(source), non_blocking=True)


def fetch_params(params, bucket: Bucket, rows: Range, out: torch.Tensor) -> None:
    """``rows`` of the rank's slice of ``bucket``'s parameters into ``out`` (host memory), for an update that reads
    them (param_remainders: they are the master's high half). Synchronous: the CPU kernel reads ``out`` next.
    NOTE: a device-to-host copy of 2 bytes per element before each bucket's CPU update, not overlapped with the
    previous bucket's update; the host keeps 2 bytes per element less for it (not measured on a GPU)."""
    with torch._C.DisableTorchFunctionSubclass():  # stage 3's shard is a ShardedParameter's storage
        out.copy_(rows.of(params.rank_slice(bucket)))


class HostGradients(DeviceState):
    """The reduced gradient shard in host memory, landed through :class:`LandingRing` (shared by both offloads)."""

    resident = False  # the reduced gradient lands in the ring first
    # One process without a GPU adds the gradients straight into the grad shard (see _init_gradients); False keeps
    # the landing ring there too (tests/offload/test_offload_stream_order.py walks the CUDA path's copies on the CPU).
    IN_PLACE_WITHOUT_GPU = True

    @classmethod
    def update_device_on(cls, device) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def adds_in_place_on(cls, device, world_size: int) -> bool:
        return cls.IN_PLACE_WITHOUT_GPU and torch.device(device).type != "cuda" and world_size == 1

    def _init_gradients(self, layout: Layout, params, device: torch.device, rule: UpdateRule) -> None:
        self.layout, self.params, self.device, self.rule = layout, params, torch.device(device), rule
        self.update_device = self.update_device_on(device)
        # The master lives off the device even for fp32 parameters; with remainders its high half is the parameters.
        self.master_copy = not rule.param_remainders
        self.cuda = self.device.type == "cuda"
        self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, pin_memory=self.cuda)
        # One process without a GPU: the grad shard is on the params' device and nothing is reduced, so the gradients
        # are added straight into it as the in-memory placement does (grads.ShardGrads), with no landing ring and no
        # staging pool: 48 MiB less at the default 4M-element buckets and bf16 parameters (ring 2 x 16 MiB, staging
        # 2 x 8 MiB), the same bits. With more ranks the ring stays (the CPU runs the CUDA path's logic, tested).
        self.adds_in_place = self.adds_in_place_on(self.device, layout.world_size)
        largest = max((b.shard_numel for b in layout.buckets), default=0)
        self.ring = None if self.adds_in_place else LandingRing(largest, self.device)
        # copy: the reduced gradients go device-to-host on it while backward goes on (one stream, one purpose).
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._landing: list[tuple] = []  # launched landings, oldest first

    def reset_master(self) -> None:
        if self.rule.param_remainders:  # master = the parameters exactly: remainder 0, no tie
            self._remainder().zero_()
            self._clear_ties()
            return
        for bucket in self.layout.buckets:
            with torch._C.DisableTorchFunctionSubclass():
                self.write(MASTER, bucket.shard_range, self.params.rank_slice(bucket))

    def grad_target(self, bucket: Bucket) -> tuple[torch.Tensor, bool]:
        if self.ring is None:  # the grad shard is on the params' device (see _init_gradients)
            return bucket.shard_range.of(self.grad), True
        if not self.ring.free:
            self._finish_one()
        slot = self.ring.free.pop(0)
        self._slot_of_target = slot
        return self.ring.device_buffers[slot][: bucket.shard_numel], False

    def landed(self, bucket: Bucket, target: torch.Tensor, pending, accumulate: bool) -> None:
        slot = self._slot_of_target
        if self.copy_stream is None:  # CPU: the collective completes at the wait in _finish_one
            self._landing.append((bucket, slot, pending, None, target, accumulate))
            return
        host = self.ring.host_buffers[slot][: bucket.shard_numel]
        # The copy stream waits for the stream that wrote `target` (no host wait), taken before the copy stream
        # becomes current: a communicator that reduces on the current stream (one rank: a copy into `target`)
        # returns a pending with no event, and the copy would otherwise read the previous round's bytes. It also
        # waits for the collective's own pending (a side stream's event) where there is one.
        producer = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(producer)
        pending.wait_on(self.copy_stream)
        with torch.cuda.stream(self.copy_stream):
            host.copy_(target, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._landing.append((bucket, slot, None, done, host, accumulate))

    def _finish_one(self) -> None:
        bucket, slot, pending, done, values, accumulate = self._landing.pop(0)
        if pending is not None:
            pending.wait()
        if done is not None:
            done.synchronize()  # the host must see the bytes it is about to add
            # the next reduce-scatter into this slot (launched after the current stream) comes after the copy
            torch.cuda.current_stream(self.device).wait_event(done)
        shard = bucket.shard_range.of(self.grad)
        if accumulate:
            shard.add_(values)
        else:
            shard.copy_(values)
        self.ring.free.append(slot)

    def finish_landing(self) -> None:
        while self._landing:
            self._finish_one()

    def _landing_tensors(self) -> dict[str, object]:
        ring = self.ring
        return {"grad_shard": self.grad, "landing": ring.device_buffers if ring else [],
                "landing_host": ring.host_buffers if ring else []}  # fmt: skip

    def _landing_where(self) -> dict[str, str]:
        return {"grad_shard": "host", "landing": "device" if self.cuda else "host", "landing_host": "host"}


class HostState(HostGradients):
    location = "host"

    def __init__(self, layout: Layout, params, device: torch.device, rule: UpdateRule):
        self._init_gradients(layout, params, device, rule)
        n = layout.shard_numel
        self.buffers = {k.name: torch.zeros(k.items(n), dtype=k.dtype, pin_memory=self.cuda) for k in rule.kinds}
        largest = max((b.shard_numel for b in layout.buckets), default=0)
        self.out = ParamOutRing(largest, params.dtype, self.device) if params.dtype != torch.float32 else None
        # fp32 parameters are copied to the device from the pinned master itself (asynchronously): the event of the
        # last such copy, which every CPU write of the master waits for (the update, a loaded or followed master).
        self._master_read: Optional[torch.cuda.Event] = None
        self.reset_master()

    def _master_writable(self) -> None:
        """The host-to-device copies that read the master have finished: the CPU may overwrite it."""
        if self._master_read is not None:
            self._master_read.synchronize()
            self._master_read = None

    # ---------------------------------------------------------------- the update
    def units(self, buckets: Sequence[Bucket]) -> Iterator[Unit]:
        self._master_writable()  # the kernel updates the master in place
        for bucket in buckets:
            r = bucket.shard_range
            slot, out = self.out.take(bucket.shard_numel) if self.out is not None else (None, None)
            if self.rule.param_remainders:  # the kernel reads the master's high half from the parameters
                fetch_params(self.params, bucket, Range(0, bucket.shard_numel), out)
            views = BucketState(views_of(self.buffers, r, self.rule.blocks), r.of(self.grad), out, self.rule.blocks)
            self._out_slot = slot
            yield Unit(bucket, Range(0, bucket.shard_numel), views, True)

    def unit_done(self, unit: Unit, updated: Sequence[Range]) -> None:
        """The runs the kernel wrote, host to device, into the rank's slice (fp32 params: from the master)."""
        if not updated:
            return
        source = unit.views.param_out if unit.views.param_out is not None else unit.views.master
        copy_runs_to_device(self.params, unit, source, updated)
        if self.out is not None:
            self.out.copied(self._out_slot, self.device)
        elif self.cuda:
            self._master_read = torch.cuda.Event()
            self._master_read.record(torch.cuda.current_stream(self.device))

    # ---------------------------------------------------------------- CPU writes of the master wait for its copies
    def write(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        if kind == MASTER:
            self._master_writable()
        super().write(kind, shard_range, values)

    def host_view(self, kind: str, shard_range: Range) -> Optional[torch.Tensor]:
        if kind == MASTER:  # the caller writes into it
            self._master_writable()
        return super().host_view(kind, shard_range)

    # ---------------------------------------------------------------- serialisers and the ledger
    def _views(self, kind: str, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        items = items_of(kind, shard_range, self.rule.blocks)
        return [(items, items.of(self._buffer(kind)))]

    def tensors(self) -> dict[str, object]:
        return {
            **self.buffers, **self._landing_tensors(), "param_out": self.out.buffers if self.out is not None else [],
        }  # fmt: skip

    def where(self) -> dict[str, str]:
        return {**dict.fromkeys((*self.rule.kind_names, "param_out"), "host"), **self._landing_where()}
