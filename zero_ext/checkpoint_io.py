"""Reading a ``zero_ext.checkpoint`` without a process group: :class:`Checkpoint` (verified metadata, and a
plan of byte ranges for any element range of any parameter) and :func:`consolidate` to safetensors."""

from __future__ import annotations

import bisect
import glob
import json
import os
from typing import Any

import numpy as np
import torch

from .checkpoint_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER,
    META,
    CheckpointError,
    SafetensorsWriter,
    ShardReader,
    as_bytes,
    decode_value,
    dtype_of,
    rank_stem,
    read_json,
)


class Checkpoint:
    """A complete checkpoint on disk, its metadata verified: parameters by name and where their elements live."""

    def __init__(self, path: str | os.PathLike):
        self.path = path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            hints = glob.glob(glob.escape(path) + ".old-*") + glob.glob(glob.escape(path) + ".tmp-*")
            hint = f" (found {hints}: an interrupted save; one with a {MARKER} file is complete)" if hints else ""
            raise CheckpointError(f"missing checkpoint directory {path}{hint}")
        marker_path = os.path.join(path, MARKER)
        if not os.path.exists(marker_path):
            raise CheckpointError(f"{path}: no completion marker {MARKER}: the save did not finish; not loadable")
        marker = read_json(marker_path)
        self._check_version(marker, marker_path)
        crcs = marker.get("crc32", {})
        self.meta = read_json(os.path.join(path, META), crcs.get(META))
        self._check_version(self.meta, os.path.join(path, META))
        self.world_size = self.meta["world_size"]
        self.params = {e["index"]: e for e in self.meta["params"]}
        self.by_name = {e["name"]: e for e in self.meta["params"]}
        self.ranks = []
        for r in range(self.world_size):
            name = rank_stem(r) + ".json"
            if name not in crcs:
                raise CheckpointError(f"{marker_path}: no checksum for {name}")
            self.ranks.append(read_json(os.path.join(path, name), crcs[name]))
        # global index -> sorted [(start, end, rank, group position, shard offset)]
        self.pieces: dict[int, list[tuple[int, int, int, int, int]]] = {i: [] for i in self.params}
        for r, rec in enumerate(self.ranks):
            for gpos, group in enumerate(rec["groups"]):
                for gidx, start, end, shard_offset in group["pieces"]:
                    if gidx not in self.pieces:
                        raise CheckpointError(f"{path}/{rank_stem(r)}.json: piece of unknown parameter index {gidx}")
                    self.pieces[gidx].append((start, end, r, gpos, shard_offset))
        for plist in self.pieces.values():
            plist.sort()
        self._readers: dict[int, ShardReader] = {}

    @staticmethod
    def _check_version(record: dict, where: str) -> None:
        if record.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not a {FORMAT_NAME} file (format={record.get('format')!r})")
        if record.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: format version {record.get('version')!r}, but this zero_ext reads version {FORMAT_VERSION} "
                "only (written by a newer zero_ext? upgrade zero_ext to load it)"
            )

    def reader(self, rank: int) -> ShardReader:
        if rank not in self._readers:
            rec = self.ranks[rank]
            path = os.path.join(self.path, rec["file"])
            self._readers[rank] = ShardReader(path, rec["nbytes"], rec["block_size"], rec["crc32"])
        return self._readers[rank]

    def plan(self, gidx: int, kind: str, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Reads that produce elements [start, end) of parameter ``gidx``'s ``kind``:
        [(rank, file byte offset, nbytes, byte offset in the output)]."""
        pieces, out, pos = self.pieces[gidx], [], start
        i = max(bisect.bisect_right(pieces, (start, float("inf"))) - 1, 0)
        while pos < end and i < len(pieces):
            pstart, pend, rank, gpos, shard_offset = pieces[i]
            i += 1
            if pend <= pos:
                continue
            if pstart > pos:
                break
            take = min(pend, end) - pos
            section = self.ranks[rank]["groups"][gpos]["sections"].get(kind)
            if section is None:
                raise CheckpointError(f"{self.path}: parameter {self.params[gidx]['name']!r} has no {kind!r} section")
            size = torch.tensor([], dtype=dtype_of(section["dtype"], self.path)).element_size()
            out.append(
                (rank, section["offset"] + (shard_offset + pos - pstart) * size, take * size, (pos - start) * size)
            )
            pos += take
        if pos < end:
            name = self.params[gidx]["name"]
            raise CheckpointError(f"{self.path}: elements {pos}..{end} of parameter {name!r} are in no rank's shard")
        return out

    def verify(self, reads: list[tuple[int, int, int]]) -> None:
        """Check the checksums of every block that [(rank, file offset, nbytes)] touch, before any of them is used."""
        by_rank: dict[int, list[tuple[int, int]]] = {}
        for rank, offset, nbytes in reads:
            by_rank.setdefault(rank, []).append((offset, nbytes))
        for rank, ranges in sorted(by_rank.items()):
            self.reader(rank).verify_blocks(ranges)

    def execute(self, reads: list[tuple[int, int, int, np.ndarray]]) -> None:
        """Run [(rank, file offset, nbytes, uint8 destination)] in file order (each block verified once)."""
        previous = None
        for rank, offset, nbytes, dst in sorted(reads, key=lambda r: r[:2]):
            if previous is not None and previous != rank:
                self.reader(previous).drop_cache()  # at most one file's few cached blocks at a time
            self.reader(rank).read_into(offset, dst[:nbytes])
            previous = rank
        if previous is not None:
            self.reader(previous).drop_cache()

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


# ---------------------------------------------------------------------------------------------- consolidate
def _read_full(ck: Checkpoint, gidx: int, kind: str, out: torch.Tensor) -> None:
    raw = as_bytes(out)
    ck.execute([(r, off, n, raw[at:]) for r, off, n, at in ck.plan(gidx, kind, 0, out.numel())])


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write ``out/optimizer.safetensors`` (full fp32 state per parameter name) and ``out/model.safetensors``
    (weights in the param dtype), one parameter at a time; verifies every block of every shard."""
    ck = Checkpoint(path)
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    entries = [ck.params[i] for i in sorted(ck.params)]
    step = ck.meta["step"]
    info = {"format": FORMAT_NAME + ".consolidated", "version": str(FORMAT_VERSION), "step": repr(step),
            "param_groups": json.dumps(ck.meta["param_groups"]), "params": json.dumps(entries)}  # fmt: skip
    state_entries, model_entries = [], []
    for e in entries:
        shape = tuple(e["shape"])
        state_entries += [(f"{k}/{e['name']}", torch.float32, shape) for k in ("param", "exp_avg", "exp_avg_sq")]
        state_entries.append((f"step/{e['name']}", torch.float32, ()))
        model_entries.append((e["name"], dtype_of(e["dtype"], ck.path), shape))
    state = SafetensorsWriter(os.path.join(out, "optimizer.safetensors"), state_entries, info)
    model = SafetensorsWriter(os.path.join(out, "model.safetensors"), model_entries, {"format": "pt"})
    try:
        for e in entries:
            numel, name, dtype = int(np.prod(e["shape"], dtype=np.int64)), e["name"], dtype_of(e["dtype"], ck.path)
            master = torch.empty(numel, dtype=torch.float32)
            _read_full(ck, e["index"], "master", master)
            state.write(f"param/{name}", master)
            if dtype == torch.float32:
                model.write(name, master)  # fp32 params are their own master
            else:
                weights = torch.empty(numel, dtype=dtype)
                _read_full(ck, e["index"], "param", weights)
                model.write(name, weights)
                del weights
            del master
            for kind in ("exp_avg", "exp_avg_sq"):
                buf = torch.empty(numel, dtype=torch.float32)
                _read_full(ck, e["index"], kind, buf)
                state.write(f"{kind}/{name}", buf)
                del buf
            state.write(f"step/{name}", torch.tensor(step, dtype=torch.float32))
        state.close()
        model.close()
    finally:
        ck.close()


def adamw_state_dict(out: str | os.PathLike) -> dict[str, Any]:
    """A consolidated ``out`` as a ``torch.optim.AdamW`` state dict (for a model whose param groups list the same
    parameters in the same order)."""
    from safetensors import safe_open

    with safe_open(os.path.join(os.fspath(out), "optimizer.safetensors"), framework="pt") as f:
        meta = f.metadata()
        state = {}
        for e in json.loads(meta["params"]):
            n = e["name"]
            state[e["index"]] = {"step": f.get_tensor(f"step/{n}"), "exp_avg": f.get_tensor(f"exp_avg/{n}"),
                                 "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{n}")}  # fmt: skip
    groups, base = [], 0
    for g in json.loads(meta["param_groups"]):
        hyper = {
            k: decode_value(v)
            for k, v in g["hyperparameters"].items()
            if not (isinstance(v, dict) and "unrestorable" in v)
        }
        groups.append({**hyper, "params": list(range(base, base + g["num_params"]))})
        base += g["num_params"]
    return {"state": state, "param_groups": groups}
