"""``get_state_dict(model, opt)`` / ``set_state_dict(model, opt, *, model_state_dict, optim_state_dict)``: a zero_ext
optimizer's state in the layout of ``torch.distributed.checkpoint.state_dict`` (torch's FSDP2 + torch.optim layout),
for ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``.

- The model state dict has every key of ``model.state_dict()``. A trainable parameter's value is its fp32 master
  (bitwise the parameter for fp32 parameters; the exact value behind bf16 parameters and ``param_remainders``), as
  this rank's pieces of the global tensor (:class:`~zero_ext.checkpoint.dcp_chunks.FlatPieces`); a tied weight is the
  same object under each key. Frozen parameters and buffers are plain tensors, the same on every rank (DCP writes
  them once).
- The optimizer state dict is ``{"state": {fqn: {...}}, "param_groups": [...]}`` as torch's: per trainable parameter
  (under its first name) ``step`` (a 0-d fp32 tensor, where the rule counts steps: AdamW, not Muon) and the rule's
  moments under torch.optim's names (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; ``momentum_buffer``), fp32
  (bf16 and int8 moments decoded to their canonical fp32 values), as pieces of the global tensors; ``param_groups``
  with ``params`` as fqns.

Nothing is copied here (``dcp_chunks.py``): where the optimizer keeps a value as fp32 memory, the dict holds a view
of it (as torch's own ``get_state_dict`` does), so ``dcp.save`` costs no memory; take the dicts right before saving
(an ``AppState`` does). ``dcp.async_save`` copies them to host memory once, while it stages, before it returns (into
reused buffers with :class:`~zero_ext.checkpoint.dcp_staging.CachedStager`); values decoded from bf16 / int8 moments,
or read from disk are fresh already and are not copied again. ``dcp.load`` writes into a
copy (made when DCP plans the load) and changes nothing until ``set_state_dict``, which checks every key, shape and
value on every rank, agrees, and only then writes; a failure raises on every rank and leaves the model and optimizer
bitwise as they were.

While ``offload_states()`` has parked the state, ``get_state_dict`` reads the host copies the parking holds
(``dcp_parked.py``: nothing moved back to the device, nothing staged twice), the same values as before the offload;
``set_state_dict`` (and :func:`~zero_ext.checkpoint.load_dcp`) is refused on every rank, naming ``reload_states()``,
and changes nothing: loading would have to write the parked bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.param_sync import params_from_master
from ..engine.sleep import asleep
from ..update.protocol import MASTER
from ..update.registry import rule_name_of
from .agreement import agree, sharded_state_of
from .dcp_checks import plan_writes
from .dcp_chunks import FlatPieces, RunValues
from .dcp_names import ModelNames, torch_param_group
from .dcp_parked import host_mirror
from .format import CheckpointError
from .local_state_dict import owned_runs

_NOT_GROUP_KEYS = ("params", "param_names")


def _settled(optimizer, what: str):
    state = sharded_state_of(optimizer, what)
    sleeping = asleep(state)
    if sleeping is not None:
        raise sleeping.refusal(f"zero_ext.checkpoint.{what}")
    optimizer.finish_sync()
    return state


def _readers(optimizer) -> tuple[Any, dict]:
    """The sharded state, and what reads each flat group's state: the placement itself, or while parked
    (``offload_states()``) its host mirror (nothing in flight then: the offload settled everything)."""
    state = sharded_state_of(optimizer, "get_state_dict")
    sleeping = asleep(state)
    if sleeping is None:
        optimizer.finish_sync()
        return state, {id(g): g.state for g in state.groups}
    return state, {id(g): host_mirror(g.state, sleeping.lot) for g in state.groups}


def _pieces(readers: dict, gidx: int, p: torch.Tensor, kind: str, owned: dict, name: str) -> FlatPieces:
    """This rank's runs of ``kind`` of parameter ``gidx``: views of the state where it keeps them as fp32 memory
    (one per run of memory: a run across two buckets of fp32 parameters is two pieces, never joined into a copy),
    else the fresh values the read made (decoded, read from disk)."""
    ranges, parts = [], []
    if gidx in owned:  # else this rank holds no element of it: no chunk (every rank still has the key)
        ref, runs = owned[gidx]
        reader = readers[id(ref.group)]
        for param_range, shard in runs:  # cut where the memory is (a run across buckets: a view of each bucket's)
            for sub, values in reader.read_runs(kind, shard):
                at = param_range.start + sub.start - shard.start
                ranges.append((at, at + sub.numel))
                parts.append(values.float())
    live = any(t._is_view() for t in parts)  # (a view of a fresh decoded tensor too: copied once more if staged)
    return FlatPieces(p.shape, torch.float32, ranges, RunValues(parts, live), name)


def get_state_dict(model: torch.nn.Module, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optim_state_dict)`` in torch's layout (module docstring). Every rank calls it (no
    communication)."""
    state, readers = _readers(optimizer)
    names = ModelNames(model, state)
    owned = owned_runs(state)
    members = {gidx: p for _, gidx, p in state.members()}
    groups = {gidx: group for group, gidx, _ in state.members()}
    masters = {gidx: _pieces(readers, gidx, p, MASTER, owned, names.managed[gidx]) for gidx, p in members.items()}
    model_sd: dict[str, Any] = {}
    index_of = {id(p): gidx for gidx, p in members.items()}
    for key, t in names.tensors.items():
        gidx = index_of.get(id(t))
        model_sd[key] = masters[gidx] if gidx is not None else t.detach().clone()
    steps = state.step_counts.values()
    optim_state: dict[str, dict[str, Any]] = {}
    for gidx, p in members.items():
        fqn, rule = names.managed[gidx], groups[gidx].rule
        entry: dict[str, Any] = {}
        if rule.counts_steps:
            entry["step"] = torch.tensor(float(steps[gidx]), dtype=torch.float32)
        for kind in rule.moment_names:
            entry[kind] = _pieces(readers, gidx, p, kind, owned, fqn)
        optim_state[fqn] = entry
    param_groups = []
    rules = {group.group_index: group.rule.name for group in state.groups}
    for gi, (g, fqns) in enumerate(zip(optimizer.param_groups, names.group_names(optimizer.param_groups))):
        rule = rules.get(gi) or rule_name_of(g, state.default_rule)
        saved = torch_param_group(rule, {k: v for k, v in g.items() if k not in _NOT_GROUP_KEYS}, optimizer.defaults)
        saved["params"] = fqns
        param_groups.append(saved)
    ordered = {}
    for fqns in names.group_names(optimizer.param_groups):  # torch's order: param group by param group
        ordered.update({f: optim_state[f] for f in fqns if f in optim_state})
    return model_sd, {"state": ordered, "param_groups": param_groups}


def set_state_dict(
    model: torch.nn.Module, optimizer, *, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any]
) -> None:
    """Collective: load dicts in torch's layout (from :func:`get_state_dict` filled by ``dcp.load``, or full
    tensors) into the model and optimizer. Checks everything first on every rank; an error is raised on every rank
    and changes nothing."""
    state = sharded_state_of(optimizer, "set_state_dict")
    plan, error = None, None
    try:
        state = _settled(optimizer, "set_state_dict")
        plan = plan_writes(ModelNames(model, state), state, optimizer, model_state_dict, optim_state_dict)
    except (ValueError, TypeError, KeyError, RuntimeError, CheckpointError) as e:
        error = e if isinstance(e, (CheckpointError, RuntimeError)) else CheckpointError(str(e))
    agree(state.comm, error, "zero_ext.checkpoint.set_state_dict")
    with torch.no_grad():
        for group, kind, shard_range, values in plan.writes:
            group.state.write(kind, shard_range, values)
        for group, values in zip(optimizer.param_groups, plan.hyperparameters):
            for key, value in values.items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].fill_(value.item())
                else:
                    group[key] = value
        for t, value in plan.model_tensors:
            t.copy_(value)
        state.step_counts.load(plan.steps)
        state.step_count.fill_(plan.step)
    params_from_master(state)
