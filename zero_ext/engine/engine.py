"""The engine: one object around a rank's sharded state that reduces gradients, updates and brings parameters back.

It is built once, from the sharded state and the frozen :class:`~zero_ext.engine.config.EngineConfig` (the stage
object among it), and owns everything in flight: every bucket's runtime and the staging pool
(:class:`~zero_ext.engine.runtime.BucketRuntimes`), the gradient sync (:mod:`.reducer`, with the stage's gradient
strategy), the parameter sync (stages 1-2: :mod:`.param_sync`; stage 3: :mod:`.param_gather`) and the step
(:mod:`.step`). ``ZeroAdamW`` holds one engine for its whole life and delegates to it; ``add_param_group`` extends
it in place (:meth:`Engine.extend`): each part gains what the added flat groups need and keeps what it holds, so
nothing is copied from one object to another.

The facade asks the engine through the verbs below (:meth:`Engine.settle`, :meth:`Engine.finish_sync`,
:meth:`Engine.step`, :meth:`Engine.no_sync`, :meth:`Engine.close`, ...), never through its parts: each verb says what it
does for the optimizer, and how (which part holds what) stays the engine's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from ..comm.divergence import DivergenceWatch
from ..state.sharded_state import FlatGroup, ShardedState
from .bucket_runtime import StagingPool
from .config import EngineConfig
from .full_params import named_full_params
from .param_sync import write_back
from .reducer import GradSync
from .runtime import BucketRuntimes
from .sleep import ASLEEP
from .step import Stepper


class Engine:
    """``state``: the sharded state (data); ``runtimes``, ``grad_sync``, ``param_sync``, ``stepper``: what moves it."""

    def __init__(self, config: EngineConfig, state: ShardedState):
        if config.collective_timeout is not None and state.comm.communicates:  # (first: before any collective)
            state.comm.watch = DivergenceWatch(state.comm, config.collective_timeout)
        self.config, self.state, self.stage = config, state, config.strategy
        self.stepped = False  # a step() has applied an update (grad_norm reads it)
        self.closed = False
        strategy = self.stage.grads(state, config)
        self.runtimes = BucketRuntimes(state, config.staging_buffers, strategy)
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

    # ---------------------------------------------------------------- life: attached to the model, then closed
    def attach(self) -> None:
        """The built flat groups' stage work (before the first forward), then the hooks on the model (``module=``) and
        ``defer_all_gather_to``'s waits: from here on the engine reduces every gradient the model produces."""
        self.stage.after_build(self.state.groups)
        if self.state.model is not None:
            self.state.model.install()
        self.defer_gathers()

    def close(self) -> None:
        """Detach from the model, once: every communication in flight finished, every hook on the parameters and the
        model removed (``.grad`` placeholders first), ``offload="nvme"``'s state files deleted (a checkpoint is the
        durable copy). A second call does nothing. Nothing may be offloaded (the caller reloads first)."""
        if self.closed:
            return
        self.finish_sync()
        self.grad_sync.placeholders.drop()
        self.grad_sync.remove_hooks()
        self.param_sync.remove_hooks()
        if self.state.model is not None:
            self.state.model.remove_hooks()
        for group in self.state.groups:
            group.state.close()
        self.closed = True

    # ---------------------------------------------------------------- syncs
    def settle(self) -> None:
        """The current stream waits for every parameter all-gather still in flight (no host wait on CUDA)."""
        self.param_sync.settle()

    def finish_sync(self) -> None:
        """Every gradient reduction and parameter gather in flight finished; at stages 1 and 2 the fp32 master then
        follows parameters changed in place since the last step."""
        self.param_sync.settle()
        self.grad_sync.finish_grad_sync()
        if self.state.param_edits is not None:
            self.state.param_edits.adopt(checked=False)

    @property
    def sync_enabled(self) -> bool:
        """Whether a backward reduces its gradients now (False inside :meth:`no_sync`)."""
        return self.grad_sync.sync_enabled

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate without reducing (stage 1) or reduce inside the node only (a 2-D mesh)."""
        previous = self.grad_sync.sync_enabled
        self.grad_sync.sync_enabled = False
        held = self.state.comm.hold_replicas(True)
        try:
            yield
        finally:
            self.grad_sync.sync_enabled = previous
            self.state.comm.hold_replicas(held)

    @contextlib.contextmanager
    def gathered(self, modifier_rank: Optional[int]) -> Iterator[None]:
        """Every parameter whole inside (stage 3 gathers them all); with ``modifier_rank``, on exit that rank's values
        become every rank's, shards and fp32 master included (collective). The caller finished every sync."""
        with self.stage.gathered(self.param_sync):
            yield
            if modifier_rank is not None:
                write_back(self.state, modifier_rank)

    def busy(self) -> Optional[str]:
        """Why the flat groups cannot change now (``add_param_group`` inside forward at stage 3), or None."""
        return self.stage.busy(self.runtimes)

    # ---------------------------------------------------------------- the step
    def step(self, param_groups: list[dict]) -> bool:
        """One update of every flat group from the reduced gradients (collective; every rank fails together), the
        all-gathers waited for unless deferred to the next forward. Returns whether an update was applied."""
        self.param_sync.settle()
        stepped = self.stepper.step(param_groups)
        if stepped:
            self.stepped = True
            if not self.param_sync.deferred:
                self.param_sync.settle()
        return stepped

    def clip_grad_norm_(self, param_groups: list[dict], max_norm: float) -> torch.Tensor:
        """The global gradient norm (0-d, on the device); the next step scales the gradients to ``max_norm``."""
        self.param_sync.settle()
        return self.stepper.clip_grad_norm_(param_groups, max_norm)

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The last step's global gradient norm before clipping (None before the first update)."""
        return self.stepper.grad_norm if self.stepped else None

    def zero_grad(self, set_to_none: bool) -> None:
        self.grad_sync.zero_grad(set_to_none)

    # ---------------------------------------------------------------- reads
    def refuse_if_asleep(self, what: str) -> None:
        """Raise, naming ``what`` and ``reload_states()``, while ``offload_states()`` holds some state in host memory."""
        sleeping = ASLEEP.get(self.state)  # (the common case asks sleep.py nothing)
        if sleeping is not None:
            raise sleeping.refusal(what)

    def refuse_step_if_asleep(self, what: str, is_step: bool) -> None:
        """``step()`` / ``clip_grad_norm_()`` (``what``) while ``offload_states()`` holds some state in host memory:
        every rank raises (the step's agreement carries this rank's failure, ``Sleep.refuse_step``)."""
        sleeping = ASLEEP.get(self.state)
        if sleeping is not None:
            sleeping.refuse_step(what, is_step=is_step)

    @property
    def staging(self) -> StagingPool:
        """The gradient staging pool (the memory report counts its buffers)."""
        return self.runtimes.staging

    def gather_window(self):
        """Stage 3's gathered-storage window that the memory report bounds, or None below stage 3."""
        return self.stage.window(self.param_sync)

    def named_full_params(self, module: Optional[torch.nn.Module], buffers: bool):
        """Every parameter whole, streamed bucket by bucket (:mod:`.full_params`)."""
        return named_full_params(self, module, buffers)
