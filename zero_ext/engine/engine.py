"""The engine: one object around a rank's sharded state that reduces gradients, updates and brings parameters back.

It is built once, from the sharded state and the frozen :class:`~zero_ext.engine.config.EngineConfig` (the stage
object among it), and owns everything in flight: every bucket's runtime and the staging pool
(:class:`~zero_ext.engine.runtime.BucketRuntimes`), the gradient sync (:mod:`.reducer`, with the stage's gradient
strategy), the parameter sync (stages 1-2: :mod:`.param_sync`; stage 3: :mod:`.param_gather`) and the step
(:mod:`.step`). ``ZeroAdamW`` holds one engine for its whole life and delegates to it; ``add_param_group`` extends
it in place (:meth:`Engine.extend`): each part gains what the added flat groups need and keeps what it holds, so
nothing is copied from one object to another.
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
        self.grad_sync = GradSync(state, self.runtimes, strategy, self.stage)
        self.param_sync = self.stage.param_sync(state, self.runtimes, self.grad_sync, config)
        self.stepper = Stepper(state, self.grad_sync, self.param_sync, config.max_grad_norm)

    def defer_gathers(self) -> None:
        """``defer_all_gather_to``: the last all-gathers are waited for by the model's next forward (stages 1, 2)."""
        if self.config.defer_all_gather_to is not None:
            self.param_sync.defer_to(self.config.defer_all_gather_to)

    def extend(self, added: Sequence[FlatGroup], names: dict[int, str]) -> None:
        """The flat groups ``added`` (``add_param_group``; ``names``: their parameters') join this engine, in place: the
        sharded state, every bucket's runtime and the staging pool, the gradient sync (hooks on the new parameters,
        the strategy's and the placeholders' share of them), the parameter sync (``defer_all_gather_to``'s waits,
        stage 3's gathers) and the step each gain what the new groups need. Everything they hold stays as it is:
        gradients not yet applied, ``no_sync()``, a clipping owed to the next step, stage 3's learned order, peak and
        window. Nothing may be in flight (the caller finished every sync)."""
        self.state.add_groups(added, names)
        self.runtimes.extend(self.state)
        self.grad_sync.extend(added, self.runtimes)
        self.param_sync.extend(added)
        self.stepper.extend()
        self.stage.after_build(added)
