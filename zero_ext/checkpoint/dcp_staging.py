""":class:`CachedStager`: ``dcp.async_save``'s staging into host buffers reused from one save to the next.

``dcp.async_save`` returns once the state dict is *staged* (copied where training cannot change it); the files are
written afterwards in a thread. DCP's default stager allocates the copy anew each time: for a rank's fp32 state
(12 bytes a parameter under AdamW) most of the blocking time is then the kernel zero-filling fresh pages (measured
in ``bench/results/checkpoint_dcp.md``: a warm copy is several times faster than a copy into fresh memory).
``CachedStager`` copies into buffers it keeps, one per value of the state dict (by its key path), pinned when the
values are on a GPU, reused by every later save whose values have the same sizes: after the first save, the blocking
time is one memcpy of the rank's state and a few microseconds of Python per entry.

A buffer is reused only once the save that wrote it is done with it: every staged value holds the save's
:class:`_Lease`, and a buffer whose lease is still alive (an upload still writing it, or a staged dict still held)
is not reused; a new one is made instead (at most ``max_sets`` buffers per key are kept). So a second ``async_save``
issued before the first one finished is correct, only not faster.

Values: :class:`~zero_ext.checkpoint.dcp_chunks.FlatPieces` (views of the optimizer's state, copied run by run) and
plain tensors (frozen parameters, buffers, ``step``) are copied; everything else (param groups' numbers and strings) is
shared, as DCP's own stager shares atomic values. Use one stager for a run and ``close()`` it at the end::

    stager = zero_ext.checkpoint.CachedStager()
    future = dcp.async_save({"app": AppState(model, opt)}, checkpoint_id=path, async_stager=stager)
    ...                       # training goes on while the files are written
    future.result()
    stager.close()
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from .dcp_chunks import FlatPieces


class _Lease:
    """Held by every value one staging made: while any of them lives, its buffers are in use."""


class CachedStager(AsyncStager):
    """An ``AsyncStager`` (module docstring). ``max_sets``: buffers kept per value (2: one save writing while the next
    one stages)."""

    _synchronize_after_execute = False  # staging is complete when stage() returns

    def __init__(self, max_sets: int = 2):
        self.max_sets = max_sets
        # key path -> [(buffers, weakref to the lease that used them last)]
        self._cache: dict[tuple, list[tuple[list[torch.Tensor], Any]]] = {}

    def _buffers(self, key: tuple, like: list[torch.Tensor], lease: _Lease) -> list[torch.Tensor]:
        sizes = [(t.numel(), t.dtype) for t in like]
        kept = self._cache.setdefault(key, [])
        for i, (buffers, last) in enumerate(kept):
            if last() is None and [(b.numel(), b.dtype) for b in buffers] == sizes:
                kept[i] = (buffers, weakref.ref(lease))
                return buffers
        pin = any(t.device.type == "cuda" for t in like) and torch.cuda.is_available()
        buffers = [torch.empty(n, dtype=dtype, pin_memory=pin) for n, dtype in sizes]
        if len(kept) >= self.max_sets:  # every kept set busy: this one is not kept (correct, only not reused)
            return buffers
        kept.append((buffers, weakref.ref(lease)))
        return buffers

    def _stage(self, value: Any, key: tuple, lease: _Lease) -> Any:
        if isinstance(value, FlatPieces):
            parts = [v.reshape(-1) for _, v in value.pieces()]
            staged = value.staged(self._buffers(key, parts, lease))
            staged._lease = lease
            return staged
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise TypeError(f"zero_ext.checkpoint.CachedStager: {'.'.join(map(str, key))!r} is a "
                                f"{type(value).__name__}; it stages zero_ext's get_state_dict values and plain "
                                "tensors (use DCP's DefaultStager for other tensor subclasses)")  # fmt: skip
            (buffer,) = self._buffers(key, [value.detach().reshape(-1)], lease)
            with torch.no_grad():
                buffer.copy_(value.detach().reshape(-1))
            staged = buffer.view(value.shape)
            staged._lease = lease
            return staged
        if isinstance(value, dict):
            return {k: self._stage(v, key + (k,), lease) for k, v in value.items()}
        if type(value) in (list, tuple):
            items = [self._stage(v, key + (i,), lease) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict copied into this stager's host buffers (module docstring)."""
        return self._stage(state_dict, (), _Lease())

    def close(self) -> None:
        """Drop the buffers (those of saves still writing live on with them)."""
        self._cache.clear()
