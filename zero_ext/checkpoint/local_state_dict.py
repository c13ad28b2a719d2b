"""A rank's shard as a torch.optim-style state dict.

``state`` maps a parameter's index (its position across all param groups, as in torch.optim) to the part of its
state this rank owns: every kind of its group's update rule under the rule's name for it (torch.optim.AdamW's names
for the moments) and, for bf16/fp16 params, the fp32 ``master``, each a 1-D tensor
holding elements ``shard_range = (start, end)`` of the flattened parameter, plus ``step``. A parameter split across
buckets (``layout.py``) of which this rank owns several runs that are not adjacent has ``shard_ranges``, the list
of them in order, instead, and its tensors hold those runs one after the other. Parameters this rank
owns no element of have no entry. fp32 params are their own master, with or without offload (load the model's
state dict with the optimizer's; an offloaded optimizer takes its master from the parameters), so a state dict
saved with any ``offload`` loads into an optimizer with any other. ``param_groups`` are torch's (hyperparameters
and parameter indices); ``zero`` records the layout so that loading into a different one fails clearly. Resharding to another world size is
``zero_ext.checkpoint``'s job.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence

import torch

from ..engine.param_sync import params_from_master
from ..layout import PARAM_ALIGN, Range
from ..state.sharded_state import ShardedState
from ..update.protocol import MASTER
from ..update.registry import DEFAULT_RULE

# A saved param group replaces the optimizer's, as in torch.optim.Optimizer.load_state_dict: every key but
# ``params`` (a deep copy; ``amsgrad`` and the rule must match, they decide the kinds kept), ``param_names`` only when
# the saved group has them (a dict saved without names leaves the optimizer's). A key the saved group lacks (one
# added since, e.g. ``decoupled_weight_decay``) keeps the optimizer's value, as torch's __setstate__ defaults do.
_NOT_RESTORED = ("params",)
_WHERE = "{name}.load_state_dict"  # name: the optimizer's (ShardedState.optimizer_name)
_CHECKPOINT_HINT = (
    "Save with zero_ext.checkpoint.save(path, opt) and resume with zero_ext.checkpoint.load(path, opt), on every rank "
    "(any world size; the model's state included with module=)"
)


def _layout_record(state: ShardedState) -> dict[str, Any]:
    return {
        "world_size": state.world_size,
        "rank": state.rank,
        "stage": state.stage,
        "bucket_size": state.bucket_size,
        "numels": [list(g.layout.numels) for g in state.groups],
        # 64 for a group with int8 moments (whole quantization blocks per parameter), else 16: part of the layout
        "param_align": [g.layout.param_align for g in state.groups],
        "rules": [g.rule.name for g in state.groups],  # each flat group's update rule (older dicts: AdamW's)
    }


def owned_runs(state: ShardedState) -> dict[int, tuple[Any, list[tuple[Range, Range]]]]:
    """Each parameter this rank owns elements of, by its index: its first piece's ref and its runs,
    ``(param_range, shard_range)`` in order, adjacent pieces (a split parameter's on one rank) merged into one run."""
    out: dict[int, tuple[Any, list[tuple[Range, Range]]]] = {}
    for ref in state.pieces():
        piece = ref.piece
        if ref.param_index not in out:
            out[ref.param_index] = (ref, [])
        runs = out[ref.param_index][1]
        if runs and runs[-1][0].end == piece.start and runs[-1][1].end == piece.shard_range.start:
            runs[-1] = (Range(runs[-1][0].start, piece.end), Range(runs[-1][1].start, piece.shard_range.end))
        else:
            runs.append((piece.param_range, piece.shard_range))
    return out


def ranges_record(runs: list[tuple[Range, Range]]) -> dict[str, Any]:
    """The entry naming the elements of the flattened parameter a piece holds: ``shard_range`` (start, end), or
    ``shard_ranges``, a list of them, for runs that are not adjacent."""
    if len(runs) == 1:
        return {"shard_range": tuple(runs[0][0])}
    return {"shard_ranges": [tuple(r) for r, _ in runs]}


def read_piece(ref, runs: list[tuple[Range, Range]], kind: str) -> torch.Tensor:
    """This rank's piece of one kind of a parameter's state: fp32 values (decoded from the placement's encoding),
    a new tensor holding the runs one after the other."""
    parts = [ref.group.state.read(kind, shard) for _, shard in runs]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def local_state_dict(state: ShardedState, param_groups: Sequence[dict]) -> dict[str, Any]:
    step = state.step_count.detach().to("cpu", copy=True)
    steps = state.step_counts.values()  # each parameter's own count, as torch keeps it
    out: dict[int, dict[str, Any]] = {}
    for gidx, (ref, runs) in owned_runs(state).items():
        own_step = torch.tensor(steps[gidx], dtype=torch.float32)
        entry: dict[str, Any] = {"step": own_step, **ranges_record(runs)}
        # fp32 parameters are their own master in every placement (an offloaded copy equals them after each step):
        # the model's state dict holds them, so the state dict is the same with and without offload.
        for kind in ref.group.rule.state_dict_names():
            entry[kind] = read_piece(ref, runs, kind)
        out[gidx] = entry
    groups, base = [], 0
    for g in param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = list(range(base, base + len(g["params"])))
        base += len(g["params"])
        groups.append(saved)
    zero = _layout_record(state)
    zero["step"] = step
    # every parameter's own count (every rank tracks them all), those this rank owns nothing of too: after
    # add_param_group the counts differ between groups, and a later checkpoint saves rank 0's
    zero["param_steps"] = steps
    zero["skipped_steps"] = state.skipped.detach().to("cpu", copy=True)
    return {"state": out, "param_groups": groups, "zero": zero}


def _validate(state: ShardedState, param_groups: Sequence[dict], sd: Any) -> list:
    """Every check a local state dict must pass; returns the (group, kind, range, values) writes to apply."""
    where = _WHERE.format(name=state.optimizer_name)
    if not isinstance(sd, dict):
        raise ValueError(f"{where}: `state_dict` must be a dict, got {type(sd).__name__}")
    for key in ("state", "param_groups", "zero"):
        if key not in sd:
            raise ValueError(f"{where}: `state_dict` has no {key!r} entry (not a state dict of this optimizer?)")
    mine, theirs = _layout_record(state), sd["zero"]
    if isinstance(sd["param_groups"], list) and len(sd["param_groups"]) != len(param_groups):
        raise ValueError(
            f"{where}: saved {len(sd['param_groups'])} param groups, this optimizer has {len(param_groups)}; a group "
            "added with opt.add_param_group is added again (on every rank, in the same order) before loading"
        )
    for key, value in mine.items():
        if key == "param_align" and theirs.get(key, [PARAM_ALIGN] * len(value)) != value:  # older dicts: 16
            raise ValueError(
                f"{where}: saved with parameters aligned to {theirs.get(key, [PARAM_ALIGN] * len(value))} elements "
                f"per flat group, this optimizer aligns them to {value}: moment_dtype=torch.int8 places parameters "
                "at multiples of 64 elements (whole quantization blocks), the other settings at multiples of 16, so "
                "the shards differ and a local state dict cannot cross to or from int8 moments. Save and load with "
                "zero_ext.checkpoint instead: it converts between every precision setting and world size"
            )
        if key == "rules" and theirs.get(key, [DEFAULT_RULE] * len(value)) != value:
            raise ValueError(
                f"{where}: saved by the update rules {theirs.get(key, [DEFAULT_RULE] * len(value))} (one per flat "
                f"group), this optimizer's are {value}: a rule's state does not carry over to another"
            )
        if key in ("param_align", "rules"):
            continue
        if key == "rank" and theirs.get(key) != value and theirs.get("world_size") == state.world_size:
            raise ValueError(
                f"{where}: saved by rank {theirs.get(key)!r}, loaded on rank {value}: a state dict from "
                f"opt.state_dict() holds its own rank's shard only (one saved by rank 0 alone, `if master_process: "
                f"torch.save(opt.state_dict(), ...)`, lacks the other ranks'). {_CHECKPOINT_HINT}"
            )
        if theirs.get(key) != value:
            raise ValueError(
                f"{where}: saved {key}={theirs.get(key)!r} but this optimizer has {key}={value!r}; a local state "
                "dict only loads into the same rank of the same layout (use zero_ext.checkpoint to change world size)"
            )
    rules = {g.group_index: g.rule for g in state.groups}
    for gi, (group, saved) in enumerate(zip(param_groups, sd["param_groups"])):
        merged = {**group, **_restored(saved)}
        if gi in rules:
            rules[gi].check_group(f"{where}: saved param group {gi}", merged, device=state.device)
    writes, expected = [], set()
    for gidx, (ref, runs) in owned_runs(state).items():
        expected.add(gidx)
        entry = sd["state"].get(gidx)
        if entry is None:
            raise ValueError(f"{where}: no state for parameter {ref.name!r} (index {gidx})")
        want = ranges_record(runs)
        ((key, value),) = want.items()
        saved = entry.get(key)
        if saved is None or [tuple(r) for r in (saved if key == "shard_ranges" else [saved])] != (
            value if key == "shard_ranges" else [value]
        ):
            raise ValueError(f"{where}: parameter {ref.name!r}: saved {key} {saved} != expected {value}")
        numel = sum(r.numel for r, _ in runs)
        kinds = ref.group.rule.state_dict_names()
        if MASTER not in kinds and entry.get(MASTER) is not None:
            # fp32, from an offloaded optimizer of an earlier commit, whose state dict carried a copy of the
            # parameters: loaded, and the parameters follow it, as bf16 parameters follow their master
            kinds += (MASTER,)
        for kind in kinds:
            src = entry.get(kind)
            if not isinstance(src, torch.Tensor) or src.shape != (numel,) or not src.is_floating_point():
                got = getattr(src, "shape", type(src).__name__)
                raise ValueError(f"{where}: parameter {ref.name!r}: {kind!r} must be a float tensor of shape "
                                 f"{(numel,)}, got {got}")  # fmt: skip
            at = 0
            for r, shard in runs:
                writes.append((ref.group, kind, shard, src[at : at + r.numel]))
                at += r.numel
        own = entry.get("step")
        if own is not None and not _is_count(own):
            raise ValueError(f"{where}: parameter {ref.name!r}: `step` must be a whole number >= 0, got {own!r}")
    extra = set(sd["state"]) - expected
    if extra:
        raise ValueError(f"{where}: state for parameters {sorted(extra)} that this rank does not own")
    counts = theirs.get("param_steps")
    if counts is not None and not (isinstance(counts, dict) and all(_is_count(v) for v in counts.values())):
        raise ValueError(f"{where}: `zero.param_steps` must map parameter indices to whole numbers >= 0")
    for key in ("step", "skipped_steps"):
        value = theirs.get(key)
        if value is not None and not _is_count(value):
            raise ValueError(f"{where}: `zero.{key}` must be a whole number >= 0, got {value!r}")
    return writes


def _restored(saved: dict) -> dict:
    return {k: v for k, v in saved.items() if k not in _NOT_RESTORED}


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        value = value.item()
    # counts live in fp32 device scalars: a value beyond float32's range could not be loaded
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and 0 <= value <= 3.4028234663852886e38 and value == int(value)


def load_local_state_dict(
    state: ShardedState, param_groups: Sequence[dict], sd: Any, failed: Optional[BaseException] = None
) -> None:
    """Collective: validate on every rank, agree, then write (a failure anywhere changes nothing anywhere).
    ``failed``: an error this rank met before (a load_state_dict pre hook's), raised after the agreement, so that
    the other ranks fail too instead of waiting."""
    where = _WHERE.format(name=state.optimizer_name)
    error, writes = failed, []
    try:
        if failed is None:
            writes = _validate(state, param_groups, sd)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        error = e if isinstance(e, ValueError) else ValueError(f"{where}: malformed state dict ({e!r})")
    failed = [r for r, f in enumerate(state.comm.agree(int(error is not None))) if f]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{where}: the state dict failed to load on rank(s) {failed} (see their errors); "
                         f"nothing was changed on any rank. {_CHECKPOINT_HINT}")  # fmt: skip
    theirs = sd["zero"]
    with torch.no_grad():
        for group in state.groups:
            if group.rule.master_is_param and group.state.master_copy:
                group.state.reset_master()  # an offloaded fp32 master follows the parameters (a saved one overrides)
        for group, kind, shard_range, src in writes:
            group.state.write(kind, shard_range, src)
        for group, saved in zip(param_groups, sd["param_groups"]):
            group.update(copy.deepcopy(_restored(saved)))
        if theirs.get("step") is not None:
            state.step_count.copy_(torch.as_tensor(theirs["step"], dtype=torch.float32).reshape(()))
        # Each parameter's own count: from its entry where this rank owns some of it, else from `param_steps` (every
        # parameter's), else (a dict of an earlier zero_ext) the global step: a parameter this rank owns nothing of
        # is never updated here, but rank 0's counts go into checkpoints.
        default = float(torch.as_tensor(theirs.get("step", 0)).reshape(()).item())
        steps = dict.fromkeys(state.step_counts.indices, default)
        for gidx, value in (theirs.get("param_steps") or {}).items():
            if gidx in steps:
                steps[gidx] = float(value)
        for gidx, entry in sd["state"].items():
            if entry.get("step") is not None:
                steps[gidx] = float(torch.as_tensor(entry["step"]).reshape(()).item())
        state.step_counts.load(steps)
        if theirs.get("skipped_steps") is not None:
            state.skipped.copy_(torch.as_tensor(theirs["skipped_steps"], dtype=torch.float32).reshape(()))
    params_from_master(state)
