"""The names torch.distributed.checkpoint.state_dict gives a model's tensors, for a zero_ext optimizer's state.

torch keys the model state dict by ``model.state_dict()``'s keys (a tied weight under each of its keys) and the
optimizer state by each parameter's first name in ``model.named_parameters()`` (a tied weight once), with
``param_groups[i]["params"]`` listing those names. :class:`ModelNames` answers both from the model alone (the
optimizer's own names may be generic when it was given ``model.parameters()``).
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch

from ..state.sharded_state import FlatGroup, ShardedState


class ModelNames:
    def __init__(self, model: torch.nn.Module, state: ShardedState):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zero_ext.checkpoint: `model` must be a torch.nn.Module, got {type(model).__name__}")
        self.keys_of: dict[int, list[str]] = {}  # id(tensor) -> its state_dict keys, first name first
        self.tensors: dict[str, torch.Tensor] = {}  # every state_dict key -> its tensor
        for key, t in model.state_dict(keep_vars=True).items():
            self.keys_of.setdefault(id(t), []).append(key)
            self.tensors[key] = t
        managed = {}
        for _, gidx, p in state.members():
            keys = self.keys_of.get(id(p))
            if not keys:
                raise ValueError(
                    f"zero_ext.checkpoint: the optimizer's parameter {state.names.get(gidx, gidx)!r} is not a "
                    "parameter of `model` (pass the model whose parameters the optimizer updates)"
                )
            managed[gidx] = keys[0]
        self.managed: dict[int, str] = managed  # global index -> fqn, trainable (sharded) parameters
        self.managed_ids = {id(p) for _, _, p in state.members()}

    def fqn_of(self, p: torch.Tensor) -> str:
        keys = self.keys_of.get(id(p))
        if not keys:
            raise ValueError("zero_ext.checkpoint: a parameter of the optimizer's param groups is not in `model`")
        return keys[0]

    def unmanaged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every state_dict key whose tensor the optimizer does not shard (frozen parameters, buffers)."""
        for key, t in self.tensors.items():
            if id(t) not in self.managed_ids:
                yield key, t

    def group_names(self, param_groups) -> list[list[str]]:
        """Each param group's parameters as fqns (frozen ones given to the optimizer too, as torch lists them)."""
        return [[self.fqn_of(p) for p in g["params"]] for g in param_groups]


def owned_groups(state: ShardedState) -> dict[int, FlatGroup]:
    """Global index -> its flat group, for every trainable parameter."""
    return {gidx: group for group, gidx, _ in state.members()}


# The torch.optim class whose param groups a rule's groups mirror (DCP flattens a param group key by key: both sides
# must have the same keys for a checkpoint to load across).
_TORCH_OPTIMIZER = {"adamw": "AdamW", "muon": "Muon"}
_INTERNAL_KEYS = ("use_muon", "rule", "params", "param_names")


@functools.lru_cache(maxsize=None)
def _torch_group(rule_name: str) -> dict | None:
    cls = getattr(torch.optim, _TORCH_OPTIMIZER.get(rule_name, ""), None)
    if cls is None:
        return None
    group = cls([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def torch_param_group(rule_name: str, group: dict, own_keys) -> dict:
    """``group`` (a zero_ext param group, without ``params``) with exactly the keys torch's optimizer for the rule
    has (values from the group, torch's defaults where the group has none), plus the keys the user added (e.g. a
    scheduler's ``initial_lr``); the keys only zero_ext knows (``own_keys``: the optimizer's defaults, e.g. Muon's
    hyperparameters in an AdamW group of ZeroMuon, and ``use_muon``) are left out."""
    torch_group = _torch_group(rule_name)
    if torch_group is None:  # a rule registered outside: its group as it is
        return {k: v for k, v in group.items() if k not in _INTERNAL_KEYS}
    out = {k: group.get(k, default) for k, default in torch_group.items()}
    skip = set(own_keys) | set(_INTERNAL_KEYS)
    out.update({k: v for k, v in group.items() if k not in torch_group and k not in skip})
    return out
