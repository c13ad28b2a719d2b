"""One write per bucket instead of one per gradient: the gradients of a bucket being filled wait in ``param.grad``.

A kernel launch costs the host a few microseconds in C++ and tens through a Python Triton launcher, whatever the
tensor's size; a model has hundreds of small parameters, so writing each gradient into its bucket the moment it
arrives made backward launch-bound (bench/results/backward_hooks_cpu.md). Instead a strategy holds each bucket's
gradients where autograd left them, and writes them all with one multi-tensor call (``ops.flatten_``: one CUDA
launch however many tensors) when the bucket launches. Then it frees them (``param.grad = None``), as it did one by
one before.

Held per bucket, not one bucket at a time: when gradients arrive for several buckets at once (ZeroMuon's owner
layout puts equal matrices of neighbouring layers in one bucket, and its AdamW group's bucket fills from the head's
gradient to the embedding's), writing a bucket's gradients before it launches needs a staging entry for it from then
until its launch, and the pool grew to an entry per bucket (the main job's ZeroMuon stage 2: 7 entries, 17.5 MiB per
rank, more than its stage 1's whole gradient; bench/results/muon_stage2_staging_before.md). Held, they cost their
parameters' dtype (bf16: half the fp32 staging), during backward only.

Memory: at most ``HOLD_ELEMENTS`` elements are held, every bucket together: beyond that the oldest bucket's are
written out (into a staging entry, held until it launches), so what waits is at most that plus the last gradient (a
parameter larger than that is written at once; autograd produced its gradient whole anyway). When buckets fill one
after another (ZeroAdamW's layout, in about backward's order) that is one bucket's gradients, as before; nothing is
held between steps.

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
    """The gradients held, bucket by bucket, and the slots of each bucket that got a gradient this round.

    It never writes: every call that lets held gradients go returns them (:data:`Taken`), and the strategy that
    called writes them, so the pairing is in the return values, not in a callback the hold keeps."""

    __slots__ = ("_holds", "_numel", "_seen")

    def __init__(self):
        # bucket order -> (the bucket, its held gradients, their slot indices), oldest first
        self._holds: dict[int, tuple[BucketRuntime, Held, set[int]]] = {}
        self._numel = 0  # elements held, every bucket together
        self._seen: dict[int, set[int]] = {}  # bucket order -> slot indices with a gradient this round

    def arrive(self, gb: BucketRuntime, slot: Slot, param: torch.Tensor, grad: torch.Tensor) -> tuple[Arrival, tuple]:
        """``param``'s gradient (``grad``, its ``.grad``) arrived. Returns how it counts and what the caller must
        write now, in order (a tuple of :data:`Taken`, usually empty): the oldest buckets' held gradients once all
        held reached ``HOLD_ELEMENTS``."""
        seen = self._seen.get(gb.order)
        if seen is None:
            seen = self._seen[gb.order] = set()
        hold = self._holds.get(gb.order)
        if slot.index in seen:
            if hold is not None and slot.index in hold[2]:
                # autograd added the second into .grad, in place or as a new tensor: keep what .grad is now
                held = hold[1]
                at = next(i for i, (s, _, _) in enumerate(held) if s.index == slot.index)
                held[at] = (slot, param, grad)
                return Arrival.AGAIN_HELD, ()
            return Arrival.AGAIN_WRITTEN, ()
        seen.add(slot.index)
        if hold is None:
            hold = self._holds[gb.order] = (gb, [], set())
        hold[1].append((slot, param, grad))
        hold[2].add(slot.index)
        self._numel += slot.numel
        writes = ()
        while self._numel >= HOLD_ELEMENTS:
            writes += (self.take(self._holds[next(iter(self._holds))][0]),)
        return Arrival.FIRST, writes

    def take(self, gb: Optional[BucketRuntime] = None) -> Optional[Taken]:
        """Let ``gb``'s held gradients go (the oldest bucket's when None), to be written by the caller; None when
        nothing (of ``gb``'s) is held."""
        if not self._holds:
            return None
        order = next(iter(self._holds)) if gb is None else gb.order
        hold = self._holds.pop(order, None)
        if hold is None:
            return None
        bucket, held, _ = hold
        slots, grads = [], []
        for slot, param, grad in held:
            slots.append(slot)
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
            param.grad = None
            self._numel -= slot.numel
        return (bucket, slots, grads) if held else None

    def take_all(self) -> tuple[Taken, ...]:
        """Every held gradient, oldest bucket first."""
        taken = []
        while self._holds:
            t = self.take()
            if t is not None:
                taken.append(t)
        return tuple(taken)

    def end_round(self) -> tuple[Taken, ...]:
        """A backward pass ended: the slots seen are forgotten; returns what is still held (nothing: every bucket
        launched at the round's end; kept for safety), to be written."""
        self._seen.clear()
        return self.take_all()
