"""A rank's shard as a torch.optim-style state dict.

``state`` maps a parameter's index (its position across all param groups, as in torch.optim) to the part of
its state this rank owns: ``exp_avg``, ``exp_avg_sq`` and, for bf16/fp16 params, the fp32 ``master``, each
a 1-D tensor holding elements ``shard_range = (start, end)`` of the flattened parameter, plus ``step``.
Parameters this rank owns no element of have no entry. ``param_groups`` are torch's (hyperparameters and
parameter indices); ``zero`` records the layout so that loading into a different one fails clearly.
Resharding to another world size is ``zero_ext.checkpoint``'s job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .optimizer import ZeroAdamW

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _layout_record(opt: "ZeroAdamW") -> dict[str, Any]:
    return {
        "world_size": opt._comm.world_size,
        "rank": opt._comm.rank,
        "stage": opt.stage,
        "bucket_size": opt.bucket_size,
        "numels": [list(fg.layout.numels) for fg in opt._flat_groups],
    }


def local_state_dict(opt: "ZeroAdamW") -> dict[str, Any]:
    rank = opt._comm.rank
    step = opt._step_count.detach().to("cpu", copy=True)
    state: dict[int, dict[str, Any]] = {}
    for fg, indices in zip(opt._flat_groups, opt._global_indices):
        for piece in fg.layout.owned_pieces(rank):
            run = slice(piece.shard_offset, piece.shard_offset + piece.end - piece.start)
            entry = {
                "step": step.clone(),
                "exp_avg": fg.exp_avg[run].clone(),
                "exp_avg_sq": fg.exp_avg_sq[run].clone(),
                "shard_range": (piece.start, piece.end),
            }
            if not fg.master_is_param:
                entry["master"] = fg.master[run].clone()
            state[indices[piece.index]] = entry
    groups, base = [], 0
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = list(range(base, base + len(g["params"])))
        base += len(g["params"])
        groups.append(saved)
    zero = _layout_record(opt)
    zero["step"] = step
    zero["skipped_steps"] = opt._skipped.detach().to("cpu", copy=True)
    return {"state": state, "param_groups": groups, "zero": zero}


def load_local_state_dict(opt: "ZeroAdamW", sd: dict[str, Any]) -> None:
    where = "zero_ext.ZeroAdamW.load_state_dict"
    for key in ("state", "param_groups", "zero"):
        if key not in sd:
            raise ValueError(f"{where}: `state_dict` has no {key!r} entry (not a ZeroAdamW state dict?)")
    mine, theirs = _layout_record(opt), sd["zero"]
    for key, value in mine.items():
        if theirs.get(key) != value:
            raise ValueError(
                f"{where}: saved {key}={theirs.get(key)!r} but this optimizer has {key}={value!r}; a local state dict "
                "only loads into the same rank of the same layout (use zero_ext.checkpoint to change world size)"
            )
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(
            f"{where}: saved {len(sd['param_groups'])} param groups, this optimizer has {len(opt.param_groups)}"
        )
    rank = opt._comm.rank
    writes = []  # (destination, source) pairs, validated before any is applied
    expected = set()
    for fg, indices in zip(opt._flat_groups, opt._global_indices):
        for piece in fg.layout.owned_pieces(rank):
            gidx = indices[piece.index]
            expected.add(gidx)
            entry = sd["state"].get(gidx)
            if entry is None:
                raise ValueError(f"{where}: no state for parameter {opt._names[gidx]!r} (index {gidx})")
            if tuple(entry.get("shard_range", ())) != (piece.start, piece.end):
                raise ValueError(
                    f"{where}: parameter {opt._names[gidx]!r}: saved shard_range {entry.get('shard_range')} "
                    f"!= expected {(piece.start, piece.end)}"
                )
            run = slice(piece.shard_offset, piece.shard_offset + piece.end - piece.start)
            kinds = [("exp_avg", fg.exp_avg), ("exp_avg_sq", fg.exp_avg_sq)]
            if not fg.master_is_param:
                kinds.append(("master", fg.master))
            for kind, buf in kinds:
                src = entry.get(kind)
                if not isinstance(src, torch.Tensor) or src.shape != (piece.end - piece.start,):
                    raise ValueError(
                        f"{where}: parameter {opt._names[gidx]!r}: {kind!r} must be a tensor of shape "
                        f"{(piece.end - piece.start,)}, got {getattr(src, 'shape', type(src).__name__)}"
                    )
                writes.append((buf[run], src))
    extra = set(sd["state"]) - expected
    if extra:
        raise ValueError(f"{where}: state for parameters {sorted(extra)} that this rank does not own")
    step = theirs.get("step")

    with torch.no_grad():
        for dst, src in writes:
            dst.copy_(src)
        for group, saved in zip(opt.param_groups, sd["param_groups"]):
            for key in _HYPERPARAMETERS:
                if key in saved:
                    group[key] = saved[key]
        if step is not None:
            opt._step_count.copy_(torch.as_tensor(step, dtype=torch.float32))
        if "skipped_steps" in theirs:
            opt._skipped.copy_(torch.as_tensor(theirs["skipped_steps"], dtype=torch.float32))
        # Parameters follow the loaded master: round this rank's slices and gather everyone's.
        pending = []
        for fg in opt._flat_groups:
            for bucket in fg.layout.buckets:
                if not fg.master_is_param:
                    fg.param_slice(bucket).copy_(fg.master_of(bucket))
                pending.append(opt._comm.all_gather(fg.bucket_view(fg.param_buffer, bucket), fg.param_slice(bucket)))
        for p in pending:
            p.wait()
