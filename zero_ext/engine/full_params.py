"""``opt.named_full_params()``: every parameter whole, by name, streamed bucket by bucket: what an inference engine's
``model.load_weights(...)`` (vLLM, SGLang) takes after a training step.

Names are the model's ``state_dict`` keys (``module=`` at construction, or the ``module`` argument): a tied weight is
yielded once under each of its keys, in a row, as ``state_dict`` lists it; without a model, the names the optimizer
was given (``named_parameters()``), one each. Parameters the optimizer does not hold (frozen ones) come from the model
as they are, after the optimizer's; ``buffers=True`` adds the persistent buffers, so that the whole ``state_dict``
streams (``load_state_dict(strict=True)`` wants them).

Stages 1 and 2: each parameter is its view of the flat param buffer (no copy; read it, do not write it, as a
``state_dict`` tensor), or, while the states are offloaded, the same view of its host copy (valid until the next
``offload_states()``). Stage 3, **collective** (every rank iterates to the end): per run of buckets (one bucket, or
the buckets of one split parameter) a fresh buffer, this rank's slice of each bucket written into it (its shard, or
its master rounded to the parameter's dtype: the values a gather gives the model) and all-gathered in place; the
run's parameters are yielded as views of it, and the buffer is dropped before the next run: at most one run
gathered beyond the tensors the caller still holds. It reads the shards wherever they are (host copies while
offloaded) and touches neither the model's parameters nor the gather schedule: training is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..state.sharded_state import FlatGroup, ShardedState
from ..update.adamw import MASTER
from .model_state import ModelState
from .sleep import asleep


def _names_of(state: ShardedState, module: Optional[torch.nn.Module]):
    """(id(tensor) -> its names, the model's state or None) for the optimizer's parameters."""
    model = ModelState(module) if module is not None else state.model
    if model is None:
        return {id(p): [state.names[gidx]] for _, gidx, p in state.members()}, None
    names = {}
    for _, gidx, p in state.members():
        keys = model.keys_of.get(id(p))
        if keys is None:
            raise ValueError(
                f"{state.optimizer_name}.named_full_params: parameter {state.names[gidx]!r} is not in `module` (pass the "
                "model whose parameters this optimizer trains)"
            )
        names[id(p)] = keys
    return names, model


def _where(state: ShardedState, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a buffer of the optimizer), or its host copy while it is offloaded (asked at each use: the caller may
    offload or reload between two items)."""
    sleeping = asleep(state)
    return sleeping.lot.host_view(t) if sleeping is not None else t


@contextlib.contextmanager
def _shard_at(fp, base: torch.Tensor):
    """``fp.rank_slice`` sliced out of ``base`` (the shard's host copy while it is offloaded: no view of a parked
    storage can be made), by the storage's own slicing (a mesh's chunks, ``ChunkedParams``, lay it out otherwise)."""
    kept, fp.shard = fp.shard, base
    try:
        yield
    finally:
        fp.shard = kept


def named_full_params(engine, module=None, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The iterator over ``engine``'s parameters (see the module docstring)."""
    state: ShardedState = engine.state
    names, model = _names_of(state, module)
    if asleep(state) is None:
        engine.param_sync.settle()  # (stages 1-2, defer_all_gather_to: the last gathers finish first)
    for group in state.groups:
        if group.flat_params.shards_params:
            yield from _gathered(state, group, names)
        else:
            for i, p in enumerate(group.params):
                buffer = _where(state, group.flat_params.buffer)
                view = group.layout.slots[i].param_range.of(buffer).view(p.shape)
                for key in names[id(p)]:
                    yield key, view
    held = {id(p) for _, _, p in state.members()}
    if model is not None:
        for name, t in model.unmanaged(held).items():
            if isinstance(t, torch.nn.Parameter) or buffers:
                for key in model.keys_of[id(t)]:
                    yield key, t.detach()
    else:
        for name, p in state.frozen:
            yield name, p.detach()


def _gathered(state: ShardedState, group: FlatGroup, names) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage 3: ``group``'s parameters, one run of buckets gathered at a time (collective)."""
    layout, rank, comm = group.layout, state.rank, state.comm
    fp = group.flat_params
    for run in layout.runs:
        comm.position.at("named_full_params")
        with torch._C.DisableTorchFunctionSubclass():
            buf = torch.empty(run.numel, dtype=group.dtype, device=group.device)
            for b in run.buckets:
                bucket = layout.buckets[b]
                full = bucket.bucket_range.shifted(-run.offset).of(buf)
                mine = bucket.rank_range(rank).shifted(-bucket.offset).of(full)
                # this rank's slice of its kept shard (or mesh chunk), or of the fp32 master a gather rounds (to
                # nearest even) when none is kept
                if fp.shard is not None:
                    with _shard_at(fp, _where(state, fp.shard)):
                        source = fp.rank_slice(bucket)
                else:
                    source = bucket.shard_range.of(_where(state, group.state.buffers[MASTER]))
                mine.copy_(source)
                comm.start_all_gather(full, mine).wait()
            views = [(group.params[i], run.slot_range(layout.slots[i]).of(buf)) for i in run.slots]
        del buf  # the views hold it while the caller does
        while views:
            p, flat = views.pop(0)
            view = flat.view(p.shape)
            del flat
            for key in names[id(p)]:
                yield key, view
            del view
