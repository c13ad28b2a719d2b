"""Stage 3's gather units: the modules whose forward hooks gather (and release) parameters, each for the parameters of
its whole subtree.

A unit's forward runs with every parameter of its subtree gathered and no hook inside it, so ``torch.compile`` traces
it as one graph: dynamo breaks the graph where a hook runs (the hooks gather through collectives and keep host-side
bookkeeping, so they are ``torch.compiler.disable``d, as FSDP2's are), that is once per unit, in the frame that calls
it. With a hook on every module that owns parameters (``"modules"``), a GPT of 2 blocks broke 24 times and
``nn.Linear.forward``, met with a different width at each break, hit dynamo's recompile limit (8), after which most
of the model ran eagerly.

``"auto"`` (the default) makes each element of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` that has
parameters a unit (the outermost such: a transformer's blocks, not the Linear layers inside them; an element that is
itself a ``ModuleList`` or ``ModuleDict``, never called, is looked into: nanoGPT's ``transformer.h``), as FSDP2 users
``fully_shard`` each block; every other module that owns parameters (embeddings, the final norm, the head) and the
model itself are units of their own parameters, gathered only while they run. A tuple of module classes makes their
instances the units instead (the outermost; DeepSpeed calls them ZeRO-3 leaf modules); ``"modules"`` makes every
module owning parameters a unit (the finest window: at most one module's parameters gathered beyond the
prefetched ones; torch.compile then compiles module by module). The gathers themselves are per bucket: a unit gathers
every bucket holding one of its parameters, so with the default bucket size (the model in 4 or 8 buckets) the window
is set by the buckets far more than by the units.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch.nn as nn

Units = Union[str, tuple]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_UNCALLED = (nn.ModuleList, nn.ModuleDict)  # containers without a forward of their own


def check_gather_units(gather_units, where: str = "zero_ext.ZeroAdamW") -> None:
    if gather_units in ("auto", "modules"):
        return
    classes = tuple(gather_units) if isinstance(gather_units, (tuple, list)) else None
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return
    raise ValueError(
        f"{where}: `gather_units` must be 'auto', 'modules' or a tuple of nn.Module classes (their instances are "
        f"gathered as one unit), got {gather_units!r}"
    )


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def unit_roots(model: nn.Module, gather_units: Units) -> set[int]:
    """ids of the modules that gather their whole subtree's parameters (none with ``"modules"``)."""
    if gather_units == "modules":
        return set()
    roots: set[int] = set()

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if gather_units == "auto":
                # a ModuleList or ModuleDict inside a container (nanoGPT's ``transformer.h``) has no forward: code
                # iterates it, so a hook on it would never run; its elements are the units
                chosen = isinstance(m, _CONTAINERS) and _has_params(child) and not isinstance(child, _UNCALLED)
            else:
                chosen = isinstance(child, tuple(gather_units)) and _has_params(child)
            if chosen and child is not model:
                roots.add(id(child))
            else:
                walk(child)

    walk(model)
    return roots


def hooked_modules(model: nn.Module, gather_units: Units) -> list[tuple[nn.Module, list[nn.Module]]]:
    """``(module that gets the hooks, the modules whose own parameters it gathers)``: the model itself first (its own
    parameters), every unit (its subtree), then every other module that owns parameters and is in no unit."""
    roots = unit_roots(model, gather_units)
    out: list[tuple[nn.Module, list[nn.Module]]] = []
    inside: set[int] = set()
    for m in model.modules():  # (each module once, parents before children)
        if id(m) in inside:
            continue
        if id(m) in roots:
            members = list(m.modules())
            inside.update(id(x) for x in members)
            out.append((m, members))
        elif m is model or next(m.parameters(recurse=False), None) is not None:
            out.append((m, [m]))
    return out


def own_params(members: Iterable[nn.Module]):
    for m in members:
        yield from m.parameters(recurse=False)
