"""A rank's element ranges of a flattened parameter as chunks torch.distributed.checkpoint (DCP) understands.

A flat shard holds an element range ``[start, end)`` of a row-major parameter; DCP describes a rank's part of a
global tensor as boxes (offsets and sizes per dimension). :func:`flat_boxes` cuts a range into the fewest boxes that
are each contiguous in row-major order (at most ``2 * ndim - 1``: a partial first row, whole rows, a partial last
row, recursively inside the partial rows), so every box is a plain view of the rank's 1-D values.

:class:`FlatPieces` is the state-dict value: a tensor subclass of the global shape holding no global data, only
this rank's runs, answering DCP's checkpoint hooks (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the hooks DTensor implements), so that ``dcp.save`` writes this rank's boxes without
gathering anything and ``dcp.load`` reads into them from a checkpoint of any sharding (an FSDP2 one included).
DCP's async stager copies a tensor subclass by ``new_empty`` and its ``__dict__``: the values travel in a
:class:`HostSnapshot`, which a host copy does not copy again (the values are a snapshot already: nothing but the
state dict refers to them).
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


class HostSnapshot:
    """A rank's values of one state-dict entry, a snapshot nothing else refers to. A deep copy (DCP's async stager
    copying the state dict to host memory) keeps host values as they are: they are staged already."""

    def __init__(self, values: torch.Tensor):
        self.flat_values = values

    def __deepcopy__(self, memo):
        if self.flat_values.device.type == "cpu":
            return self
        return HostSnapshot(self.flat_values.to("cpu", copy=True))


_NOT_A_TENSOR = (
    "zero_ext.checkpoint: a value of get_state_dict() is this rank's pieces of the global tensor {name!r} {shape}, for "
    "torch.distributed.checkpoint (dcp.save / dcp.async_save / dcp.load) and zero_ext.checkpoint.set_state_dict; "
    "it supports no tensor operation ({op}). Read the pieces with .pieces() or the whole tensor with dcp/consolidation"
)


class FlatPieces(torch.Tensor):
    """This rank's runs ``[(start, end), ...]`` of a flattened tensor of ``shape``: ``values`` holds them one after the
    other (1-D). ``name`` only makes messages clear."""

    @staticmethod
    def __new__(cls, shape, dtype, runs: Sequence[tuple[int, int]], values: Optional[torch.Tensor], name: str = ""):
        device = values.device if values is not None else torch.device("cpu")
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        self._runs = [Range(int(a), int(b)) for a, b in runs]
        self._snapshot = HostSnapshot(values) if values is not None else None
        self._name = name
        return self

    def __init__(self, *args, **kwargs):
        pass

    @property
    def runs(self) -> list[Range]:
        return list(self._runs)

    @property
    def flat_values(self) -> torch.Tensor:
        """This rank's elements, the runs one after the other (1-D)."""
        return self._snapshot.flat_values

    def pieces(self) -> list[tuple[Range, torch.Tensor]]:
        """[(run, its values)] in order."""
        out, at = [], 0
        for run in self._runs:
            out.append((run, self.flat_values[at : at + run.numel]))
            at += run.numel
        return out

    def _boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        out, at = [], 0
        for run in self._runs:
            for offsets, sizes, first in flat_boxes(run.start, run.end, self.shape):
                n = math.prod(sizes)
                local = at + first - run.start
                out.append((offsets, sizes, self.flat_values[local : local + n].view(sizes)))
            at += run.numel
        return out

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
