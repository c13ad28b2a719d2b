"""``ZeroAccelerator``: Hugging Face accelerate's ``Accelerator`` training with :class:`zero_ext.ZeroAdamW` in place of
``DDP(model)`` + ``torch.optim.AdamW`` (``pip install "zero_ext[accelerate]"``). accelerate's own loop, one line
changed:

    from zero_ext.integrations.accelerate import ZeroAccelerator
    accelerator = ZeroAccelerator(stage=2)          # was accelerate.Accelerator()
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

Launch with ``accelerate launch`` or ``torchrun`` as usual. What happens to each of accelerate's habits (the anchors
are its DeepSpeed and FSDP branches):

- ``prepare``: the model is placed on the device and gets autocast (``mixed_precision="bf16"``) and ``torch.compile``
  as configured, but no DDP wrapper; a ``torch.optim.AdamW`` becomes a ZeroAdamW over the same groups with the same
  hyperparameters (``module=`` its model, which ``prepare`` handles first whatever the argument order), wrapped in
  accelerate's ``AcceleratedOptimizer`` (skips ``step``/``zero_grad`` while accumulating); its LR scheduler is
  pointed at the ZeroAdamW. A ZeroAdamW / ZeroMuon built by the user (``module=`` the model) is taken as it is.
  Any other optimizer is refused.
- ``backward``, ``accumulate(model)`` / ``gradient_accumulation_steps``: accelerate's, with ``no_sync(model)`` the
  optimizer's :meth:`~zero_ext.ZeroAdamW.no_sync` instead of ``DDP.no_sync``.
- ``clip_grad_norm_(model.parameters(), max_norm)``: the optimizer's :meth:`~zero_ext.ZeroAdamW.clip_grad_norm_`
  (returns the global norm of the mean gradients, as accelerate's under DDP; the clip is applied in the step).
  A subset of the parameters, or ``clip_grad_value_`` on them, is refused.
- ``save_state`` / ``load_state``: accelerate's (model weights, schedulers, samplers, random states, custom objects)
  with each ZeroAdamW saved as shards through :func:`zero_ext.checkpoint.save` into ``zero_ext_<i>/`` instead of a
  rank-0 ``optimizer.bin``; ``load_state`` resumes at any number of processes and stage.
- ``get_state_dict(model)`` / ``save_model``: the full weights (stage 3: gathered, collective: call them on every
  process, as accelerate's FSDP path requires too).
- Stage 3: outside forward and backward each rank holds shards; evaluate inside
  ``with accelerator.zero_optimizer(model).gathered_params():`` (each forward local, no collective).

Refused with a clear error: DeepSpeed, FSDP, Megatron-LM and XLA (ZeroAdamW is the data-parallel engine), fp16
with a GradScaler (bf16 needs none), tensor parallelism.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import safetensors.torch
import torch

from .. import checkpoint
from ..optimizer import ZeroAdamW
from .optimizer_swap import (
    check_all_trainable,
    check_options,
    innermost_zero,
    on_device,
    retarget_scheduler,
    unavailable_names,
    zero_adamw_like,
)

_UNAVAILABLE: Optional[tuple[str, Optional[BaseException]]] = None
try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as e:
    Accelerator = object  # type: ignore[assignment,misc]
    _UNAVAILABLE = ('zero_ext.integrations.accelerate needs accelerate: pip install "zero_ext[accelerate]"', e)

__all__ = ["ZeroAccelerator"]

_EXTRA_FORMAT = "zero_ext.integrations.accelerate/1"
_WHERE = "zero_ext ZeroAccelerator"


def zero_checkpoint_dir(state_dir: str, index: int) -> str:
    """Where optimizer ``index``'s shards live inside a ``save_state`` folder."""
    return os.path.join(str(state_dir), f"zero_ext_{index}")


class ZeroAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` trains with :class:`zero_ext.ZeroAdamW` and never wraps the model
    in DDP (see the module docstring for each habit).

    Args:
        stage: 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too).
        zero_options: further ZeroAdamW keywords (``bucket_size``, ``reduce_dtype``, ``offload``, ...); the
            hyperparameters come from the optimizer handed to ``prepare``.
        *args, **kwargs: ``Accelerator``'s.
    """

    def __init__(self, *args, stage: int = 2, zero_options: Optional[dict[str, Any]] = None, **kwargs):
        if stage not in (1, 2, 3):
            raise ValueError(f"{_WHERE}: `stage` must be 1, 2 or 3, got {stage!r}")
        self.zero_stage = stage
        self.zero_options = check_options(zero_options or {}, _WHERE)
        super().__init__(*args, **kwargs)
        refused = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
                   DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA"}  # fmt: skip
        if self.distributed_type in refused:
            raise ValueError(f"{_WHERE}: {refused[self.distributed_type]} is configured; ZeroAccelerator is the "
                             "sharded data-parallel engine itself")  # fmt: skip
        if self.scaler is not None:
            raise ValueError(f"{_WHERE}: fp16 mixed precision with a GradScaler is not supported (the scaler reads "
                             "param.grad, which stage 2 never fills); use mixed_precision='bf16' or fp32")  # fmt: skip
        if getattr(self, "parallelism_config", None) is not None and self.parallelism_config.tp_enabled:
            raise ValueError(f"{_WHERE}: tensor parallelism is configured; ZeroAccelerator is data-parallel only")
        self._swapped: list[tuple[torch.optim.Optimizer, ZeroAdamW]] = []  # (the user's AdamW, its replacement)
        # Every prepared ZeroAdamW (save_state/load_state hide them from accelerate's optimizer list for a while)
        self._zero_optimizers: list[ZeroAdamW] = []
        self._state_dir: Optional[str] = None  # the folder save_state / load_state resolved (their pre-hooks)
        self.register_save_state_pre_hook(lambda models, weights, output_dir: self._remember(output_dir))
        self.register_load_state_pre_hook(self._load_weights)

    def _remember(self, state_dir) -> None:
        self._state_dir = str(state_dir)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """accelerate's ``prepare``, with the models placed first (a ZeroAdamW takes its parameters where they are)."""
        for i, obj in enumerate(args):
            if isinstance(obj, torch.nn.Module):
                placement = device_placement[i] if isinstance(device_placement, (list, tuple)) else device_placement
                self.prepare_model(obj, device_placement=placement)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Device placement, autocast and ``torch.compile`` as configured; no DDP wrapper (``evaluation_mode`` is
        accelerate's way to skip it). A model already prepared is returned as it is."""
        if any(model is m for m in self._models):
            return model
        if on_device(model, self.device):
            device_placement = False  # already there; and on CPU `.to("cpu:0")` would copy every tensor
        elif self._zero_of(model) is not None:
            raise RuntimeError(f"{_WHERE}: the model must move to {self.device}, but its ZeroAdamW already holds the "
                               "parameters where they are; build the optimizer after moving the model")  # fmt: skip
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        """A ``torch.optim.AdamW`` becomes a ZeroAdamW over its model's parameters; a user's ZeroAdamW is kept. No
        device placement: accelerate's would round-trip the state dict, which ZeroAdamW's shards need not."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        zero = optimizer if isinstance(optimizer, ZeroAdamW) else None
        if zero is None:
            model = self._model_of(optimizer)
            zero = zero_adamw_like(optimizer, module=model, stage=self.zero_stage, options=self.zero_options,
                                   where=_WHERE)  # fmt: skip
            self._swapped.append((optimizer, zero))
        wrapped = AcceleratedOptimizer(zero, device_placement=False, scaler=None)
        self._optimizers.append(wrapped)
        self._zero_optimizers.append(zero)
        return wrapped

    def prepare_scheduler(self, scheduler):
        for old, zero in self._swapped:
            retarget_scheduler(scheduler, old, zero)
        return super().prepare_scheduler(scheduler)

    def _model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if wanted <= {id(p) for p in model.parameters()}:
                return model
        raise ValueError(f"{_WHERE}: prepare the optimizer together with its model (prepare(model, optimizer, ...)): "
                         "no prepared model holds all of the optimizer's parameters")  # fmt: skip

    def _zeros(self) -> list[ZeroAdamW]:
        return list(self._zero_optimizers)

    def _zero_of(self, model: torch.nn.Module) -> Optional[ZeroAdamW]:
        model = self.unwrap_model(model) if any(model is m for m in self._models) else model
        for zero in self._zeros():
            state = zero.sharded_state.model
            if state is not None and state.module is model:
                return zero
        return None

    def zero_optimizer(self, model: torch.nn.Module) -> Optional[ZeroAdamW]:
        """The ZeroAdamW that trains ``model`` (None before ``prepare``)."""
        return self._zero_of(model)

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model):
        zero = self._zero_of(model)
        if zero is None:
            with super().no_sync(model):
                yield
            return
        with zero.no_sync():
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        given = {id(p) for p in parameters}
        for zero in self._zeros():
            if given & {id(p) for g in zero.param_groups for p in g["params"]}:
                check_all_trainable(parameters, zero, _WHERE)
                return zero.clip_grad_norm_(float(max_norm), float(norm_type))
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        parameters = list(parameters)
        given = {id(p) for p in parameters}
        if any(given & {id(p) for g in z.param_groups for p in g["params"]} for z in self._zeros()):
            raise ValueError(f"{_WHERE}: clip_grad_value_ is not supported on ZeroAdamW's parameters (their gradients "
                             "are sharded); clip the norm with accelerator.clip_grad_norm_")  # fmt: skip
        return super().clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------ weights and checkpoints
    def get_state_dict(self, model, unwrap: bool = True):
        """The full weights; at stage 3 gathered (collective), the main process keeping a copy."""
        zero = self._zero_of(model)
        if zero is None:
            return super().get_state_dict(model, unwrap=unwrap)
        if zero.stage != 3:
            # Cloned: the parameters are views into one flat buffer, which safetensors takes for shared tensors and
            # would drop from the file (all but one).
            zero.wait_for_params()
            return {k: v.clone() for k, v in super().get_state_dict(model, unwrap=unwrap).items()}
        with zero.gathered_params():
            if not self.is_main_process:
                return {}
            return {k: v.clone() for k, v in super().get_state_dict(model, unwrap=unwrap).items()}

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs):
        """accelerate's, each ZeroAdamW's state saved as shards by every process (``zero_ext_<i>/``) instead of
        rank 0's ``optimizer.bin``."""
        everything = self._optimizers
        self._optimizers = [o for o in everything if innermost_zero(o) is None]
        try:
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            self._optimizers = everything
        for i, opt in enumerate(everything):
            zero = innermost_zero(opt)
            if zero is not None:
                extra = {"format": _EXTRA_FORMAT, "world_size": zero.sharded_state.comm.process_count}
                checkpoint.save(zero_checkpoint_dir(self._state_dir, i), zero, extra=extra)
        return location

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs):
        """accelerate's (the weights read by :meth:`_load_weights`), then each ZeroAdamW from its shards, at any
        number of processes and stage."""
        everything = self._optimizers
        self._optimizers = [o for o in everything if innermost_zero(o) is None]
        try:
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        finally:
            self._optimizers = everything
        for i, opt in enumerate(everything):
            zero = innermost_zero(opt)
            if zero is not None:
                path = zero_checkpoint_dir(self._state_dir, i)
                extra = checkpoint.load(path, zero)
                if not (isinstance(extra, dict) and extra.get("format") == _EXTRA_FORMAT):
                    raise ValueError(f"{_WHERE}: {path} was not saved by ZeroAccelerator.save_state")

    def _load_weights(self, models: list, input_dir) -> None:
        """load_state's pre-hook: every model's weights read here instead of by accelerate (the list is emptied, as
        accelerate's hooks may do): safetensors' ``load_model`` refuses parameters that are views into one flat
        buffer (it takes them for shared tensors), and a stage-3 model takes them inside
        ``gathered_params(modifier_rank=0)`` (the main process's copy goes to every rank's shards)."""
        self._remember(input_dir)
        if not self._zero_optimizers:
            return
        for i, model in enumerate(models):
            ending = f"_{i}" if i > 0 else ""
            safe = os.path.join(str(input_dir), f"model{ending}.safetensors")
            if os.path.exists(safe):
                weights = safetensors.torch.load_file(safe, device="cpu")
            else:
                weights = torch.load(os.path.join(str(input_dir), f"pytorch_model{ending}.bin"), map_location="cpu",
                                     weights_only=True)  # fmt: skip
            zero = self._zero_of(model)
            with zero.gathered_params(modifier_rank=0) if zero is not None and zero.stage == 3 else _nothing():
                self.unwrap_model(model).load_state_dict(weights)
        models.clear()


def _nothing():
    return contextlib.nullcontext()


if _UNAVAILABLE is not None:
    del ZeroAccelerator
    __getattr__ = unavailable_names(__name__, ("ZeroAccelerator",), _UNAVAILABLE)
