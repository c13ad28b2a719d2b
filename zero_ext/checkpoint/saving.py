"""``save(path, optimizer)``: every rank writes only its own shards, in parallel, and the checkpoint appears
atomically when every rank succeeded.

Every rank writes every kind of its update rules' state (the fp32 master and the moments) and, for bf16/fp16
params, its slices of the params,
bucket by bucket, into ``path.tmp-<id>``; rank 0 adds ``meta.json``. After every rank reports success (a
collective), rank 0 writes the ``COMPLETE`` marker and swaps the new directory into ``path`` with one atomic
``renameat2(RENAME_EXCHANGE)`` (fallback: two renames), then deletes the old one. An interrupted save leaves
``path`` untouched. The file layout is in :mod:`zero_ext.checkpoint.format`.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import secrets
import shutil
from typing import Any

from ..engine.sleep import asleep
from ..state.sharded_state import FlatGroup, ShardedState
from ..update.registry import rule_name_of
from .agreement import agree, arrive, sharded_state_of
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER,
    META,
    CheckpointError,
    ShardWriter,
    as_bytes,
    dtype_name,
    encode_value,
    fsync_dir,
    rank_stem,
    write_json,
)
from .side_files import encode_extra, write_extra, write_model_files


def _sections(group: FlatGroup) -> list[str]:
    """Every kind the group's rule saves (the fp32 master, also when it is kept as param + remainder: converted by
    the placement), and the parameters where they are not the master (bf16/fp16)."""
    kinds = list(group.rule.saved_kind_names)
    return kinds if group.rule.master_is_param else kinds + ["param"]


def _host_bytes(group: FlatGroup, kind: str, bucket):
    if kind == "param":
        values = group.flat_params.rank_values(bucket)
    else:
        values = group.state.read(kind, bucket.shard_range)
    return as_bytes(values.detach().to("cpu")), values.dtype


def _write_rank(directory: str, state: ShardedState) -> int:
    """Write this rank's shard file and its JSON; returns the JSON's crc32."""
    rank = state.rank
    writer = ShardWriter(os.path.join(directory, rank_stem(rank) + ".bin"))
    groups = []
    try:
        for group in state.groups:
            sections = {}
            for kind in _sections(group):
                sections[kind] = {"offset": writer.align()}
                for bucket in group.layout.buckets:  # one bucket at a time: a device shard crosses in pieces
                    data, dtype = _host_bytes(group, kind, bucket)
                    writer.write(data)
                sections[kind]["dtype"] = dtype_name(dtype)
            pieces = [[group.param_indices[p.index], p.start, p.end, p.shard_offset] for p in group.owned_pieces()]
            groups.append({"dtype": dtype_name(group.dtype), "shard_numel": group.layout.shard_numel,
                           "sections": sections, "pieces": pieces})  # fmt: skip
        writer.close()
    except BaseException:
        writer.abort()
        raise
    record = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "rank": rank, "world_size": state.world_size,
              "file": rank_stem(rank) + ".bin", "nbytes": writer.nbytes, "block_size": writer.block_size,
              "crc32": writer.crcs, "groups": groups}  # fmt: skip
    return write_json(os.path.join(directory, rank_stem(rank) + ".json"), record)


def _meta(state: ShardedState, param_groups) -> dict[str, Any]:
    params = []
    steps = state.step_counts.values()  # every rank tracks every parameter's count
    for group, gidx, p in state.members():
        params.append({"index": gidx, "name": state.names[gidx], "shape": list(p.shape), "dtype": dtype_name(p.dtype),
                       "group": group.group_index, "step": steps[gidx]})  # fmt: skip
    groups = []
    rules = {group.group_index: group.rule.name for group in state.groups}
    for gi, g in enumerate(param_groups):
        hyper = {}
        for key, value in g.items():
            if key in ("params", "param_names"):
                continue
            try:
                hyper[key] = encode_value(value)
            except TypeError:  # kept for the record, not restored
                hyper[key] = {"unrestorable": repr(value)}
        rule = rules.get(gi) or rule_name_of(g, state.default_rule)  # what consolidation and loading look up
        groups.append({"rule": rule, "hyperparameters": hyper, "num_params": len(g["params"])})
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": state.world_size,
            "stage": state.stage, "bucket_size": state.bucket_size, "step": state.step_count.item(),
            "skipped_steps": state.skipped.item(), "params": sorted(params, key=lambda e: e["index"]),
            "param_groups": groups}  # fmt: skip


def _exchange(a: str, b: str) -> None:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 unavailable")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), b)


def _publish(tmp: str, path: str, tid: int) -> None:
    """Move the completed ``tmp`` to ``path``; the old checkpoint at ``path`` survives until the swap."""
    if os.path.lexists(path):
        try:
            _exchange(tmp, path)  # tmp now holds the old checkpoint
            old = tmp
        except OSError:  # e.g. a filesystem without RENAME_EXCHANGE: a short window where `path` is missing
            old = f"{path}.old-{tid:012x}"
            os.rename(path, old)
            os.rename(tmp, path)
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(path))
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)  # leftovers of interrupted saves: `path` is complete now


def _check_target(path: str) -> None:
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} exists and is not a directory; refusing to replace it")
        if os.listdir(path) and not os.path.exists(os.path.join(path, META)):
            raise CheckpointError(
                f"{path} is a non-empty directory but not a zero_ext checkpoint; refusing to replace it"
            )


def _write_marker(tmp: str, world: int, crcs: list[int], meta_crc: int, side_crcs: dict[str, int]) -> None:
    files = {rank_stem(r) + ".json": crc for r, crc in enumerate(crcs)}
    files[META] = meta_crc
    files.update(side_crcs)
    write_json(os.path.join(tmp, MARKER), {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": world,
                                           "crc32": files})  # fmt: skip
    fsync_dir(tmp)


def save(path: str | os.PathLike, optimizer, *, extra: Any = None, timeout: float | None = None) -> None:
    """Collective: every rank of the optimizer's group must call it (each writes its own shards to ``path``, a
    directory replaced atomically when complete). A call on some ranks only raises a ``CheckpointError`` on the
    calling ranks after ``timeout`` seconds instead of hanging (default: the optimizer's ``collective_timeout``,
    or 300 s where it is None).

    With ``module=`` on the optimizer the checkpoint also holds the model's own state (frozen parameters, buffers,
    the names of tied weights, a transformers config). ``extra``: your own state saved beside it, taken from rank 0
    (e.g. ``{"scheduler": scheduler.state_dict(), "step": step}``; dicts, lists, tuples, strings, numbers, None and
    tensors); :func:`zero_ext.checkpoint.load` returns it, and :func:`zero_ext.checkpoint.read_extra` reads it before
    anything is built (e.g. the arguments to build the model from)."""
    state = sharded_state_of(optimizer, "save")
    comm = state.comm
    path = os.path.abspath(os.fspath(path))
    first = comm.process_rank == 0  # writes the metadata, the model's files and the marker, publishes
    tid = arrive(comm, secrets.randbits(48) if first else 0, timeout, f"saving {path}")[0]
    sleeping = asleep(state)  # offload_states(): refused on every rank, through the agreement below
    if sleeping is None:
        optimizer.finish_sync()
    tmp = f"{path}.tmp-{tid:012x}"
    crc, meta_crc, side_crcs, error = -1, -1, {}, None
    try:
        if sleeping is not None:
            raise sleeping.refusal("zero_ext.checkpoint.save")
        _check_target(path)
        os.makedirs(tmp, exist_ok=True)
        # every layout rank's shard once: a replica of replicated state (hsdp.py) holds the same bytes, and skips
        crc = _write_rank(tmp, state) if comm.writes_checkpoints else 0
        if first:
            meta = _meta(state, optimizer.param_groups)
            meta["model"], side_crcs = write_model_files(tmp, state)
            if extra is not None:
                side_crcs.update(write_extra(tmp, *encode_extra(extra)))
            meta_crc = write_json(os.path.join(tmp, META), meta)
    except BaseException as e:  # noqa: BLE001  (reported to every rank below, then re-raised)
        error = e
    agreed = comm.agree(crc if error is None else -1)  # process order
    if error is None and min(agreed) < 0:
        error = CheckpointError(f"saving {path}: rank(s) {[r for r, c in enumerate(agreed) if c < 0]} failed "
                                f"(see their errors); the previous checkpoint is untouched, the partial one is {tmp}")  # fmt: skip
    agree(comm, error, f"saving {path}")
    crcs = [0] * comm.world_size  # by layout rank: each file's writer
    for process, rank in enumerate(comm.layout_ranks()):
        if rank is not None:
            crcs[rank] = agreed[process]
    if first:
        try:
            _write_marker(tmp, comm.world_size, crcs, meta_crc, side_crcs)
            _publish(tmp, path, tid)
        except BaseException as e:  # noqa: BLE001
            error = e
    agree(comm, error, f"publishing {path}")
