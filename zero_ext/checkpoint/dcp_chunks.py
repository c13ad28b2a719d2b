"""A rank's element ranges of a flattened parameter as chunks torch.distributed.checkpoint (DCP) understands.

A flat shard holds an element range ``[start, end)`` of a row-major parameter; DCP describes a rank's part of a
global tensor as boxes (offsets and sizes per dimension). :func:`flat_boxes` cuts a range into the fewest boxes that
are each contiguous in row-major order (at most ``2 * ndim - 1``: a partial first row, whole rows, a partial last
row, recursively inside the partial rows), so every box is a plain view of the rank's 1-D values.

:class:`FlatPieces` is the state-dict value: a tensor subclass of the global shape holding no global data, only
this rank's runs, answering DCP's checkpoint hooks (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the hooks DTensor implements), so that ``dcp.save`` writes this rank's boxes without
gathering anything and ``dcp.load`` reads into them from a checkpoint of any sharding (an FSDP2 one included).

Its values (:class:`RunValues`, one 1-D tensor per run) are *live* where the optimizer keeps them as fp32 memory: views
of the state itself (``get_state_dict`` copies nothing, so ``dcp.save`` costs no memory), like the DTensors torch's
own ``get_state_dict`` returns. They are copied exactly once, where a copy is needed:

- staging (``dcp.async_save``): DCP's stager deep-copies the state dict; a live :class:`RunValues` copies itself to
  host memory then (values already copied, decoded from bf16 / int8 or read from disk, are a snapshot nothing else
  refers to and are not copied again). :class:`~zero_ext.checkpoint.dcp_staging.CachedStager` copies into buffers
  reused from one save to the next instead (no page faults: the async blocking time is one memcpy);
- loading: DCP asks for the chunk list (``__create_chunk_list__``) only to plan a load; the values are detached from
  the state there (copied), so ``dcp.load`` writes into the copy and the optimizer changes only in ``set_state_dict``,
  after its checks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..layout import Range

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first flat element)


def flat_boxes(start: int, end: int, shape: Sequence[int]) -> list[Box]:
    """Elements ``[start, end)`` of a row-major tensor of ``shape`` as boxes, in element order, each contiguous."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:  # a 0-d tensor: its one element
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner = math.prod(shape[1:])
    (r0, o0), (r1, o1) = divmod(start, inner), divmod(end, inner)
    out: list[Box] = []

    def within(row: int, a: int, b: int) -> None:
        for offs, sizes, first in flat_boxes(a, b, shape[1:]):
            out.append(((row, *offs), (1, *sizes), row * inner + first))

    if r0 == r1:
        within(r0, o0, o1)
        return out
    if o0:
        within(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if o1:
        within(r1, 0, o1)
    return out


class RunValues:
    """A rank's values of one state-dict entry: one 1-D tensor per run. ``live``: some are views of the optimizer's
    state (they change as it trains); else they are a snapshot nothing else refers to."""

    def __init__(self, parts: Sequence[torch.Tensor], live: bool):
        self.parts, self.live = list(parts), live

    def copied(self, into: Optional[Sequence[torch.Tensor]] = None) -> "RunValues":
        """A snapshot of the values in host memory (into ``into``, buffers of the parts' sizes, where given)."""
        with torch.no_grad():
            if into is None:
                return RunValues([p.to("cpu", copy=True) for p in self.parts], live=False)
            for dst, src in zip(into, self.parts):
                dst.copy_(src)
            return RunValues(into, live=False)

    def __deepcopy__(self, memo):
        # DCP's stager deep-copies the state dict (dcp.async_save): live values are copied to host memory once;
        # a host snapshot is staged already
        if self.live or any(p.device.type != "cpu" for p in self.parts):
            return self.copied()
        return self


_NOT_A_TENSOR = (
    "zero_ext.checkpoint: a value of get_state_dict() is this rank's pieces of the global tensor {name!r} {shape}, for "
    "torch.distributed.checkpoint (dcp.save / dcp.async_save / dcp.load) and zero_ext.checkpoint.set_state_dict; "
    "it supports no tensor operation ({op}). Read the pieces with .pieces() or the whole tensor with dcp/consolidation"
)


class FlatPieces(torch.Tensor):
    """This rank's runs ``[(start, end), ...]`` of a flattened tensor of ``shape``. ``values``: one 1-D tensor holding
    the runs one after the other, or a :class:`RunValues` (a tensor per run). ``name`` only makes messages clear."""

    @staticmethod
    def __new__(cls, shape, dtype, runs: Sequence[tuple[int, int]], values, name: str = ""):
        runs = [Range(int(a), int(b)) for a, b in runs]
        if isinstance(values, torch.Tensor):
            values = RunValues(_split(values, runs), live=False)
        device = values.parts[0].device if values is not None and values.parts else torch.device("cpu")
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        self._runs = runs
        self._values = values
        self._name = name
        return self

    def __init__(self, *args, **kwargs):
        pass

    @property
    def runs(self) -> list[Range]:
        return list(self._runs)

    @property
    def live(self) -> bool:
        """Whether some values are views of the optimizer's state (they change as it trains)."""
        return self._values.live

    @property
    def flat_values(self) -> torch.Tensor:
        """This rank's elements, the runs one after the other (1-D; a copy where there are several runs)."""
        parts = self._values.parts
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return torch.zeros(0, dtype=self.dtype)
        return torch.cat(parts)

    def pieces(self) -> list[tuple[Range, torch.Tensor]]:
        """[(run, its values)] in order."""
        return list(zip(self._runs, self._values.parts))

    def _boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        out = []
        for run, values in zip(self._runs, self._values.parts):
            for offsets, sizes, first in flat_boxes(run.start, run.end, self.shape):
                local = first - run.start
                out.append((offsets, sizes, values[local : local + math.prod(sizes)].view(sizes)))
        return out

    def staged(self, into: Optional[Sequence[torch.Tensor]] = None) -> "FlatPieces":
        """A copy in host memory (into ``into``, one buffer per run, where given), for a save running while training
        goes on."""
        return FlatPieces(self.shape, self.dtype, self._runs, self._values.copied(into), self._name)

    # -- DCP's hooks (torch.distributed.checkpoint.planner_helpers / utils) --------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for offsets, sizes, _ in self._boxes()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        # Asked only to plan a load (planner_helpers._create_read_items): the load writes into a copy, not the state
        if self._values.live:
            self._values = RunValues([p.clone() for p in self._values.parts], live=False)
        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for offsets, sizes, _ in self._boxes()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, view in self._boxes():
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"zero_ext.checkpoint: no piece of {index.fqn!r} at offset {index.offset} on this rank")

    # -- what a tensor subclass must answer: DCP's stager makes an empty one and copies __dict__ into it ---------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in (torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default):
            return FlatPieces(first.shape, kwargs.get("dtype") or first.dtype, first._runs, None, first._name)
        if func is torch.ops.aten.detach.default:
            return first
        if func is torch.ops.aten.is_pinned.default:
            return False
        name = getattr(first, "_name", "")
        raise TypeError(_NOT_A_TENSOR.format(name=name, shape=tuple(getattr(first, "shape", ())), op=func))

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FlatPieces({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, runs={self._runs})"

    def __reduce_ex__(self, protocol):
        return (
            FlatPieces,
            (tuple(self.shape), self.dtype, [tuple(r) for r in self._runs], self.flat_values, self._name),
        )


def _split(values: torch.Tensor, runs: Sequence[Range]) -> list[torch.Tensor]:
    """1-D ``values`` holding ``runs`` one after the other, as one view per run."""
    out, at = [], 0
    for run in runs:
        out.append(values[at : at + run.numel])
        at += run.numel
    return out
