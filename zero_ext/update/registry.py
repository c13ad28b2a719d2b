"""Update rules by name: the one place the engine, the state dict and checkpoints find a rule.

``register(name, factory, saved_kinds=...)`` makes a rule available; ``factory(param_dtype, group, options)``
builds the rule of one flat group: ``param_dtype`` its parameters' dtype, ``group`` its param group (or a
checkpoint's recorded hyperparameters, decoded or not), ``options`` the optimizer's :class:`RuleOptions`; it
raises ``ValueError`` for an option it does not support. ``saved_kinds``: every kind the rule may save, so that a
checkpoint's sections can be checked before any rule is built. AdamW registers itself as ``"adamw"``
(:mod:`.adamw`); a rule written elsewhere registers itself the same way, before the optimizer is built or a
checkpoint naming it is read.

A param group picks its rule with the key ``"rule"`` (a registered name); without it, the optimizer's default
(``ZeroAdamW``: ``"adamw"``). Checkpoints record the name per param group (older ones, without it, read as
``"adamw"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch

from .protocol import UpdateRule

RULE_KEY = "rule"  # the param-group key that names a group's rule
DEFAULT_RULE = "adamw"  # the rule of a group that names none (ZeroAdamW's) and of checkpoints that record none


@dataclass(frozen=True)
class RuleOptions:
    """The optimizer's options a rule may take (AdamW's precision options; a rule refuses those it lacks)."""

    param_remainders: bool = False
    moment_dtype: torch.dtype = torch.float32
    group_index: int = 0  # the param group's position (AdamW seeds its stochastic rounding with it)


Factory = Callable[[torch.dtype, Mapping[str, Any], RuleOptions], UpdateRule]


class _Entry(NamedTuple):
    factory: Factory
    saved_kinds: tuple[str, ...]


_RULES: dict[str, _Entry] = {}


def register(name: str, factory: Factory, saved_kinds: Iterable[str]) -> None:
    """Make ``factory`` the rule called ``name`` (registering a name again replaces it: a test or notebook may
    re-run its registration)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"zero_ext.update.registry.register: `name` must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ValueError(f"zero_ext.update.registry.register: `factory` of {name!r} must be callable")
    _RULES[name] = _Entry(factory, tuple(saved_kinds))


def registered() -> tuple[str, ...]:
    return tuple(_RULES)


def factory_named(name: Any, where: str = "zero_ext") -> Factory:
    """The factory registered as ``name``; a ValueError naming the registered ones otherwise."""
    entry = _RULES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(
            f"{where}: no update rule named {name!r} is registered (registered: {sorted(_RULES)}); register it with "
            "zero_ext.update.registry.register(name, factory, saved_kinds) before building the optimizer or reading "
            "a checkpoint that uses it"
        )
    return entry.factory


def rule_named(name: str, param_dtype: torch.dtype = torch.bfloat16, group: Mapping[str, Any] = {},
               options: RuleOptions = RuleOptions(), where: str = "zero_ext") -> UpdateRule:  # fmt: skip
    """The rule registered as ``name`` for a flat group of ``param_dtype`` parameters of param group ``group``."""
    return factory_named(name, where)(param_dtype, group, options)


def rule_name_of(group: Mapping[str, Any], default: str = DEFAULT_RULE) -> Any:
    """The name of the rule param group ``group`` asks for (its ``"rule"``, else ``default``)."""
    return group.get(RULE_KEY, default)


def rule_for_group(param_dtype: torch.dtype, group: Mapping[str, Any], param_remainders: bool = False,
                   moment_dtype: torch.dtype = torch.float32, group_index: int = 0,
                   default: str = DEFAULT_RULE) -> UpdateRule:  # fmt: skip
    """The rule a flat group of ``param_dtype`` parameters of param group ``group`` (``group_index``: its position)
    keeps; ``param_remainders`` and ``moment_dtype``: the optimizer's options (a ValueError naming them unless
    the rule takes them)."""
    where = f"zero_ext: param group {group_index}"
    options = RuleOptions(param_remainders, moment_dtype, group_index)
    return rule_named(rule_name_of(group, default), param_dtype, group, options, where)


def rule_for_saved_group(saved_group: Mapping[str, Any], param_dtype: torch.dtype = torch.bfloat16) -> UpdateRule:
    """The rule a checkpoint's param group (its ``meta.json`` record: ``rule`` and ``hyperparameters``) was saved
    with; a record without ``rule`` (older checkpoints) is AdamW's."""
    name = saved_group.get(RULE_KEY, DEFAULT_RULE)
    return rule_named(name, param_dtype, saved_group.get("hyperparameters", {}), where="zero_ext.checkpoint")


def all_kind_names() -> tuple[str, ...]:
    """Every kind any registered rule may save (a checkpoint section must be one of these, or the parameters)."""
    return tuple(dict.fromkeys(k for entry in _RULES.values() for k in entry.saved_kinds))


__all__ = [
    "RULE_KEY", "DEFAULT_RULE", "RuleOptions", "register", "registered", "factory_named", "rule_named",
    "rule_name_of", "rule_for_group", "rule_for_saved_group", "all_kind_names",
]  # fmt: skip
