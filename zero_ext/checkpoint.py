"""Sharded checkpoints of a :class:`zero_ext.ZeroAdamW`: save in parallel, load at any world size and stage,
consolidate offline.

``save(path, opt)``: every rank writes only its own shards (fp32 master, exp_avg, exp_avg_sq and, for bf16/fp16
params, its slices of the params) straight from the optimizer's buffers, bucket by bucket, into
``path.tmp-<id>``; rank 0 adds ``meta.json``. After every rank reports success (a collective), rank 0 writes the
``COMPLETE`` marker and swaps the new directory into ``path`` with one atomic ``renameat2(RENAME_EXCHANGE)``
(fallback: two renames), then deletes the old one. An interrupted save leaves ``path`` untouched.

``load(path, opt)``: every rank reads, for each parameter piece it owns in *its* layout, the byte ranges of the
saved shards that hold those elements (found by parameter name), verifying the crc32 of each block it touches,
directly into its optimizer buffers; then params are rebuilt from the master (rounded) and all-gathered. The
loaded master, moments, step and hyperparameters are bitwise the saved ones.

``consolidate(path, out)`` / ``python -m zero_ext.checkpoint consolidate PATH OUT``: no process group, no GPU;
streams parameter by parameter into ``out/optimizer.safetensors`` (fp32 ``param/<name>``, ``exp_avg/<name>``,
``exp_avg_sq/<name>``, ``step/<name>``; param groups in the metadata) and ``out/model.safetensors`` (weights
in the param dtype, for ``model.load_state_dict``). File layout: :mod:`zero_ext.checkpoint_format`.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import secrets
import shutil
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER,
    META,
    CheckpointError,
    ShardWriter,
    as_bytes,
    decode_value,
    dtype_name,
    encode_value,
    fsync_dir,
    rank_stem,
    write_json,
)
from .checkpoint_io import Checkpoint, adamw_state_dict, consolidate

if TYPE_CHECKING:
    from .optimizer import ZeroAdamW

__all__ = ["save", "load", "consolidate", "adamw_state_dict", "Checkpoint", "CheckpointError", "FORMAT_VERSION"]

_F32_KINDS = ("master", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------------------------------- save
def _kinds(fg) -> list[tuple[str, Any]]:
    """(kind, bucket -> this rank's 1-D view) for every section a flat group writes."""
    kinds = [
        ("master", fg.master_of),
        ("exp_avg", lambda b: fg.shard_of(fg.exp_avg, b)),
        ("exp_avg_sq", lambda b: fg.shard_of(fg.exp_avg_sq, b)),
    ]
    if not fg.master_is_param:
        kinds.append(("param", fg.param_slice))
    return kinds


def _write_rank(directory: str, opt: "ZeroAdamW") -> int:
    """Write this rank's shard file and its JSON; returns the JSON's crc32."""
    rank = opt._comm.rank
    writer = ShardWriter(os.path.join(directory, rank_stem(rank) + ".bin"))
    groups = []
    try:
        for fg, indices in zip(opt._flat_groups, opt._global_indices):
            sections = {}
            for kind, view_of in _kinds(fg):
                sections[kind] = {"offset": writer.align(), "dtype": "float32" if kind != "param" else None}
                for bucket in fg.layout.buckets:  # one bucket at a time: a device shard crosses to the host in pieces
                    writer.write(as_bytes(view_of(bucket).detach().to("cpu")))
                sections[kind]["dtype"] = dtype_name(view_of(fg.layout.buckets[0]).dtype)
            pieces = [[indices[p.index], p.start, p.end, p.shard_offset] for p in fg.layout.owned_pieces(rank)]
            groups.append({"dtype": dtype_name(fg.dtype), "shard_numel": fg.layout.shard_numel, "sections": sections,
                           "pieces": pieces})  # fmt: skip
        writer.close()
    except BaseException:
        writer.abort()
        raise
    record = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "rank": rank, "world_size": opt._comm.world_size,
              "file": rank_stem(rank) + ".bin", "nbytes": writer.nbytes, "block_size": writer.block_size,
              "crc32": writer.crcs, "groups": groups}  # fmt: skip
    return write_json(os.path.join(directory, rank_stem(rank) + ".json"), record)


def _meta(opt: "ZeroAdamW") -> dict[str, Any]:
    params = []
    for fi, (fg, indices) in enumerate(zip(opt._flat_groups, opt._global_indices)):
        for p, gidx in zip(fg.params, indices):
            params.append({"index": gidx, "name": opt._names[gidx], "shape": list(p.shape),
                           "dtype": dtype_name(p.dtype), "group": opt._group_of_flat[fi]})  # fmt: skip
    groups = []
    for g in opt.param_groups:
        hyper = {}
        for key, value in g.items():
            if key in ("params", "param_names"):
                continue
            try:
                hyper[key] = encode_value(value)
            except TypeError:  # kept for the record, not restored
                hyper[key] = {"unrestorable": repr(value)}
        groups.append({"hyperparameters": hyper, "num_params": len(g["params"])})
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": opt._comm.world_size,
            "stage": opt.stage, "bucket_size": opt.bucket_size, "step": opt._step_count.item(),
            "skipped_steps": opt._skipped.item(), "params": sorted(params, key=lambda e: e["index"]),
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


def _write_marker(tmp: str, world: int, crcs: list[int], meta_crc: int) -> None:
    files = {rank_stem(r) + ".json": crc for r, crc in enumerate(crcs)}
    files[META] = meta_crc
    write_json(os.path.join(tmp, MARKER), {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": world,
                                           "crc32": files})  # fmt: skip
    fsync_dir(tmp)


def _agree(comm, error: BaseException | None, what: str) -> None:
    """Collective: every rank learns whether every rank succeeded; failing ranks re-raise their own error."""
    flags = comm.all_gather_object_ints(0 if error is None else 1)
    if error is not None:
        raise error
    if any(flags):
        raise CheckpointError(f"{what} failed on rank(s) {[r for r, f in enumerate(flags) if f]} (see their errors)")


def save(path: str | os.PathLike, optimizer: "ZeroAdamW") -> None:
    """Collective: every rank writes its own shards to ``path`` (a directory, replaced atomically when complete)."""
    opt, comm = optimizer, optimizer._comm
    opt.wait_for_params()
    opt._reducer.finish()
    path = os.path.abspath(os.fspath(path))
    tid = comm.all_gather_object_ints(secrets.randbits(48) if comm.rank == 0 else 0)[0]
    tmp = f"{path}.tmp-{tid:012x}"
    crc, meta_crc, error = -1, -1, None
    try:
        _check_target(path)
        os.makedirs(tmp, exist_ok=True)
        crc = _write_rank(tmp, opt)
        if comm.rank == 0:
            meta_crc = write_json(os.path.join(tmp, META), _meta(opt))
    except BaseException as e:  # noqa: BLE001  (reported to every rank below, then re-raised)
        error = e
    crcs = comm.all_gather_object_ints(crc if error is None else -1)
    if error is None and min(crcs) < 0:
        error = CheckpointError(f"saving {path}: rank(s) {[r for r, c in enumerate(crcs) if c < 0]} failed "
                                f"(see their errors); the previous checkpoint is untouched, the partial one is {tmp}")  # fmt: skip
    _agree(comm, error, f"saving {path}")
    if comm.rank == 0:
        try:
            _write_marker(tmp, comm.world_size, crcs, meta_crc)
            _publish(tmp, path, tid)
        except BaseException as e:  # noqa: BLE001
            error = e
    _agree(comm, error, f"publishing {path}")


# ---------------------------------------------------------------------------------------------- load
def _match(ck: Checkpoint, opt: "ZeroAdamW") -> dict[int, int]:
    """This optimizer's global index -> the checkpoint's, by name; every mismatch named."""
    mine = {}
    for fi, (fg, indices) in enumerate(zip(opt._flat_groups, opt._global_indices)):
        for p, gidx in zip(fg.params, indices):
            mine[opt._names[gidx]] = (gidx, p, opt._group_of_flat[fi])
    missing, extra = sorted(set(mine) - set(ck.by_name)), sorted(set(ck.by_name) - set(mine))
    if missing or extra:
        raise CheckpointError(f"{ck.path}: parameters do not match the model (renamed, added or removed?): model "
                              f"parameters missing from the checkpoint: {missing}; checkpoint parameters not in the "
                              f"model: {extra}")  # fmt: skip
    if len(ck.meta["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{ck.path}: {len(ck.meta['param_groups'])} param groups saved, the optimizer has "
                              f"{len(opt.param_groups)}")  # fmt: skip
    mapping = {}
    for name, (gidx, p, group) in mine.items():
        e = ck.by_name[name]
        for what, have, saved in (("shape", list(p.shape), e["shape"]), ("dtype", dtype_name(p.dtype), e["dtype"]),
                                  ("param group", group, e["group"])):  # fmt: skip
            if have != saved:
                raise CheckpointError(f"parameter {name!r}: {what} {saved} in {ck.path}, but {have} in the model")
        mapping[gidx] = e["index"]
    return mapping


def _restore_groups(ck: Checkpoint, opt: "ZeroAdamW") -> None:
    for group, saved in zip(opt.param_groups, ck.meta["param_groups"]):
        for key, value in saved["hyperparameters"].items():
            if isinstance(value, dict) and "unrestorable" in value:
                continue
            value = decode_value(value)
            if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                group[key].fill_(value.item())
            else:
                group[key] = value


def load(path: str | os.PathLike, optimizer: "ZeroAdamW") -> None:
    """Collective: load a checkpoint saved at any world size and stage into ``optimizer`` (and its params).

    Everything is checked before anything is written: metadata (names, shapes, dtypes, coverage, file sizes) and
    the checksum of every block this rank will read. A damaged checkpoint raises on every rank and leaves the
    optimizer as it was."""
    opt, comm = optimizer, optimizer._comm
    opt.wait_for_params()
    opt._reducer.finish()
    ck, error, work = None, None, []
    try:
        ck = Checkpoint(path)
        mapping = _match(ck, opt)
        for fg, indices in zip(opt._flat_groups, opt._global_indices):
            by_bucket: dict[int, list] = {}
            for piece in fg.layout.owned_pieces(comm.rank):
                slot = fg.layout.slots[piece.index]
                by_bucket.setdefault(slot.bucket, []).append(piece)
            for bucket in fg.layout.buckets:
                plans = []
                for piece in by_bucket.get(bucket.index, []):
                    local = piece.shard_offset - bucket.shard_offset
                    for kind in _F32_KINDS:
                        for r, off, n, at in ck.plan(mapping[indices[piece.index]], kind, piece.start, piece.end):
                            plans.append((kind, r, off, n, local * 4 + at))
                if plans:
                    work.append((fg, bucket, plans))
        # A verification pass (from the page cache, 1 MiB at a time) so that a damaged block fails the load with
        # the optimizer untouched, instead of after some buffers were already overwritten.
        ck.verify([(r, off, n) for _, _, plans in work for _, r, off, n, _ in plans])
    except BaseException as e:  # noqa: BLE001
        error = e
    _agree(comm, error, f"loading {path}")
    try:
        with torch.no_grad():
            for fg, bucket, plans in work:
                views = {"master": fg.master_of(bucket), "exp_avg": fg.shard_of(fg.exp_avg, bucket),
                         "exp_avg_sq": fg.shard_of(fg.exp_avg_sq, bucket)}  # fmt: skip
                on_host = fg.device.type == "cpu"
                dst = {k: v if on_host else torch.zeros(v.shape, dtype=v.dtype) for k, v in views.items()}
                raw = {k: as_bytes(v) for k, v in dst.items()}
                ck.execute([(r, off, n, raw[kind][at:]) for kind, r, off, n, at in plans])
                if not on_host:
                    for k, v in views.items():
                        v.copy_(dst[k])
    except BaseException as e:  # noqa: BLE001
        error = e
    finally:
        if ck is not None:
            ck.close()
    _agree(comm, error, f"loading {path}")
    with torch.no_grad():
        _restore_groups(ck, opt)
        opt._step_count.fill_(ck.meta["step"])
        opt._skipped.fill_(ck.meta["skipped_steps"])
        pending = []  # params follow the loaded master: round this rank's slices, gather everyone's
        for fg in opt._flat_groups:
            for bucket in fg.layout.buckets:
                if not fg.master_is_param:
                    fg.param_slice(bucket).copy_(fg.master_of(bucket))
                pending.append(comm.all_gather(fg.bucket_view(fg.param_buffer, bucket), fg.param_slice(bucket)))
        for p in pending:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zero_ext.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write OUT/optimizer.safetensors and OUT/model.safetensors")
    c.add_argument("path")
    c.add_argument("out")
    args = parser.parse_args(argv)
    try:
        consolidate(args.path, args.out)
    except CheckpointError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {os.path.join(args.out, 'optimizer.safetensors')} and {os.path.join(args.out, 'model.safetensors')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
