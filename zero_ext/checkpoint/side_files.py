"""The checkpoint's files beside the optimizer shards, all written by rank 0 and checksummed in ``COMPLETE``:

- ``model_extra.safetensors`` (with ``module=``): the model's tensors the optimizer does not hold, frozen
  parameters and persistent buffers, by name; ``meta.json``'s ``model`` record maps every ``state_dict`` key to
  its tensor's name (tied weights share one), so a consolidated ``model.safetensors`` has every key;
- ``config.json``: a transformers model's config, so the consolidated folder loads with ``from_pretrained``;
- ``extra.json`` + ``extra.safetensors``: the caller's own state (``save(..., extra=...)``: a scheduler's
  state_dict, a step counter, any JSON-like structure holding tensors). JSON and raw tensors only: no pickle.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Optional

import torch

from .format import CheckpointError, write_json

MODEL_EXTRA = "model_extra.safetensors"
CONFIG = "config.json"
EXTRA_JSON = "extra.json"
EXTRA_TENSORS = "extra.safetensors"


def _crc_of(path: str) -> int:
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _save_tensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path + ".partial")
    with open(path + ".partial", "rb+") as f:
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)
    return _crc_of(path)


def write_model_files(directory: str, state) -> tuple[Optional[dict], dict[str, int]]:
    """Rank 0: the model's unmanaged tensors and config; returns (meta.json's ``model`` record, {file: crc32})."""
    model = state.model
    if model is None:
        return None, {}
    managed = {id(p) for _, _, p in state.members()}
    unmanaged = model.unmanaged(managed)
    crcs = {MODEL_EXTRA: _save_tensors(os.path.join(directory, MODEL_EXTRA), unmanaged)}
    config = getattr(model.module, "config", None)
    if config is not None and callable(getattr(config, "to_json_string", None)):
        with open(os.path.join(directory, CONFIG), "w") as f:
            f.write(config.to_json_string())
        crcs[CONFIG] = _crc_of(os.path.join(directory, CONFIG))
    return {"aliases": model.aliases(), "unmanaged": sorted(unmanaged)}, crcs


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") and k.endswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"zero_ext.checkpoint.save: `extra` holds a {type(obj).__name__}; it may hold dicts, lists, tuples, strings, "
        "numbers, None and tensors (no pickle)"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {"__tensor__"}:
        if obj["__tensor__"] not in tensors:
            raise CheckpointError(f"{where}: refers to a tensor {obj['__tensor__']!r} that is not in {EXTRA_TENSORS}")
        return tensors[obj["__tensor__"]]
    if set(obj) == {"__tuple__"} and isinstance(obj["__tuple__"], list):
        return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
    if set(obj) == {"__items__"} and isinstance(obj["__items__"], list):
        items = {}
        for pair in obj["__items__"]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise CheckpointError(f"{where}: malformed `__items__` entry {pair!r}")
            key = _decode(pair[0], tensors, where)
            if isinstance(key, (list, dict, torch.Tensor)):
                raise CheckpointError(f"{where}: a dict key must be a string, number, tuple or None, got {key!r}")
            items[key] = _decode(pair[1], tensors, where)
        return items
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


def encode_extra(extra: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``extra`` as JSON plus its tensors; a TypeError (raised before anything is written) for anything else."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(extra, tensors), tensors


def write_extra(directory: str, encoded: Any, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    crcs = {EXTRA_JSON: write_json(os.path.join(directory, EXTRA_JSON), encoded)}
    crcs[EXTRA_TENSORS] = _save_tensors(os.path.join(directory, EXTRA_TENSORS), tensors)
    return crcs


def _verified_bytes(directory: str, name: str, crcs: dict[str, int]) -> bytes:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    if zlib.crc32(data) != crcs[name]:
        raise CheckpointError(f"{path}: checksum mismatch (file corrupted or replaced after the save)")
    return data


def _load_tensors(directory: str, name: str, crcs: dict[str, int]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    data = _verified_bytes(directory, name, crcs)
    try:
        return load(data)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for a malformed file)
        raise CheckpointError(f"{os.path.join(directory, name)}: not a valid safetensors file ({e})") from None


def read_model_extra(directory: str, crcs: dict[str, int]) -> Optional[dict[str, torch.Tensor]]:
    return _load_tensors(directory, MODEL_EXTRA, crcs) if MODEL_EXTRA in crcs else None


def read_extra(directory: str, crcs: dict[str, int]) -> Any:
    """The caller's ``extra`` state as saved (None when the checkpoint has none)."""
    if EXTRA_JSON not in crcs:
        return None
    data = _verified_bytes(directory, EXTRA_JSON, crcs)
    try:
        encoded = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{os.path.join(directory, EXTRA_JSON)}: not valid JSON ({type(e).__name__})") from None
    tensors = _load_tensors(directory, EXTRA_TENSORS, crcs) if EXTRA_TENSORS in crcs else {}
    return _decode(encoded, tensors, os.path.join(directory, EXTRA_JSON))
