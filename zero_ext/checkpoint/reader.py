"""Reading a ``zero_ext.checkpoint`` without a process group: :class:`ShardReader` (byte ranges of one shard file,
every block verified) and :class:`Checkpoint` (verified metadata, and a plan of byte ranges for any element range
of any parameter). Every file a checkpoint names is resolved inside its directory: a name that leads outside it
(``..``, an absolute path, a symlink out) is refused."""

from __future__ import annotations

import bisect
import glob
import os
import zlib
from typing import Any

import numpy as np
import torch

from . import side_files
from .format import MARKER, META, CheckpointError, dtype_of, rank_stem, read_json
from .schema import check_coverage, check_marker, check_meta, check_model_record, check_rank


class ShardReader:
    """Reads byte ranges of a shard file, verifying the crc32 of every block it touches (a few cached)."""

    def __init__(self, path: str, nbytes: int, block_size: int, crcs: list[int], cache_blocks: int = 4):
        self.path, self.nbytes, self.block_size, self.crcs = path, nbytes, block_size, crcs
        if len(crcs) != -(-nbytes // block_size):
            raise CheckpointError(f"{path}: metadata lists {len(crcs)} block checksums for {nbytes} bytes")
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"missing file {path}") from None
        size = os.fstat(self._fd).st_size
        if size != nbytes:
            os.close(self._fd)
            kind = "truncated" if size < nbytes else "longer than recorded"
            raise CheckpointError(f"{path}: {kind}: {size} bytes, the checkpoint recorded {nbytes}")
        self._cache: dict[int, bytearray] = {}
        self._cache_blocks = cache_blocks

    def _read_block_into(self, index: int, out: memoryview) -> None:
        start = index * self.block_size
        n = os.preadv(self._fd, [out], start)
        if n != len(out):
            raise CheckpointError(f"{self.path}: truncated: block {index} at byte {start} is short ({n} bytes)")
        if zlib.crc32(out) != self.crcs[index]:
            raise CheckpointError(
                f"{self.path}: corrupted: checksum mismatch in block {index} (bytes {start}..{start + len(out)})"
            )

    def _block(self, index: int) -> bytearray:
        buf = self._cache.pop(index, None)
        if buf is None:
            length = min(self.block_size, self.nbytes - index * self.block_size)
            buf = bytearray(length)
            if len(self._cache) >= self._cache_blocks:
                self._cache.pop(next(iter(self._cache)))
            self._read_block_into(index, memoryview(buf))
        self._cache[index] = buf  # most recent last
        return buf

    def verify_blocks(self, ranges) -> None:
        """Check the crc32 of every block the byte ranges ``[(offset, nbytes), ...]`` touch; writes nothing."""
        bs = self.block_size
        blocks = set()
        for offset, nbytes in ranges:
            if offset + nbytes > self.nbytes:
                raise CheckpointError(f"{self.path}: range {offset}..{offset + nbytes} is past the end ({self.nbytes})")
            if nbytes > 0:
                blocks.update(range(offset // bs, (offset + nbytes - 1) // bs + 1))
        scratch = memoryview(bytearray(bs))
        for index in sorted(blocks):
            self._read_block_into(index, scratch[: min(bs, self.nbytes - index * bs)])

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with bytes [offset, offset + len(out)); whole blocks go straight into ``out``."""
        end = offset + len(out)
        if end > self.nbytes:
            raise CheckpointError(f"{self.path}: range {offset}..{end} is past the end of the file ({self.nbytes})")
        mv = memoryview(out).cast("B")
        pos = offset
        bs = self.block_size
        while pos < end:
            index, within = divmod(pos, bs)
            block_end = min((index + 1) * bs, self.nbytes)
            take = min(block_end, end) - pos
            if within == 0 and take == block_end - pos and index not in self._cache:
                self._read_block_into(index, mv[pos - offset : pos - offset + take])
            else:
                mv[pos - offset : pos - offset + take] = self._block(index)[within : within + take]
            pos += take

    def drop_cache(self) -> None:
        self._cache.clear()

    def close(self) -> None:
        os.close(self._fd)


def inside(directory: str, name: object, where: str) -> str:
    """``directory/name`` if that path (symlinks resolved) stays inside ``directory``, else a CheckpointError."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where}: file name {name!r} is not a plain file name")
    path = os.path.join(directory, name)
    real_dir, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.isabs(name) or os.path.commonpath([real_dir, real]) != real_dir:
        raise CheckpointError(
            f"{where}: file {name!r} lies outside the checkpoint directory {directory}; refusing to read it"
        )
    return path


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
        self.crcs = crcs = check_marker(read_json(marker_path), marker_path)
        meta_path = os.path.join(path, META)
        if META not in crcs:
            raise CheckpointError(f"{marker_path}: no checksum for {META}")
        self.meta = read_json(meta_path, crcs[META])
        check_meta(self.meta, meta_path)
        check_model_record(self.meta, crcs, meta_path)
        self.world_size = self.meta["world_size"]
        self.params = {e["index"]: e for e in self.meta["params"]}
        self.by_name = {e["name"]: e for e in self.meta["params"]}
        self.ranks = []
        for r in range(self.world_size):
            name = rank_stem(r) + ".json"
            if name not in crcs:
                raise CheckpointError(f"{marker_path}: no checksum for {name}")
            record = read_json(os.path.join(path, name), crcs[name])
            check_rank(record, r, self.meta, f"{path}/{name}")
            self.ranks.append(record)
        # global index -> sorted [(start, end, rank, group position, shard offset)]
        self.pieces: dict[int, list[tuple[int, int, int, int, int]]] = {i: [] for i in self.params}
        for r, rec in enumerate(self.ranks):
            for gpos, group in enumerate(rec["groups"]):
                for gidx, start, end, shard_offset in group["pieces"]:
                    self.pieces[gidx].append((start, end, r, gpos, shard_offset))
        for plist in self.pieces.values():
            plist.sort()
        check_coverage(self.pieces, self.meta, path)
        self._readers: dict[int, ShardReader] = {}

    def param_step(self, entry: dict) -> float:
        """A parameter's own step count (version 1 checkpoints kept only the global one)."""
        return float(entry.get("step", self.meta["step"]))

    def reader(self, rank: int) -> ShardReader:
        if rank not in self._readers:
            rec = self.ranks[rank]
            path = inside(self.path, rec["file"], f"{self.path}/{rank_stem(rank)}.json")
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


def read_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` a checkpoint was saved with (``save(path, opt, extra=...)``), None when it has none: what
    ``load`` returns, read before anything is built, so that a trainer can build its model from arguments it saved
    there (``extra={"model_args": ..., "step": ...}``), then build the optimizer and ``load``. Needs no process group,
    optimizer, model or GPU (tensors come back on the CPU); reads only, so every rank may call it. Verified as
    ``load`` verifies: the completion marker, the metadata and the checksums of the files read; a damaged or
    incomplete checkpoint raises :class:`CheckpointError`."""
    ck = Checkpoint(path)
    try:
        return side_files.read_extra(ck.path, ck.crcs)
    finally:
        ck.close()
