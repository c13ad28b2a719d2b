"""The engine: one object around a rank's sharded state that reduces gradients, updates and brings parameters back.

It is built from the sharded state and the frozen :class:`~zero_ext.engine.config.EngineConfig` (the stage object
among it), and owns everything in flight: every bucket's runtime and the staging pool
(:class:`~zero_ext.engine.runtime.BucketRuntimes`), the gradient sync (:mod:`.reducer`, with the stage's gradient
strategy), the parameter sync (stages 1-2: :mod:`.param_sync`; stage 3: :mod:`.param_gather`) and the step
(:mod:`.step`). ``ZeroAdamW`` holds one engine and delegates to it; ``add_param_group`` replaces it by
:meth:`Engine.extended`, an engine around the old and new flat groups that carries on what the old one held
(gradients not yet applied, ``no_sync``, clipping state, stage 3's peak), so nothing in flight is lost.
"""

from __future__ import annotations

from typing import Sequence

from ..state.sharded_state import FlatGroup, ShardedState
from .config import EngineConfig
from .reducer import GradSync
from .runtime import BucketRuntimes
from .step import Stepper


class Engine:
    """``state``: the sharded state (data); ``runtimes``, ``grad_sync``, ``param_sync``, ``stepper``: what moves it."""

    def __init__(self, config: EngineConfig, state: ShardedState):
        self.config, self.state, self.stage = config, state, config.strategy
        self.runtimes = BucketRuntimes(state, config.staging_buffers)
        strategy = self.stage.grads(state, self.runtimes.staging, config)
        self.grad_sync = GradSync(state, self.runtimes, strategy)
        self.param_sync = self.stage.param_sync(state, self.runtimes, self.grad_sync, config)
        self.stepper = Stepper(state, self.grad_sync, self.param_sync, config.max_grad_norm)

    def defer_gathers(self) -> None:
        """``defer_all_gather_to``: the last all-gathers are waited for by the model's next forward (stages 1, 2)."""
        if self.config.defer_all_gather_to is not None:
            self.param_sync.defer_to(self.config.defer_all_gather_to)

    def extended(self, added: Sequence[FlatGroup], names: dict[int, str]) -> "Engine":
        """This engine with the flat groups ``added`` (``add_param_group``; ``names``: their parameters'): its hooks
        removed, a new engine around the old and new flat groups carrying on its gradients, ``no_sync`` state, step
        and clipping state. Nothing may be in flight (the caller finished every sync)."""
        self.grad_sync.placeholders.settle(defer=False)  # clipping recorded on .grad applied; .grad real again
        self.grad_sync.remove_hooks()
        self.stage.retire(self.param_sync)
        new = Engine(self.config, self.state.with_groups(added, names))
        new.grad_sync.strategy.keep_grads(self.grad_sync.strategy)
        new.grad_sync.sync_enabled = self.grad_sync.sync_enabled  # (inside no_sync())
        new.stepper.take_over(self.stepper)
        self.stage.carry_over(self.param_sync, new.param_sync)
        self.stage.after_build(added)
        new.defer_gathers()
        return new
