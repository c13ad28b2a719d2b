"""torch.optim's state-dict hooks around ZeroAdamW's own ``state_dict()`` / ``load_state_dict()``, run as
``torch.optim.Optimizer`` runs them (torch/optim/optimizer.py): ``register_state_dict_pre_hook`` hooks get the
optimizer before the dict is made; ``register_state_dict_post_hook`` hooks get (optimizer, dict) and may change it in
place or return a replacement; ``register_load_state_dict_pre_hook`` hooks get (optimizer, a shallow copy of the
dict given) and may return a replacement, which is loaded; ``register_load_state_dict_post_hook`` hooks get the
optimizer after loading. Each kind runs in registration order, ``prepend=True`` first (torch keeps them in ordered
dicts; registration is torch's own method, inherited unchanged).

Loading is collective: a pre hook that raises on some ranks only is folded into the load's agreement (``load``
receives the error), so every rank fails, nothing changed, instead of the others waiting in a collective. Post hooks
run after the last collective of the load. zero_ext.checkpoint.save / load write and read files, not a state dict:
they run none of these hooks."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def hooked_state_dict(optimizer: torch.optim.Optimizer, make: Callable[[], dict]) -> Any:
    """``make()``'s dict with the optimizer's state-dict pre hooks run before it and post hooks after it."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = make()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def hooked_load_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: Any, load: Callable[[Any, Optional[BaseException]], None]
) -> None:
    """``load(dict, error)`` (collective) on what the load pre hooks make of a shallow copy of ``state_dict``, then
    the load post hooks. ``error``: what a pre hook raised on this rank (None if nothing), for ``load`` to agree on
    and raise."""
    error: Optional[BaseException] = None
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()  # shallow, as torch (and nn.Module) do: a hook may edit it freely
    try:
        for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(optimizer, state_dict)
            if result is not None:
                state_dict = result
    except Exception as e:  # noqa: BLE001 - raised after the other ranks learn of it
        error = e
    load(state_dict, error)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)
