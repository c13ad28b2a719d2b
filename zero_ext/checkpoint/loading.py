"""``load(path, optimizer)``: a checkpoint saved at any world size, stage and layout, into this optimizer.

Every rank reads, for each parameter piece it owns in *its* layout, the byte ranges of the saved shards that hold
those elements (found by parameter name), verifying the crc32 of each block it touches, straight into its
optimizer state; then the params are rebuilt from the master (rounded) and all-gathered. The loaded master,
moments, step and hyperparameters are bitwise the saved ones. Everything is checked before anything is written:
metadata (names, shapes, dtypes, coverage, file sizes, hyperparameters) and the checksum of every block this
rank will read; a damaged checkpoint raises on every rank and leaves the optimizer as it was.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..engine.param_sync import params_from_master
from ..engine.sleep import asleep
from ..state.sharded_state import ShardedState
from ..update.registry import DEFAULT_RULE, RULE_KEY
from .agreement import agree, arrive, sharded_state_of
from .format import CheckpointError, as_bytes, decode_value, dtype_name
from .reader import Checkpoint
from .side_files import read_extra, read_model_extra


def _match(ck: Checkpoint, state: ShardedState, param_groups) -> dict[int, int]:
    """This optimizer's global index -> the checkpoint's, by name; every mismatch named."""
    mine = {state.names[gidx]: (gidx, p, group.group_index) for group, gidx, p in state.members()}
    _match_groups(ck, param_groups)
    missing, extra = sorted(set(mine) - set(ck.by_name)), sorted(set(ck.by_name) - set(mine))
    if missing or extra:
        raise CheckpointError(f"{ck.path}: parameters do not match the model (renamed, added or removed?): model "
                              f"parameters missing from the checkpoint: {missing}; checkpoint parameters not in the "
                              f"model: {extra}")  # fmt: skip
    mapping = {}
    for name, (gidx, p, group) in mine.items():
        e = ck.by_name[name]
        for what, have, saved in (("shape", list(p.shape), e["shape"]), ("dtype", dtype_name(p.dtype), e["dtype"]),
                                  ("param group", group, e["group"])):  # fmt: skip
            if have != saved:
                raise CheckpointError(f"parameter {name!r}: {what} {saved} in {ck.path}, but {have} in the model")
        mapping[gidx] = e["index"]
    return mapping


def _match_groups(ck: Checkpoint, param_groups) -> None:
    """The same number of param groups on both sides; else the groups one side lacks, named by their parameters
    (groups added with ``add_param_group`` are added before loading, not by the load: their hyperparameters and
    the order of the groups are the training script's)."""
    saved, have = len(ck.meta["param_groups"]), len(param_groups)
    if saved == have:
        return

    def names(groups):
        out = [e["name"] for e in ck.meta["params"] if e["group"] in groups]
        return out if len(out) <= 4 else out[:4] + [f"... {len(out) - 4} more"]

    if saved > have:
        lacking = list(range(have, saved))
        raise CheckpointError(
            f"{ck.path}: {saved} param groups saved, the optimizer has {have}: saved param group(s) {lacking} "
            f"(parameters {names(set(lacking))}) are missing. Add them first, on every rank, in the order they were "
            "added: p.requires_grad_(True) for their parameters, then opt.add_param_group({'params': [...], ...}); "
            "then load"
        )
    raise CheckpointError(
        f"{ck.path}: {saved} param groups saved, the optimizer has {have}: its param group(s) "
        f"{list(range(saved, have))} are not in the checkpoint (saved before opt.add_param_group?). Load it into an "
        "optimizer without them, then add them"
    )


def _saved_groups(ck: Checkpoint, state: ShardedState, param_groups, device) -> list[dict]:
    """The saved hyperparameters of every param group, decoded and checked by the group's update rule (a rule kept
    different state, e.g. ``amsgrad`` differs, fails here); nothing is applied yet."""
    out = []
    rules = {g.group_index: g.rule for g in state.groups}
    for gi, (group, saved) in enumerate(zip(param_groups, ck.meta["param_groups"])):
        values = {}
        for key, value in saved["hyperparameters"].items():
            if isinstance(value, dict) and "unrestorable" in value:
                continue
            values[key] = decode_value(value)
        merged = {**group, **values}
        name = saved.get(RULE_KEY, DEFAULT_RULE)
        if gi in rules and rules[gi].name != name:
            raise CheckpointError(
                f"{ck.path}: saved param group {gi} was updated by rule {name!r}, this optimizer's by "
                f"{rules[gi].name!r}: a rule's state does not carry over to another"
            )
        if gi in rules:
            try:
                rules[gi].check_group(f"{ck.path}: saved param group {gi}", merged, device=device)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        out.append(values)
    return out


def _restore_groups(param_groups, saved_groups) -> None:
    for group, values in zip(param_groups, saved_groups):
        for key, value in values.items():
            if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                group[key].fill_(value.item())
            else:
                group[key] = value


def _plan_reads(ck: Checkpoint, state: ShardedState, mapping: dict[int, int]) -> list:
    """[(group, bucket, [(kind, rank, file offset, nbytes, byte offset in the bucket's shard)])] for every kind of
    each group's update rule"""
    work = []
    for group in state.groups:
        by_bucket: dict[int, list] = {}
        for piece in group.owned_pieces():
            by_bucket.setdefault(piece.bucket, []).append(piece)
        for bucket in group.layout.buckets:
            plans = []
            for piece in by_bucket.get(bucket.index, []):
                local = piece.shard_offset - bucket.shard_offset
                saved_index = mapping[group.param_indices[piece.index]]
                for kind in group.rule.saved_kinds:  # the fp32 master even where a remainder is kept
                    for r, off, n, at in ck.plan(saved_index, kind.name, piece.start, piece.end):
                        plans.append((kind.name, r, off, n, local * kind.itemsize + at))
            if plans:
                work.append((group, bucket, plans))
    return work


def _model_tensors(ck: Checkpoint, state: ShardedState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """With ``module=``: the (model tensor, saved value) pairs of the model's frozen parameters and buffers, checked
    against the checkpoint's (names, shapes, dtypes). Empty when either side has no model state."""
    if state.model is None:
        return []
    saved = read_model_extra(ck.path, ck.crcs)
    if saved is None:
        return []  # saved without module=: nothing beyond the optimizer's parameters to restore
    mine = state.model.unmanaged({id(p) for _, _, p in state.members()})
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(f"{ck.path}: the model's buffers and frozen parameters do not match the checkpoint's: "
                              f"missing from the checkpoint: {missing}; not in the model: {extra}")  # fmt: skip
    pairs = []
    for name, t in mine.items():
        if t.shape != saved[name].shape or t.dtype != saved[name].dtype:
            raise CheckpointError(f"{ck.path}: {name!r} is {saved[name].dtype} {tuple(saved[name].shape)} in the "
                                  f"checkpoint, {t.dtype} {tuple(t.shape)} in the model")  # fmt: skip
        pairs.append((t, saved[name]))
    return pairs


def load(path: str | os.PathLike, optimizer, *, timeout: float | None = None) -> Any:
    """Collective: every rank of the optimizer's group must call it. Loads a checkpoint saved at any world size
    and stage into ``optimizer`` (and its params; with ``module=`` also the model's buffers and frozen parameters)
    and returns the ``extra`` state it was saved with (None if none). A call on some ranks only raises a
    ``CheckpointError`` on the calling ranks after ``timeout`` seconds instead of hanging (default: the optimizer's
    ``collective_timeout``, or 300 s where it is None)."""
    state = sharded_state_of(optimizer, "load")
    comm = state.comm
    arrive(comm, 0, timeout, f"loading {os.fspath(path)}")
    sleeping = asleep(state)  # offload_states(): refused on every rank, through the agreement below
    if sleeping is None:
        optimizer.finish_sync()
    ck, error, work, saved_groups, steps, model_tensors, extra = None, None, [], [], {}, [], None
    try:
        if sleeping is not None:
            raise sleeping.refusal("zero_ext.checkpoint.load")
        ck = Checkpoint(path)
        mapping = _match(ck, state, optimizer.param_groups)
        saved_groups = _saved_groups(ck, state, optimizer.param_groups, state.device)
        step, skipped = float(ck.meta["step"]), float(ck.meta["skipped_steps"])
        steps = {gidx: ck.param_step(ck.params[saved]) for gidx, saved in mapping.items()}
        work = _plan_reads(ck, state, mapping)
        model_tensors = _model_tensors(ck, state)
        extra = read_extra(ck.path, ck.crcs)
        # A verification pass (from the page cache, 1 MiB at a time) so that a damaged block fails the load with
        # the optimizer untouched, instead of after some buffers were already overwritten.
        ck.verify([(r, off, n) for _, _, plans in work for _, r, off, n, _ in plans])
    except BaseException as e:  # noqa: BLE001
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: cannot load: {e!r}")
    agree(comm, error, f"loading {path}")
    try:
        with torch.no_grad():
            for group, bucket, plans in work:
                # Straight into the state where it is host memory; else through a host copy of the bucket's shard.
                kinds = {k.name: k.dtype for k in group.rule.saved_kinds}
                direct = {k: group.state.host_view(k, bucket.shard_range) for k in kinds}
                dst = {
                    k: v if v is not None else torch.zeros(bucket.shard_numel, dtype=kinds[k])
                    for k, v in direct.items()
                }
                raw = {k: as_bytes(v) for k, v in dst.items()}
                ck.execute([(r, off, n, raw[kind][at:]) for kind, r, off, n, at in plans])
                for kind, values in dst.items():
                    if direct[kind] is None:
                        _write_owned(group, bucket, kind, values)
    except BaseException as e:  # noqa: BLE001
        error = e
    finally:
        if ck is not None:
            ck.close()
    agree(comm, error, f"loading {path}")
    with torch.no_grad():
        _restore_groups(optimizer.param_groups, saved_groups)
        state.step_count.fill_(step)
        state.step_counts.load(steps)
        for t, value in model_tensors:
            t.copy_(value)
        state.skipped.fill_(skipped)
    params_from_master(state)
    return extra


def _write_owned(group, bucket, kind: str, values: torch.Tensor) -> None:
    """Write the loaded elements of ``bucket``'s shard (real parameter runs only; padding stays as it is)."""
    for piece in group.owned_pieces():
        if piece.bucket == bucket.index:
            local = piece.shard_range.shifted(-bucket.shard_offset)
            group.state.write(kind, piece.shard_range, local.of(values))
