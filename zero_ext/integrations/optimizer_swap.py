"""What every trainer integration does to take ``DDP(model)`` + ``torch.optim.AdamW`` over: build the ZeroAdamW that
replaces a framework's AdamW (same groups, same hyperparameters), point its LR scheduler at it, refuse moving a model
whose parameters live in ZeroAdamW's flat buffers, and route clipping to the optimizer. Shared by the transformers,
Lightning and accelerate integrations; imports none of those frameworks."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Iterable, Optional

import torch

from ..optimizer import ZeroAdamW

# ZeroAdamW keywords a trainer decides: the hyperparameters (from the framework's optimizer), stage and clipping (the
# framework's own settings), the model, the data-parallel group (the world, which the framework's data loader is
# sharded over), and parameters read outside forward (no deferred all-gather).
TRAINER_OWNED = frozenset({"params", "lr", "betas", "eps", "weight_decay", "stage", "module", "max_grad_norm",
                           "process_group", "communicator", "defer_all_gather_to"})  # fmt: skip
# Keys of a torch.optim.AdamW param group ZeroAdamW takes as they are (its hyperparameters and torch's selectors);
# `decoupled_weight_decay` is always True in AdamW's groups and ZeroAdamW sets it itself.
_ADAMW_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                     "differentiable", "fused")  # fmt: skip


def check_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    """``options`` (further ZeroAdamW keywords) without any the trainer owns; a copy."""
    owned = sorted(set(options) & TRAINER_OWNED)
    if owned:
        raise ValueError(
            f"{where}: ZeroAdamW options may not set {owned}: the hyperparameters come from the framework's "
            "optimizer, clipping from its own setting, the stage from `stage`, the model and the (world) process "
            "group from the framework"
        )
    return dict(options)


def zero_adamw_like(optimizer: torch.optim.Optimizer, *, module: torch.nn.Module, stage: int,
                    options: dict[str, Any], where: str) -> ZeroAdamW:  # fmt: skip
    """A ZeroAdamW over ``optimizer``'s param groups with their hyperparameters (and any other keys the groups
    carry, e.g. a scheduler's ``initial_lr``), built with ``module=`` the model. ``optimizer`` must be a plain
    ``torch.optim.AdamW`` that has not stepped yet (its state would be lost); anything else is refused."""
    if type(optimizer) is not torch.optim.AdamW:
        raise TypeError(
            f"{where}: the optimizer must be a torch.optim.AdamW (turned into a zero_ext.ZeroAdamW with the same "
            f"groups and hyperparameters) or a zero_ext.ZeroAdamW / ZeroMuon; got {type(optimizer).__qualname__}"
        )
    if len(optimizer.state) > 0:
        raise ValueError(f"{where}: the torch.optim.AdamW has already stepped; its state would be lost. Hand it over "
                         "before training")  # fmt: skip
    if any(g.get("decoupled_weight_decay", True) is False for g in optimizer.param_groups):
        raise ValueError(f"{where}: a group has decoupled_weight_decay=False (Adam's L2 decay); ZeroAdamW is AdamW")
    owned = {id(p) for p in module.parameters()}
    groups = []
    for g in optimizer.param_groups:
        params = list(g["params"])
        if any(id(p) not in owned for p in params):
            raise ValueError(f"{where}: the optimizer holds parameters that are not the model's")
        groups.append(
            {k: v for k, v in g.items() if k not in ("params", "decoupled_weight_decay")} | {"params": params}
        )
    zero = ZeroAdamW(groups, stage=stage, module=module, **options)
    # Keys ZeroAdamW's groups do not carry (a scheduler's `initial_lr`, a user's own) go on as they were.
    for mine, theirs in zip(zero.param_groups, optimizer.param_groups):
        for k, v in theirs.items():
            if k not in ("params", "decoupled_weight_decay") and k not in mine:
                mine[k] = v
    return zero


def retarget_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make an LR scheduler built on ``old`` drive ``new`` (a scheduler writes ``optimizer.param_groups[i]["lr"]``).
    torch's schedulers wrap ``optimizer.step`` at construction to warn when ``scheduler.step()`` comes first (a
    closure of theirs, which cannot be re-applied): ``new.step`` gets the same marks, so the warning means what it
    means with torch's AdamW."""
    if getattr(scheduler, "optimizer", None) is not old:
        return
    scheduler.optimizer = new
    if not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        @functools.wraps(step)
        def step_marked(*args, **kwargs):
            new._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        step_marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = step_marked  # type: ignore[method-assign]


def on_device(model: torch.nn.Module, device) -> bool:
    """Every parameter and buffer of ``model`` already on ``device`` (on CPU the index means nothing)."""
    device = torch.device(device)
    for t in itertools.chain(model.parameters(), model.buffers()):
        d = t.device
        if d.type != device.type or (d.type != "cpu" and device.index is not None and d.index != device.index):
            return False
    return True


def check_all_trainable(parameters: Iterable[torch.Tensor], opt: ZeroAdamW, where: str) -> None:
    """ZeroAdamW clips all its parameters together: clipping a subset through it would clip everything."""
    given = {id(p) for p in parameters if p.requires_grad}
    managed = {id(p) for g in opt.param_groups for p in g["params"]}
    if given != managed:
        raise ValueError(
            f"{where}: clip_grad_norm_ was given other parameters than the optimizer's; ZeroAdamW clips the global "
            "norm of all its parameters at once (opt.clip_grad_norm_(max_norm))"
        )


def innermost_zero(optimizer: Optional[Any]) -> Optional[ZeroAdamW]:
    """The ZeroAdamW under a framework's optimizer wrappers (accelerate's, Lightning's), or None."""
    while optimizer is not None and not isinstance(optimizer, ZeroAdamW):
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    return optimizer


def unavailable_names(module: str, names: tuple[str, ...], why: tuple[str, Optional[BaseException]]):
    """A module ``__getattr__`` for an integration whose framework is missing (or too old): the module imports, and
    taking one of ``names`` from it raises ImportError with ``why``'s message (the pip extra to install)."""

    def __getattr__(name: str):
        if name in names:
            raise ImportError(why[0]) from why[1]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
