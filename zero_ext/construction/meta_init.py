"""Stage 3 on a model built on the ``meta`` device: only this rank's shard is ever materialised.

``ZeroAdamW(model.named_parameters(), stage=3, module=model, param_init=init)`` with ``model`` built under
``torch.device("meta")``: the optimizer allocates the shards on ``param_device`` and then, module by module in
``model.modules()`` order, gathers the buffers of the buckets the module's parameters live in (uninitialised),
materialises the module's own frozen parameters and buffers (which are never sharded), calls ``init(module)``
(which must initialise the module's own parameters and buffers in place, as ``reset_parameters()`` does) and, once
every module with parameters in a bucket is done, keeps this rank's slice of it and frees the rest. At most the
buckets of the modules being initialised plus the bucket that holds the model's small parameters are ever whole.

Every rank must draw the same values: seed torch's generator identically on every rank before building the
optimizer. A parameter shared by two modules (a tied weight) keeps the value the last of them initialised.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..state.sharded_state import ShardedState


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _materialise_own(module: torch.nn.Module, managed: set[int], device: torch.device) -> None:
    """The module's own frozen parameters and buffers on ``device`` (uninitialised): they are not sharded."""
    for name, p in module.named_parameters(recurse=False):
        if id(p) not in managed and p.is_meta:
            p.data = torch.empty_like(p, device=device)
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)


@torch.no_grad()
def initialise_shards(state: ShardedState, module: torch.nn.Module, init: Callable, device: torch.device) -> None:
    """Run ``init`` on every module of ``module``, materialising only this rank's shard of the parameters."""
    where, managed = {}, set()
    for group in state.groups:
        for slot, p in zip(group.layout.slots, group.params):
            where[id(p)] = (group, group.layout.runs[group.layout.run_of[slot.bucket]])
            managed.add(id(p))
    modules = list(module.modules())
    users: dict[tuple, int] = {}  # (group index, run index) -> modules still to initialise that use it
    keys_of = []
    for m in modules:
        keys = {(where[id(p)][0].index, where[id(p)][1].index): where[id(p)] for p in m.parameters(recurse=False)
                if id(p) in where}  # fmt: skip
        keys_of.append(keys)
        for key in keys:
            users[key] = users.get(key, 0) + 1
    open_runs: dict[tuple, torch.Tensor] = {}
    # Scratch buffers for the open runs (a bucket, or the buckets of one split parameter), reused by size: a fresh
    # one per run would leave the freed ones scattered over the heap (measured: +25 MiB of VmData at 2 ranks on a
    # 27M-parameter GPT, over its limit in test_stage3's meta test). The runs' own gathered storages are made at
    # their first gather in training.
    spare: dict[tuple, list[torch.Tensor]] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for m, keys in zip(modules, keys_of):
            for key, (group, run) in keys.items():
                if key not in open_runs:
                    size = (run.numel, group.dtype)
                    free = spare.get(size)
                    buf = free.pop() if free else torch.empty(run.numel, dtype=group.dtype, device=group.device)
                    group.flat_params.view_into(run, buf.zero_())
                    open_runs[key] = buf
            _materialise_own(m, managed, device)
            init(m)
            for key, (group, run) in keys.items():
                users[key] -= 1
                if users[key] == 0:
                    buf = open_runs.pop(key)
                    group.flat_params.fill_shard(run, buf)
                    group.flat_params.forget(run)
                    spare.setdefault((run.numel, group.dtype), []).append(buf)
    leftover = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"{state.optimizer_name}: still on the meta device after param_init: {leftover[:5]}")
    for group in state.groups:  # the fp32 master follows the initialised parameters
        group.state.reset_master()
