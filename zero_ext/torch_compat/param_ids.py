"""State-dict parameter ids as torch.optim.Optimizer.state_dict makes them: by identity, not position. Each
parameter's id is its position across all param groups, except that a parameter already numbered in an earlier group
keeps that number (a param group listed twice gives its parameters the same ids twice) and, within one group, a
parameter listed twice takes its last position (torch's dict comprehension). zero_ext's local state dict
(:mod:`zero_ext.checkpoint.local_state_dict`) keys its state by position; this module turns positions into torch's
ids when saving and torch's ids back into positions when loading (torch's ``id_map``: the saved groups' ids zipped
with the optimizer's parameters)."""

from __future__ import annotations

from itertools import chain
from typing import Any, Sequence


def torch_ids(param_groups: Sequence[dict]) -> list[list[int]]:
    """Every group's parameter ids, as torch's ``pack_group`` numbers them."""
    mapping: dict[int, int] = {}
    start, out = 0, []
    for group in param_groups:
        mapping.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in mapping})
        out.append([mapping[id(p)] for p in group["params"]])
        start += len(group["params"])
    return out


def _first_positions(param_groups: Sequence[dict]) -> tuple[list, dict[int, int]]:
    params = list(chain.from_iterable(g["params"] for g in param_groups))
    first: dict[int, int] = {}
    for position, p in enumerate(params):
        first.setdefault(id(p), position)
    return params, first


def to_torch_ids(state_dict: dict, param_groups: Sequence[dict]) -> dict:
    """A local state dict (state keyed by position) with torch's ids in its groups and state."""
    ids = torch_ids(param_groups)
    by_position = {position: torch_id for position, torch_id in enumerate(chain.from_iterable(ids))}
    for group, group_ids in zip(state_dict["param_groups"], ids):
        group["params"] = list(group_ids)
    state_dict["state"] = {by_position.get(k, k): v for k, v in state_dict["state"].items()}
    return state_dict


def to_positions(state_dict: Any, param_groups: Sequence[dict]) -> Any:
    """A state dict keyed by torch's ids (saved by any optimizer whose groups match in size) keyed by this
    optimizer's positions again, the form :func:`zero_ext.checkpoint.local_state_dict.load_local_state_dict` checks.
    Anything it cannot map (not a dict, groups of other sizes, an unknown id) is left for that check to report."""
    try:
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        state = state_dict["state"]
        sizes_match = len(state_dict["param_groups"]) == len(param_groups) and all(
            len(s["params"]) == len(g["params"]) for s, g in zip(state_dict["param_groups"], param_groups)
        )
    except (TypeError, KeyError, AttributeError):
        return state_dict
    if not sizes_match or not isinstance(state, dict):
        return state_dict
    params, first = _first_positions(param_groups)
    id_map = {saved: first[id(p)] for saved, p in zip(saved_ids, params)}
    if set(id_map) == set(range(len(params))) and all(k == v for k, v in id_map.items()):
        return state_dict  # the usual case: ids are positions
    unknown = {k: v for k, v in state.items() if k not in id_map}
    if unknown:
        return state_dict  # reported as state for parameters this rank does not own
    return {**state_dict, "state": {id_map[k]: v for k, v in state.items()}}


def split_user_state(state_dict: Any) -> tuple[Any, dict]:
    """``(state_dict without them, the entries of its "state" whose key is no saved parameter's id)``: what
    torch.optim's load_state_dict copies into ``opt.state`` as it is ("state that is not assigned to params"). A dict
    this cannot read is returned whole, with no such entries, for the load's checks to report."""
    try:
        saved_ids = set(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        state = state_dict["state"]
        user = {k: v for k, v in state.items() if k not in saved_ids}
    except (TypeError, KeyError, AttributeError):
        return state_dict, {}
    if not user:
        return state_dict, {}
    return {**state_dict, "state": {k: v for k, v in state.items() if k in saved_ids}}, user
