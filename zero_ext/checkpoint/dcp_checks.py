"""What :func:`zero_ext.checkpoint.set_state_dict` checks before it writes anything: the dicts in torch's layout
against the model and optimizer (every key present and no other, shapes, the optimizer's kind of state, the param
groups), turned into a plan of writes. Every error names the key and what was expected."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..update.protocol import MASTER
from .dcp_chunks import FlatPieces
from .dcp_names import ModelNames
from .local_state_dict import owned_runs

_WHERE = "zero_ext.checkpoint.set_state_dict"


@dataclass
class Plan:
    writes: list = field(default_factory=list)  # (flat group, kind, shard range, fp32 values)
    hyperparameters: list = field(default_factory=list)  # per param group: the saved values to restore
    model_tensors: list = field(default_factory=list)  # (model tensor, value): frozen parameters and buffers
    steps: dict = field(default_factory=dict)  # global index -> the parameter's step count
    step: float = 0.0


def _joined(pieces: list) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """``pieces`` with adjacent runs joined (get_state_dict cuts a run where the memory is: at bucket boundaries),
    so they compare with the runs this rank owns."""
    out: list = []
    for r, v in pieces:
        if out and out[-1][0][1] == r[0]:
            (start, _), parts = out[-1]
            out[-1] = ((start, r[1]), parts + [v])
        else:
            out.append(((r[0], r[1]), [v]))
    return [(r, parts[0] if len(parts) == 1 else torch.cat(parts)) for r, parts in out]


def _flat_values(value: Any, key: str, shape: torch.Size, runs: list) -> list[torch.Tensor]:
    """This rank's runs of ``value`` (this rank's pieces of the global tensor, or the whole tensor)."""
    if isinstance(value, FlatPieces):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{_WHERE}: {key!r} has shape {tuple(value.shape)}, the model's is {tuple(shape)}")
        joined = _joined(value.pieces())
        if [r for r, _ in joined] != [tuple(r) for r, _ in runs]:
            raise ValueError(f"{_WHERE}: {key!r} holds the elements {value.runs} of the flattened tensor, this rank "
                             f"owns {[tuple(r) for r, _ in runs]}: fill a dict from get_state_dict of this model and "
                             "optimizer (dcp.load into it)")  # fmt: skip
        return [v for _, v in joined]
    if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{_WHERE}: {key!r} has shape {tuple(value.shape)}, the model's is {tuple(shape)}")
        if not value.is_floating_point():
            raise ValueError(f"{_WHERE}: {key!r} must be a floating-point tensor, got {value.dtype}")
        flat = value.detach().reshape(-1)
        return [flat[r.start : r.end] for r, _ in runs]
    raise TypeError(f"{_WHERE}: {key!r} must be this rank's pieces from get_state_dict or the whole tensor, got "
                    f"{type(value).__name__}")  # fmt: skip


def _finite_count(value: Any, key: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{_WHERE}: {key!r} must be a step count >= 0, got {value!r}")
    return float(value)


def _model_writes(names: ModelNames, state, owned, msd: Any, plan: Plan) -> None:
    if not isinstance(msd, dict):
        raise TypeError(f"{_WHERE}: `model_state_dict` must be a dict, got {type(msd).__name__}")
    missing, extra = sorted(set(names.tensors) - set(msd)), sorted(set(msd) - set(names.tensors))
    if missing or extra:
        raise ValueError(f"{_WHERE}: the model state dict does not match the model (another model?): keys missing: "
                         f"{missing}; keys the model does not have: {extra}")  # fmt: skip
    members = {id(p): (group, gidx, p) for group, gidx, p in state.members()}
    for key, t in names.tensors.items():
        value = msd[key]
        if id(t) in members:
            group, gidx, p = members[id(t)]
            if key != names.managed[gidx]:
                continue  # a tied weight's other key: the same tensor
            runs = owned.get(gidx, (None, []))[1]
            for (_, shard), values in zip(runs, _flat_values(value, key, p.shape, runs)):
                plan.writes.append((group, MASTER, shard, values))
        else:
            if not isinstance(value, torch.Tensor) or isinstance(value, FlatPieces):
                raise TypeError(f"{_WHERE}: {key!r} must be a tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"{_WHERE}: {key!r} has shape {tuple(value.shape)}, the model's is {tuple(t.shape)}")
            plan.model_tensors.append((t, value.detach()))


def _optim_writes(names: ModelNames, state, owned, osd: Any, optimizer, plan: Plan) -> None:
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or "param_groups" not in osd:
        raise TypeError(f"{_WHERE}: `optim_state_dict` must be {{'state': {{fqn: ...}}, 'param_groups': [...]}}, "
                        f"got {type(osd).__name__} with keys {sorted(osd) if isinstance(osd, dict) else ''}")  # fmt: skip
    saved_state = osd["state"]
    extra = sorted(set(saved_state) - set(names.managed.values()))
    if extra:
        raise ValueError(f"{_WHERE}: optimizer state for parameters the optimizer does not train: {extra}")
    for group, gidx, p in state.members():
        fqn, rule = names.managed[gidx], group.rule
        entry = saved_state.get(fqn)
        if not isinstance(entry, dict):
            raise ValueError(f"{_WHERE}: no optimizer state for parameter {fqn!r} (another model, or a parameter "
                             "frozen when it was saved?)")  # fmt: skip
        want = set(rule.moment_names) | ({"step"} if rule.counts_steps else set())
        if set(entry) != want:
            raise ValueError(
                f"{_WHERE}: the optimizer state of {fqn!r} has {sorted(entry)}, but this optimizer's rule "
                f"{rule.name!r} keeps {sorted(want)} (the state of another optimizer, e.g. SGD's momentum_buffer, or "
                "amsgrad set differently?)"
            )
        plan.steps[gidx] = _finite_count(entry["step"], f"state.{fqn}.step") if "step" in entry else None
        runs = owned.get(gidx, (None, []))[1]
        for kind in rule.moment_names:
            for (_, shard), values in zip(runs, _flat_values(entry[kind], f"state.{fqn}.{kind}", p.shape, runs)):
                plan.writes.append((group, kind, shard, values))
    _groups(names, state, osd["param_groups"], optimizer, plan)
    current = state.step_counts.values()
    counted = [v for v in plan.steps.values() if v is not None]
    plan.step = max(counted) if counted else float(state.step_count.item())
    for gidx in current:
        if plan.steps.get(gidx) is None:  # a rule without a count (Muon): the run's step
            plan.steps[gidx] = plan.step


def _groups(names: ModelNames, state, saved_groups: Any, optimizer, plan: Plan) -> None:
    mine = names.group_names(optimizer.param_groups)
    if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, dict) for g in saved_groups):
        raise TypeError(f"{_WHERE}: `param_groups` must be a list of dicts")
    by_first = {}
    for i, g in enumerate(saved_groups):
        params = g.get("params")
        if not isinstance(params, (list, tuple)) or not all(isinstance(n, str) for n in params):
            raise ValueError(f"{_WHERE}: param_groups[{i}]['params'] must list parameter names, got {params!r}")
        for n in params:
            by_first[n] = i
    ours = {n for fqns in mine for n in fqns}
    extra = sorted(set(by_first) - ours)
    if extra:
        raise ValueError(f"{_WHERE}: the saved param groups list parameters this model does not have (a checkpoint "
                         f"of another model?): {extra[:8]}{' ...' if len(extra) > 8 else ''}")  # fmt: skip
    rules = {g.group_index: g.rule for g in state.groups}
    for gi, fqns in enumerate(mine):
        found = {by_first.get(n) for n in fqns}
        index = next(iter(found)) if len(found) == 1 else None
        if index is None or set(saved_groups[index]["params"]) != set(fqns):
            where = sorted({by_first.get(n, -1) for n in fqns})
            raise ValueError(f"{_WHERE}: param group {gi} ({fqns[:4]}{'...' if len(fqns) > 4 else ''}) is not one "
                             f"saved param group (its parameters are in saved group(s) {where}, -1: none); the saved "
                             f"groups: {[list(g['params'])[:4] for g in saved_groups]}")  # fmt: skip
        saved = saved_groups[index]
        values = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        merged = {**optimizer.param_groups[gi], **values}
        if gi in rules:
            rules[gi].check_group(f"{_WHERE}: saved param group of {fqns[0]!r}", merged, device=state.device)
        plan.hyperparameters.append(values)


def plan_writes(names: ModelNames, state, optimizer, msd: Any, osd: Any) -> Plan:
    plan = Plan()
    owned = owned_runs(state)
    _model_writes(names, state, owned, msd, plan)
    _optim_writes(names, state, owned, osd, optimizer, plan)
    return plan
