"""The ZeRO stage, chosen once: one object answers every question whose answer depends on the stage, so no layer
branches on ``stage == 3``.

=========  ==========================  ================================  =======================================
stage      gradients                   parameters                        parameter communication
=========  ==========================  ================================  =======================================
1          a persistent flat buffer    full on every rank                all-gather after each bucket's update
           (``.grad`` views into it)   (``state.params.FullParams``)     (``engine.param_sync.ParamSync``)
2          staged per bucket, kept     full on every rank                the same
           only in the fp32 shard
3          as stage 2                  only this rank's shard            gathered just before a module uses
                                       (``state.sharded_params``)        them, released after
                                                                         (``engine.param_gather.ParamGather``)
=========  ==========================  ================================  =======================================
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from ..placement.offload import placement_class
from ..state.params import FullParams
from ..state.sharded_params import ShardedParams
from ..state.sharded_state import FlatGroup, ShardedState
from ..update.adamw import MASTER
from .bucket_runtime import ParamState
from .grads import BufferedGrads, Fp32GradBuffer, GradStrategy, ShardGrads, StagedGrads
from .param_gather import ParamGather
from .param_sync import ParamSync
from .reducer import GradSync
from .runtime import BucketRuntimes


class Stage:
    """What differs between the stages. ``number``: 1, 2 or 3 (a label: saved in checkpoints, named in messages; no
    layer branches on it); ``params_storage``: where a flat group's parameters live (the builder makes one per flat
    group). The layers below ask the questions here instead of comparing stage numbers."""

    number: int
    params_storage: type = FullParams
    # A persistent flat gradient buffer that ``.grad`` views, kept across ``step()`` until ``zero_grad()`` as torch
    # keeps ``.grad`` (stage 1); else the gradients live only in the fp32 grad shard, which ``step()`` consumes.
    keeps_full_grads = False
    # Every rank holds the full parameters between steps, which a user may change in place; the fp32 master follows
    # such changes (``state.param_edits``). Not at stage 3, whose parameters are shards outside forward.
    tracks_param_edits = True
    # Only this rank's shard of the parameters lives between uses: the model's hooks gather them (so ``module=`` is
    # needed and ``defer_all_gather_to`` has nothing to defer), and a meta-device model materialises shard by shard.
    shards_params = False

    def grad_buffer_dtype(self, grad_accum_dtype: Optional[torch.dtype], param_dtype: torch.dtype):
        """The dtype of a flat group's persistent gradient buffer, or None: only stage 1 keeps one."""
        return None

    def grads(self, state: ShardedState, config) -> GradStrategy:
        """The gradient policy (how a gradient gets from autograd to the wire, which each bucket calls); chosen from
        the configuration (``config``: the engine's EngineConfig), so it holds for flat groups added later too."""
        direct = not state.comm.communicates and placement_class(config.offload).adds_in_place_on(
            state.device, state.world_size
        )
        return (ShardGrads if direct else StagedGrads)(state, config.reduce_dtype)

    def param_sync(self, state: ShardedState, runtimes: BucketRuntimes, grad_sync: GradSync, config):
        """What brings the updated parameters back to every rank (``config``: the engine's EngineConfig)."""
        return ParamSync(state, runtimes)

    def gathered(self, param_sync):
        """A context with every parameter whole (``gathered_params()``): they always are below stage 3."""
        return contextlib.nullcontext()

    def window(self, param_sync):
        """The gathered-storage window the memory report bounds (stage 3's scheduler), or None."""
        return None

    def busy(self, runtimes: BucketRuntimes) -> Optional[str]:
        """Why ``add_param_group`` cannot run now, or None."""
        return None

    def after_build(self, groups: Sequence[FlatGroup]) -> None:
        """Flat groups just built (at construction or by ``add_param_group``), before the first forward."""


class Stage1(Stage):
    number = 1
    keeps_full_grads = True

    def grad_buffer_dtype(self, grad_accum_dtype, param_dtype):
        """``.grad``'s storage: the parameters' dtype, or fp32 with ``grad_accum_dtype=torch.float32``."""
        return torch.float32 if grad_accum_dtype == torch.float32 else param_dtype

    def grads(self, state, config) -> GradStrategy:
        buffered = Fp32GradBuffer if config.grad_accum_dtype == torch.float32 else BufferedGrads
        return buffered(state, config.reduce_dtype)


class Stage2(Stage):
    number = 2


class Stage3(Stage):
    number = 3
    params_storage = ShardedParams
    tracks_param_edits = False
    shards_params = True

    def param_sync(self, state, runtimes, grad_sync, config):
        gather = ParamGather(
            state,
            runtimes,
            config.module,
            config.reshard_after_forward,
            config.prefetch,
            config.gather_units,
            config.name,
        )
        grad_sync.on_ready = gather.bucket_ready
        grad_sync.on_round_end = gather.backward_done
        return gather

    def gathered(self, param_sync):
        return param_sync.gathered()

    def window(self, param_sync):
        return param_sync

    def busy(self, runtimes):
        if any(rt.params is not ParamState.SHARDED for rt in runtimes.values()):
            return (
                "called while parameters are gathered (inside forward, backward or gathered_params()); call it "
                "between steps"
            )
        return None

    def after_build(self, groups) -> None:
        """The parameter shards are cast from the fp32 master where it is on the device."""
        for group in groups:
            if group.state.master_copy and group.state.resident:
                group.flat_params.cast_from(lambda bucket, g=group: g.state.read(MASTER, bucket.shard_range))


STAGES = {s.number: s for s in (Stage1(), Stage2(), Stage3())}


def stage_for(number: int) -> Stage:
    """The stage object of ``stage=number`` (checked by the options before: 1, 2 or 3)."""
    return STAGES[number]
