"""Hooks that do not keep the optimizer alive.

A hook on a parameter or module holds what it calls. Bound to an engine object it would keep the whole optimizer
(master, moments, grad shard, offload's state files) alive for as long as the model, after the user dropped the
optimizer without ``close()`` (a notebook cell re-run, an hyperparameter sweep), and keep reducing gradients into
it. These hooks hold their owner weakly, do nothing once it is gone, and are removed when it is collected.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_call(method: Callable, *args: Any) -> Callable:
    """``f(*more)`` calling the bound ``method(*args, *more)`` while its object lives; None (no change, as torch's
    hooks read it) after."""
    ref = weakref.WeakMethod(method)

    def call(*more):
        bound = ref()
        return None if bound is None else bound(*args, *more)

    return call


def remove_with(owner: object, handles: list) -> None:
    """Remove the hook ``handles`` (the list, as it is then) when ``owner`` is collected."""
    weakref.finalize(owner, remove_all, handles)


def remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
