"""A DCP checkpoint (zero_ext's or FSDP2's, torch's layout) to safetensors, one saved chunk at a time: no process
group, no full gather, peak memory one chunk (at most one rank's piece of one tensor).

``export_dcp(path, out)`` writes ``out/model.safetensors`` (the model's state dict: with zero_ext the fp32 master
weights, loads with ``model.load_state_dict``) and ``out/optimizer.safetensors`` (``<kind>/<fqn>`` per state kind of
every parameter, ``step/<fqn>``), the header fixed from DCP's metadata up front, then every chunk written at its place
(a box of the global tensor is a few contiguous runs of its row-major bytes). ``python -m zero_ext.checkpoint
consolidate PATH OUT`` calls it for a directory with DCP's ``.metadata``.
"""

from __future__ import annotations

import io
import itertools
import math
import os
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from .consolidate import _SAFETENSORS_DTYPES
from .format import CheckpointError, as_bytes

METADATA = ".metadata"


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


def _prefix(keys) -> str:
    """Where the model's keys start: ``model.`` or, under an app state, ``<key>.model.``."""
    for key in keys:
        if key.startswith("model."):
            return ""
    for key in keys:
        head, sep, _ = key.partition(".model.")
        if sep and "." not in head:
            return head + "."
    raise CheckpointError("no model state in this DCP checkpoint (keys 'model.*' or '<app>.model.*')")


def _box_runs(offsets, sizes, shape) -> Iterator[tuple[int, int, int]]:
    """(element in the tensor, element in the chunk, length) of every contiguous run of a box, in order."""
    nd = len(shape)
    if nd == 0:
        yield 0, 0, 1
        return
    k = nd - 1
    while k > 0 and sizes[k] == shape[k]:  # dims after k are whole: a run spans them
        k -= 1
    inner = math.prod(shape[k + 1 :])
    run = sizes[k] * inner
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    for i, idx in enumerate(itertools.product(*[range(s) for s in sizes[:k]])):
        at = sum((offsets[d] + idx[d]) * strides[d] for d in range(k)) + offsets[k] * strides[k]
        yield at, i * run, run


class _Writer:
    """A safetensors file whose header is fixed up front; tensors' elements are written anywhere, any order."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict):
        import json

        header, pos, self.where = {"__metadata__": metadata}, 0, {}
        for name, dtype, shape in entries:
            n = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.where[name] = (pos, dtype)
            pos += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.base = path, 8 + len(blob)
        self.fd = os.open(path + ".partial", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, len(blob).to_bytes(8, "little") + blob, 0)
        os.ftruncate(self.fd, self.base + pos)

    def write(self, name: str, element: int, values: torch.Tensor) -> None:
        pos, dtype = self.where[name]
        raw = as_bytes(values.to(dtype).contiguous())
        os.pwrite(self.fd, raw, self.base + pos + element * values.element_size())

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.path + ".partial", self.path)


def _read_chunk(path: str, info) -> torch.Tensor:
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{path}: chunk stored with transforms {info.transform_descriptors} (not supported)")
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"{path}/{info.relative_path}: truncated (a save that did not finish?)")
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _export(path: str, metadata, keys: dict[str, str], out_file: str, info: dict) -> None:
    """``keys``: checkpoint key -> name in the file. One chunk in memory at a time."""
    md = metadata.state_dict_metadata
    entries = [(name, md[key].properties.dtype, tuple(md[key].size)) for key, name in keys.items()]
    writer = _Writer(out_file, entries, info)
    for key, name in keys.items():
        shape = tuple(md[key].size)
        for chunk in md[key].chunks:
            values = _read_chunk(path, metadata.storage_data[MetadataIndex(key, chunk.offsets)]).reshape(-1)
            for at, start, n in _box_runs(tuple(chunk.offsets), tuple(chunk.sizes), shape):
                writer.write(name, at, values[start : start + n])
            del values
    writer.close()  # (on an error the ".partial" file stays, never the output's name)


def export_dcp(path: str | os.PathLike, out: str | os.PathLike) -> tuple[str, str]:
    """Write ``out/model.safetensors`` and ``out/optimizer.safetensors`` from the DCP checkpoint at ``path``;
    returns their paths."""
    path, out = os.fspath(path), os.fspath(out)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: no DCP .metadata (not a DCP checkpoint, or a save that did not finish)"
        ) from None
    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    prefix = _prefix(tensors)
    model = {k: k[len(prefix) + 6 :] for k in sorted(tensors) if k.startswith(prefix + "model.")}
    optim = {}
    for k in sorted(tensors):
        if k.startswith(prefix + "optim.state."):
            fqn, _, kind = k[len(prefix) + 12 :].rpartition(".")
            optim[k] = f"{kind}/{fqn}"
    os.makedirs(out, exist_ok=True)
    model_file, optim_file = os.path.join(out, "model.safetensors"), os.path.join(out, "optimizer.safetensors")
    _export(path, metadata, model, model_file, {"format": "pt"})
    _export(path, metadata, optim, optim_file, {"format": "zero_ext.dcp.consolidated"})
    return model_file, optim_file
