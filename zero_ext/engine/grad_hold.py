"""One write per bucket instead of one per gradient: the gradients of the bucket being filled wait in ``param.grad``.

A kernel launch costs the host a few microseconds in C++ and tens through a Python Triton launcher, whatever the
tensor's size; a model has hundreds of small parameters, so writing each gradient into its bucket the moment it
arrives made backward launch-bound (bench/results/backward_hooks_cpu.md). Instead a strategy holds the gradients
of one bucket at a time, where autograd left them, and writes them all with one multi-tensor call (``ops.flatten_``:
one CUDA launch however many tensors) when the bucket launches, or when a gradient of another bucket arrives
first. Then it frees them (``param.grad = None``), as it did one by one before.

Memory: the gradients of at most one bucket are held at any time, in the parameters' dtype, and at most
``HOLD_ELEMENTS`` of them: the hold is written out when it reaches that, so what waits is at most
``min(bucket_size, HOLD_ELEMENTS)`` elements plus the last gradient (a parameter larger than that is written at
once; autograd produced its gradient whole anyway). The staging pool already holds two buckets in the wire dtype,
so in bf16 with an fp32 wire this adds at most a quarter of the pool during backward, and nothing between steps.

A parameter's gradient may arrive twice in one backward pass (reentrant activation checkpointing where the
parameter is also used outside the checkpointed part). While held, autograd adds the second into ``param.grad``
itself (as it does without hooks), so nothing more is needed and it does not count again towards its bucket;
once written, the strategy adds it to what it wrote (:attr:`Arrival.AGAIN_WRITTEN`).
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from ..layout import Slot
from .bucket_runtime import BucketRuntime

# NOTE: 2^24 elements (32 MiB of bf16): writing once per 16M elements is one call per many parameters for any model,
# while the hold stays small next to a large model's buckets (the NCCL default cuts the model in 8).
HOLD_ELEMENTS = 1 << 24


class Arrival(enum.Enum):
    FIRST = "first"  # the slot's first gradient this round: held, counts towards its bucket
    AGAIN_HELD = "again_held"  # again, still held: autograd summed it into param.grad
    AGAIN_WRITTEN = "again_written"  # again, after the first was written: the caller adds it


# (slot, parameter, its .grad): the gradient is kept beside the parameter so the write does not read .grad again (at
# stage 3 a parameter is a tensor subclass, and each .grad access goes through its __torch_function__: ~1 us)
Held = list[tuple[Slot, torch.Tensor, torch.Tensor]]


# What the hold hands back to be written: a bucket, the slots of its held gradients and those gradients, contiguous
# (each parameter's .grad already freed: the list keeps the gradient for the write)
Taken = tuple[BucketRuntime, list[Slot], list[torch.Tensor]]


class GradHold:
    """The bucket whose gradients are held and the slots of each bucket that got a gradient this round.

    It never writes: every call that lets held gradients go returns them (:data:`Taken`), and the strategy that
    called writes them, so the pairing is in the return values, not in a callback the hold keeps."""

    __slots__ = ("bucket", "held", "_held_slots", "_held_numel", "_seen")

    def __init__(self):
        self.bucket: Optional[BucketRuntime] = None
        self.held: Held = []
        self._held_slots: set[int] = set()
        self._held_numel = 0
        self._seen: dict[int, set[int]] = {}  # bucket order -> slot indices with a gradient this round

    def arrive(self, gb: BucketRuntime, slot: Slot, param: torch.Tensor, grad: torch.Tensor) -> tuple[Arrival, tuple]:
        """``param``'s gradient (``grad``, its ``.grad``) arrived. Returns how it counts and what the caller must
        write now, in order (a tuple of :data:`Taken`, usually empty): the held gradients of another bucket (one
        bucket's wait at a time), and this bucket's once the hold reached ``HOLD_ELEMENTS``."""
        seen = self._seen.get(gb.order)
        if seen is None:
            seen = self._seen[gb.order] = set()
        if slot.index in seen:
            if gb is self.bucket and slot.index in self._held_slots:
                # autograd added the second into .grad, in place or as a new tensor: keep what .grad is now
                at = next(i for i, (s, _, _) in enumerate(self.held) if s.index == slot.index)
                self.held[at] = (slot, param, grad)
                return Arrival.AGAIN_HELD, ()
            return Arrival.AGAIN_WRITTEN, ()
        seen.add(slot.index)
        writes = ()
        if gb is not self.bucket:
            other = self.take()
            writes = () if other is None else (other,)
            self.bucket = gb
        self.held.append((slot, param, grad))
        self._held_slots.add(slot.index)
        self._held_numel += slot.numel
        if self._held_numel >= HOLD_ELEMENTS:
            writes += (self.take(),)
        return Arrival.FIRST, writes

    def take(self, gb: Optional[BucketRuntime] = None) -> Optional[Taken]:
        """Let the held gradients go (only if they are ``gb``'s, when given), to be written by the caller; None
        when nothing (of ``gb``'s) is held."""
        if self.bucket is None or (gb is not None and gb is not self.bucket):
            return None
        bucket, held = self.bucket, self.held
        self.bucket, self.held, self._held_numel = None, [], 0
        self._held_slots.clear()
        if not held:
            return None
        slots, grads = [], []
        for slot, param, grad in held:
            slots.append(slot)
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
            param.grad = None
        return bucket, slots, grads

    def end_round(self) -> Optional[Taken]:
        """A backward pass ended: the slots seen are forgotten; returns what is still held (nothing: every bucket
        launched at the round's end; kept for safety), to be written."""
        self._seen.clear()
        return self.take()
