"""``ZeroStrategy``: PyTorch Lightning training with :class:`zero_ext.ZeroAdamW` in place of ``DDP(model)`` + the
LightningModule's AdamW (``pip install "zero_ext[lightning]"``). Lightning's own DDP example with one line changed:

    from zero_ext.integrations.lightning import ZeroStrategy
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), accelerator="gpu", devices=4)   # was strategy="ddp"

What happens to each of Lightning's habits (the anchors are its DeepSpeedStrategy and FSDPStrategy):

- *The optimizer*: ``configure_optimizers`` returns a plain ``torch.optim.AdamW`` (with or without LR schedulers):
  the strategy builds one ZeroAdamW (``module=`` the LightningModule, ``stage=``) over the same param groups with
  the same hyperparameters, and points the schedulers at it. Or it returns a ZeroAdamW / ZeroMuon it built itself
  (``module=self``, the strategy's stage). Any other optimizer, or several, is refused.
- *Wrapping*: none (the optimizer reduces the gradients); launching, the process group, the distributed sampler,
  ``reduce`` / ``barrier`` / ``broadcast`` are Lightning's DDP strategy's.
- *Clipping* (``gradient_clip_val``, norm algorithm): the optimizer's :meth:`~zero_ext.ZeroAdamW.clip_grad_norm_`,
  the global norm of the mean gradients, applied in the step (Lightning's precision plugins would call torch's
  function, and ``bf16-mixed``'s refuses any optimizer that handles a GradScaler itself, as ZeroAdamW declares).
  ``gradient_clip_algorithm="value"`` is refused.
- *Accumulation* (``accumulate_grad_batches``): Lightning's ``block_backward_sync`` is the optimizer's
  :meth:`~zero_ext.ZeroAdamW.no_sync` instead of ``DDP.no_sync``.
- *Checkpoints* (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``): a checkpoint is a
  directory, as DeepSpeedStrategy's: ``lightning.ckpt`` (rank 0: Lightning's checkpoint dict with the full weights,
  loops, schedulers, callbacks; no optimizer state) and ``zero_ext/`` (every rank's optimizer shards through
  :func:`zero_ext.checkpoint.save`). ``fit(ckpt_path=dir)`` resumes at any number of devices and stage.
- *Set-up and teardown*: Lightning's ``Strategy.setup``, ``load_optimizer_state_dict`` and ``teardown`` move the
  optimizer state between devices by writing into ``optimizer.state[p]``; ZeroAdamW's ``opt.state`` is a read-only
  view of its shards, which live where ZeroAdamW placed them, so this strategy never calls that code. Teardown does
  not move the model to the CPU either (``lightning_module.cpu()``): its parameters live in ZeroAdamW's flat buffers,
  a stage-3 model holds only shards, and the optimizer stays usable after ``fit()`` (``trainer.validate``,
  ``predict``, ``save_checkpoint``).
- *Stage 3* (parameters sharded between forwards): validation, test and prediction loops run inside one
  ``opt.gathered_params()`` on every rank (each forward local, no collective: ranks may run different numbers of
  batches, nothing hangs), as ``ZeroTrainer`` does; a checkpoint's weights are gathered too (collective, as
  Lightning calls ``save_checkpoint`` on every rank). Outside Lightning's loops read the model inside
  ``with trainer.strategy.zero_optimizer.gathered_params():``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

from .. import checkpoint
from ..optimizer import ZeroAdamW
from .optimizer_swap import (
    check_options,
    innermost_zero,
    on_device,
    retarget_scheduler,
    unavailable_names,
    zero_adamw_like,
)

_UNAVAILABLE: Optional[tuple[str, Optional[BaseException]]] = None
try:
    from lightning.pytorch.overrides.distributed import _sync_module_states
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:
    DDPStrategy = object  # type: ignore[assignment,misc]
    _UNAVAILABLE = ('zero_ext.integrations.lightning needs PyTorch Lightning: pip install "zero_ext[lightning]"', e)

__all__ = ["ZeroStrategy", "LIGHTNING_FILE", "ZERO_CHECKPOINT"]

LIGHTNING_FILE = "lightning.ckpt"  # Lightning's checkpoint dict inside a checkpoint directory (rank 0 writes it)
ZERO_CHECKPOINT = "zero_ext"  # the optimizer shards inside a checkpoint directory
_EXTRA_FORMAT = "zero_ext.integrations.lightning/1"
_WHERE = "zero_ext ZeroStrategy"


class ZeroStrategy(DDPStrategy):
    """Lightning's DDP strategy without the DDP wrapper, training with :class:`zero_ext.ZeroAdamW` (see the module
    docstring for each Lightning habit).

    Args:
        stage: 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
            timeout, start_method: ``DDPStrategy``'s.
        **zero_options: further ZeroAdamW keywords (``bucket_size``, ``reduce_dtype``, ``offload``, at stage 3
            ``reshard_after_forward``, ``prefetch``, ...). The hyperparameters come from ``configure_optimizers``,
            clipping from ``gradient_clip_val``, the model and the (world) process group from Lightning.
    """

    def __init__(self, stage: int = 2, *, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout=None, start_method: str = "popen", **zero_options: Any):  # fmt: skip
        if stage not in (1, 2, 3):
            raise ValueError(f"{_WHERE}: `stage` must be 1, 2 or 3, got {stage!r}")
        self.stage = stage
        self.zero_options = check_options(zero_options, _WHERE)
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **kwargs)  # fmt: skip
        self._resume_from: Optional[str] = None  # the checkpoint directory load_checkpoint read
        self._gathered: Optional[contextlib.ExitStack] = None  # stage 3: an evaluation loop's gathered_params()

    @property
    def zero_optimizer(self) -> Optional[ZeroAdamW]:
        """The ZeroAdamW this strategy trains with (None before ``fit`` built it)."""
        opts = getattr(self, "_optimizers", None) or []
        return innermost_zero(opts[0]) if opts else None

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer) -> None:
        """DDPStrategy's set-up without the DDP wrapper and without ``_optimizers_to_device`` (which writes into
        ``optimizer.state[p]``, a read-only view of ZeroAdamW's shards that already live on the device)."""
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        elif self.zero_optimizer is None:
            _sync_module_states(self.model)  # as DDP does when it does not wrap (validate/predict before any fit)
        self.setup_precision_plugin()
        self._route_clipping()

    def model_to_device(self) -> None:
        if on_device(self.model, self.root_device):
            return  # nothing to move (and on CPU `.to("cpu:0")` would copy every tensor)
        if self.zero_optimizer is not None:
            raise RuntimeError(f"{_WHERE}: the model must move to {self.root_device}, but its parameters live in "
                               "ZeroAdamW's flat buffers; build the Trainer for the device the model trained on")  # fmt: skip
        super().model_to_device()

    def _setup_model(self, model):
        return model  # no DDP wrapper: the optimizer reduces the gradients

    def setup_optimizers(self, trainer) -> None:
        """Lightning's ``configure_optimizers``, its AdamW turned into a ZeroAdamW with the same groups."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"{_WHERE}: configure_optimizers must return one optimizer, got {len(self.optimizers)}")
        given = self.optimizers[0]
        given = getattr(given, "_optimizer", given)  # a LightningOptimizer
        if isinstance(given, ZeroAdamW):
            model_state = given.sharded_state.model
            if given.stage != self.stage:
                raise ValueError(f"{_WHERE}: configure_optimizers built a ZeroAdamW at stage {given.stage}, the "
                                 f"strategy is at stage {self.stage}")  # fmt: skip
            if model_state is None or model_state.module is not self.lightning_module:
                raise ValueError(f"{_WHERE}: a ZeroAdamW returned by configure_optimizers must be built with "
                                 "`module=self` (the LightningModule)")  # fmt: skip
            return
        zero = zero_adamw_like(given, module=self.lightning_module, stage=self.stage, options=self.zero_options,
                               where=_WHERE)  # fmt: skip
        for config in self.lr_scheduler_configs:
            retarget_scheduler(config.scheduler, given, zero)
        self.optimizers = [zero]

    def _route_clipping(self) -> None:
        """Norm clipping through ZeroAdamW.clip_grad_norm_ (on this strategy's precision plugin only)."""
        plugin = self.precision_plugin
        if getattr(plugin, "_zero_ext_clipping", False):
            return
        original = plugin.clip_gradients

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM):
            zero = innermost_zero(optimizer)
            if zero is None:
                return original(optimizer, clip_val, gradient_clip_algorithm)
            if clip_val is None or clip_val <= 0:
                return None
            if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
                raise ValueError(f"{_WHERE}: gradient_clip_algorithm={str(gradient_clip_algorithm)!r} is not "
                                 "supported; ZeroAdamW clips the global norm (gradient_clip_algorithm='norm')")  # fmt: skip
            zero.clip_grad_norm_(float(clip_val))
            return None

        plugin.clip_gradients = clip_gradients
        plugin._zero_ext_clipping = True

    @contextlib.contextmanager
    def block_backward_sync(self):
        zero = self.zero_optimizer
        with zero.no_sync() if zero is not None else contextlib.nullcontext():
            yield None

    # ------------------------------------------------------------------ stage 3: evaluation on full parameters
    def _gather(self) -> None:
        zero = self.zero_optimizer
        if zero is not None and zero.stage == 3 and self._gathered is None:
            self._gathered = contextlib.ExitStack()
            self._gathered.enter_context(zero.gathered_params())

    def _release(self) -> None:
        if self._gathered is not None:
            stack, self._gathered = self._gathered, None
            stack.close()

    def on_validation_start(self) -> None:
        self._gather()

    def on_validation_end(self) -> None:
        self._release()

    def on_test_start(self) -> None:
        self._gather()

    def on_test_end(self) -> None:
        self._release()

    def on_predict_start(self) -> None:
        self._gather()

    def on_predict_end(self) -> None:
        self._release()

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full weights: at stage 3 gathered (collective; rank 0 keeps a copy, the others return nothing)."""
        zero = self.zero_optimizer
        if zero is None:
            return super().lightning_module_state_dict()
        if zero.stage != 3 or self._gathered is not None:
            zero.wait_for_params()
            return self.lightning_module.state_dict()
        with zero.gathered_params():
            if not self.is_global_zero:
                return {}
            return {k: v.clone() for k, v in self.lightning_module.state_dict().items()}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """A marker: the state itself is saved as shards by :meth:`save_checkpoint`."""
        if innermost_zero(optimizer) is None:
            return super().optimizer_state(optimizer)
        return {"zero_ext": ZERO_CHECKPOINT}

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Every rank: the optimizer shards into ``filepath/zero_ext``; rank 0: Lightning's dict into
        ``filepath/lightning.ckpt``."""
        zero = self.zero_optimizer
        if zero is None:
            return super().save_checkpoint(checkpoint_dict, filepath, storage_options)
        filepath = str(filepath)
        if "optimizer_states" in checkpoint_dict:  # not a weights-only checkpoint
            extra = {"format": _EXTRA_FORMAT, "world_size": zero.sharded_state.comm.process_count}
            checkpoint.save(os.path.join(filepath, ZERO_CHECKPOINT), zero, extra=extra)
        if self.is_global_zero:
            os.makedirs(filepath, exist_ok=True)
            self.checkpoint_io.save_checkpoint(checkpoint_dict, os.path.join(filepath, LIGHTNING_FILE),
                                               storage_options=storage_options)  # fmt: skip

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint directory this strategy wrote (its optimizer shards are loaded once the optimizer exists,
        by :meth:`load_optimizer_state_dict`), or a plain Lightning checkpoint file (weights only)."""
        path = str(checkpoint_path)
        if not os.path.isdir(path):
            self._resume_from = None
            return super().load_checkpoint(path, weights_only=weights_only)
        self._resume_from = path
        return self.checkpoint_io.load_checkpoint(os.path.join(path, LIGHTNING_FILE), weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint_dict) -> None:
        """The optimizer shards, at any number of devices and stage (no ``_optimizer_to_device``: see setup)."""
        zero = self.zero_optimizer
        if zero is None:
            return super().load_optimizer_state_dict(checkpoint_dict)
        states = checkpoint_dict.get("optimizer_states") or [{}]
        if self._resume_from is None or states[0].get("zero_ext") != ZERO_CHECKPOINT:
            raise ValueError(f"{_WHERE}: this checkpoint holds no zero_ext optimizer state (a file saved by another "
                             "strategy); resume from a checkpoint directory ZeroStrategy saved")  # fmt: skip
        extra = checkpoint.load(os.path.join(self._resume_from, ZERO_CHECKPOINT), zero)
        if not (isinstance(extra, dict) and extra.get("format") == _EXTRA_FORMAT):
            raise ValueError(f"{_WHERE}: {self._resume_from} was not saved by ZeroStrategy")

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """DDPStrategy's teardown without ``_optimizers_to_device(cpu)`` and ``lightning_module.cpu()`` (see the
        module docstring): the model stays where it trained, the optimizer stays usable."""
        self._release()
        if self.zero_optimizer is None:
            return super().teardown()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


if _UNAVAILABLE is not None:
    del ZeroStrategy
    __getattr__ = unavailable_names(__name__, ("ZeroStrategy",), _UNAVAILABLE)
