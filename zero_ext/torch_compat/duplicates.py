"""A parameter listed twice in one param group: torch.optim warns (``add_param_group``: "in future, this will cause an
error") and keeps both entries, so its AdamW updates that parameter once per entry in every ``step()``. ZeroAdamW
warns the same words, as torch's own tests expect, and keeps one entry: a flat buffer holds each parameter once, and
applying one gradient twice per step is what torch's warning calls a mistake. (The same parameter in two groups
raises, as in torch.)"""

from __future__ import annotations

import warnings
from typing import Any

import torch

# torch/optim/optimizer.py, Optimizer.add_param_group (torch 2.13), word for word
DUPLICATE_WARNING = (
    "optimizer contains a parameter group with duplicate parameters; in future, this will cause an error; "
    "see github.com/pytorch/pytorch/issues/40967 for more information"
)


def _tensor(entry: Any) -> Any:
    return entry[1] if isinstance(entry, tuple) else entry


def warn_duplicates(params: list, stacklevel: int) -> None:
    """torch's warning when ``params`` (tensors or ``(name, tensor)`` pairs) lists a tensor twice."""
    tensors = [_tensor(p) for p in params]
    if len({id(t) for t in tensors}) != len(tensors):
        warnings.warn(DUPLICATE_WARNING, UserWarning, stacklevel=stacklevel + 1)


def drop_duplicates(group: dict[str, Any]) -> None:
    """Keep the first entry of each parameter in the normalised torch param group ``group`` (its ``params`` and,
    with names, ``param_names``), in place."""
    seen: set[int] = set()
    keep = []
    for i, p in enumerate(group["params"]):
        if id(p) not in seen:
            seen.add(id(p))
            keep.append(i)
    if len(keep) == len(group["params"]):
        return
    group["params"] = [group["params"][i] for i in keep]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][i] for i in keep]


def dedupe_new_group(param_group: Any, stacklevel: int) -> None:
    """``add_param_group``'s argument: torch's warning for a tensor listed twice, then its first entry kept (tensors
    or ``(name, tensor)`` pairs; a generator is read once). Anything malformed is left for the group's own checks."""
    if not isinstance(param_group, dict) or "params" not in param_group or isinstance(param_group["params"], set):
        return
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    warn_duplicates(params, stacklevel + 1)
    seen: set[int] = set()
    param_group["params"] = [p for p in params if not (id(_tensor(p)) in seen or seen.add(id(_tensor(p))))]
