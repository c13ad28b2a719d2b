"""Every field of a checkpoint's JSON checked before it is used: types, ranges, and that the pieces of every
parameter tile it exactly and lie inside the sections of the shard files. A crafted or damaged record (even one
whose checksums were recomputed) gives a CheckpointError naming the file and the field, never a crash, a hang, an
allocation of a size the checkpoint cannot back, or a read outside the checkpoint directory."""

from __future__ import annotations

import math
from typing import Any

from ..update.registry import all_kind_names
from .format import FORMAT_NAME, READABLE_VERSIONS, CheckpointError, dtype_of

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _int(value: Any, where: str, field: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f" and <= {hi}" if hi is not None else ""
        raise CheckpointError(f"{where}: `{field}` must be an integer >= {lo}{bound}, got {value!r}")
    return value


_FP32_MAX = 3.4028234663852886e38  # counts live in fp32 device scalars: a larger value cannot be loaded


def _count(value: Any, where: str, field: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or value > _FP32_MAX):  # fmt: skip
        raise CheckpointError(f"{where}: `{field}` must be a finite number >= 0 that fits in float32, got {value!r}")
    return float(value)


def _dict(value: Any, where: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: `{field}` must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str, field: str) -> list:
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: `{field}` must be a list, got {type(value).__name__}")
    return value


def check_header(record: Any, where: str) -> dict:
    record = _dict(record, where, "(file)")
    if record.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where}: not a {FORMAT_NAME} file (format={record.get('format')!r})")
    if record.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format version {record.get('version')!r}, but this zero_ext reads versions "
            f"{list(READABLE_VERSIONS)} (written by a newer zero_ext? upgrade zero_ext to load it)"
        )
    return record


def check_marker(marker: Any, where: str) -> dict[str, int]:
    check_header(marker, where)
    crcs = _dict(marker.get("crc32"), where, "crc32")
    for name, crc in crcs.items():
        _int(crc, where, f"crc32.{name}", 0, 2**32 - 1)
    return crcs


def check_meta(meta: Any, where: str) -> None:
    check_header(meta, where)
    _int(meta.get("world_size"), where, "world_size", 1, 1 << 20)
    _count(meta.get("step"), where, "step")
    _count(meta.get("skipped_steps"), where, "skipped_steps")
    groups = _list(meta.get("param_groups"), where, "param_groups")
    for i, g in enumerate(groups):
        g = _dict(g, where, f"param_groups[{i}]")
        _dict(g.get("hyperparameters"), where, f"param_groups[{i}].hyperparameters")
        _int(g.get("num_params"), where, f"param_groups[{i}].num_params")
        if not isinstance(g.get("rule", "adamw"), str):  # the update rule's registered name (older: none, AdamW)
            raise CheckpointError(f"{where}: `param_groups[{i}].rule` must be a string, got {g.get('rule')!r}")
    indices, names = set(), set()
    for i, e in enumerate(_list(meta.get("params"), where, "params")):
        field = f"params[{i}]"
        e = _dict(e, where, field)
        index = _int(e.get("index"), where, f"{field}.index")
        name = e.get("name")
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{where}: `{field}.name` must be a non-empty string, got {name!r}")
        if index in indices or name in names:
            raise CheckpointError(f"{where}: `{field}` repeats parameter index {index} or name {name!r}")
        indices.add(index)
        names.add(name)
        for d, dim in enumerate(_list(e.get("shape"), where, f"{field}.shape")):
            _int(dim, where, f"{field}.shape[{d}]")
        dtype_of(e.get("dtype") if isinstance(e.get("dtype"), str) else repr(e.get("dtype")), f"{where}: {field}")
        _int(e.get("group"), where, f"{field}.group", 0, max(0, len(groups) - 1))
        if "step" in e:
            _count(e["step"], where, f"{field}.step")


def numel(entry: dict) -> int:
    return math.prod(entry["shape"])


def check_rank(rec: Any, rank: int, meta: dict, where: str) -> None:
    """One rank's record: its own fields, and its pieces against the parameters of ``meta`` and its sections."""
    check_header(rec, where)
    if _int(rec.get("rank"), where, "rank") != rank:
        raise CheckpointError(f"{where}: `rank` is {rec.get('rank')!r} in the file of rank {rank}")
    nbytes = _int(rec.get("nbytes"), where, "nbytes")
    block = _int(rec.get("block_size"), where, "block_size", 1)
    crcs = _list(rec.get("crc32"), where, "crc32")
    if len(crcs) != -(-nbytes // block):
        raise CheckpointError(f"{where}: {len(crcs)} block checksums for {nbytes} bytes in blocks of {block}")
    for i, crc in enumerate(crcs):
        _int(crc, where, f"crc32[{i}]", 0, 2**32 - 1)
    if not isinstance(rec.get("file"), str):
        raise CheckpointError(f"{where}: `file` must be a file name, got {rec.get('file')!r}")
    params = {e["index"]: e for e in meta["params"]}
    sections = (*all_kind_names(), "param")  # what a registered update rule may keep, and the parameters
    for gpos, group in enumerate(_list(rec.get("groups"), where, "groups")):
        field = f"groups[{gpos}]"
        group = _dict(group, where, field)
        shard = _int(group.get("shard_numel"), where, f"{field}.shard_numel")
        for kind, section in _dict(group.get("sections"), where, f"{field}.sections").items():
            if kind not in sections:
                raise CheckpointError(f"{where}: `{field}.sections` has an unknown kind {kind!r}")
            section = _dict(section, where, f"{field}.sections.{kind}")
            dtype = section.get("dtype")
            itemsize = _ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
            if itemsize is None:
                raise CheckpointError(f"{where}: `{field}.sections.{kind}.dtype` is {section.get('dtype')!r}")
            offset = _int(section.get("offset"), where, f"{field}.sections.{kind}.offset")
            if offset + shard * itemsize > nbytes:
                raise CheckpointError(f"{where}: section {kind!r} of {field} ends past the file's {nbytes} bytes")
        for i, piece in enumerate(_list(group.get("pieces"), where, f"{field}.pieces")):
            pfield = f"{field}.pieces[{i}]"
            if not isinstance(piece, list) or len(piece) != 4:
                raise CheckpointError(f"{where}: `{pfield}` must be [param index, start, end, shard offset]")
            gidx = _int(piece[0], where, f"{pfield}[0]")
            if gidx not in params:
                raise CheckpointError(f"{where}: `{pfield}` is a piece of unknown parameter index {gidx}")
            start = _int(piece[1], where, f"{pfield}[1]")
            end = _int(piece[2], where, f"{pfield}[2]", start + 1, numel(params[gidx]))
            _int(piece[3], where, f"{pfield}[3]", 0, shard - (end - start))


def check_coverage(pieces: dict[int, list[tuple]], meta: dict, where: str) -> None:
    """Every parameter's pieces (sorted by start) tile [0, numel) exactly: no gap, no overlap."""
    for e in meta["params"]:
        pos = 0
        for start, end, *_ in pieces[e["index"]]:
            if start != pos:
                what = "overlap" if start < pos else "a gap"
                raise CheckpointError(f"{where}: the pieces of parameter {e['name']!r} have {what} at element {pos}")
            pos = end
        if pos != numel(e):
            raise CheckpointError(f"{where}: elements {pos}..{numel(e)} of parameter {e['name']!r} are in no shard")


def check_model_record(meta: dict, crcs: dict[str, int], where: str) -> None:
    """``meta.json``'s optional ``model`` record (saved with ``module=``): every key names a parameter of the
    checkpoint or a tensor of ``model_extra.safetensors``."""
    record = meta.get("model")
    if record is None:
        return
    record = _dict(record, where, "model")
    unmanaged = _list(record.get("unmanaged"), where, "model.unmanaged")
    if not all(isinstance(n, str) for n in unmanaged):
        raise CheckpointError(f"{where}: `model.unmanaged` must list names")
    if "model_extra.safetensors" not in crcs:
        raise CheckpointError(f"{where}: a `model` record but no checksum for model_extra.safetensors")
    known = {e["name"] for e in meta["params"]} | set(unmanaged)
    for key, name in _dict(record.get("aliases"), where, "model.aliases").items():
        if not isinstance(name, str) or name not in known:
            raise CheckpointError(f"{where}: `model.aliases.{key}` names no tensor of the checkpoint ({name!r})")
