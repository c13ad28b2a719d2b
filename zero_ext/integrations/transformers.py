"""``ZeroTrainer``: transformers' ``Trainer`` training with :class:`zero_ext.ZeroAdamW` in place of ``DDP(model)`` +
``torch.optim.AdamW``. Launch as usual (``torchrun --nproc_per_node=N train.py``); everything else is the Trainer's.

    from zero_ext.integrations.transformers import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, zero_stage=2)
    trainer.train()                                # or train(resume_from_checkpoint=...) at any world size and stage
    trainer.save_model(out)                        # loads with from_pretrained(out)

``ZeroSeq2SeqTrainer`` is the same over ``Seq2SeqTrainer`` (``predict_with_generate``).

What happens to each of the Trainer's habits:

- *The optimizer*: ``create_optimizer`` builds one ZeroAdamW (``module=`` the model, ``stage=zero_stage``) over the
  Trainer's usual two param groups (``get_decay_parameter_names``: ``weight_decay`` or 0.0), with
  ``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``; ``optim`` must name plain AdamW.
- *Wrapping*: accelerate would wrap the model in ``DistributedDataParallel`` (every gradient reduced twice). This
  trainer's accelerator prepares the model without any wrapper (device placement, autocast and ``torch.compile``
  still apply); a model that runs inside DDP anyway is refused by ZeroAdamW at its first forward.
- *Clipping and the logged grad_norm*: the Trainer calls ``accelerator.clip_grad_norm_(model.parameters(), max)``,
  which here is the optimizer's :meth:`~zero_ext.ZeroAdamW.clip_grad_norm_`: it returns the true global norm of the
  mean gradients (logged as ``grad_norm``; torch's function would see no gradients at stage 2) and the clip is
  applied inside the step that follows. With ``max_grad_norm=0`` the norm is measured and nothing is clipped.
- *Gradient accumulation*: ``accelerator.no_sync(model)`` is the optimizer's :meth:`~zero_ext.ZeroAdamW.no_sync`.
- ``model.zero_grad()`` after each step: harmless (stage 2's ``step()`` has consumed the gradients).
- *Checkpoints*: every rank saves the optimizer shards through :func:`zero_ext.checkpoint.save` into
  ``checkpoint-N/zero_ext/``, with the scheduler's state and every rank's random generators beside them (no
  ``optimizer.pt``, ``scheduler.pt`` or ``rng_state_*.pth``); the weights (``model.safetensors``), config and
  ``trainer_state.json`` are the Trainer's own. ``resume_from_checkpoint`` loads it at any world size and stage.
  The generators: at the world size of the save each rank gets its own back (the resumed run continues bitwise);
  at another world size rank ``r`` takes saved rank ``r % N``'s, and since each rank then also sees other
  samples, dropout masks differ from the uninterrupted run (without dropout the curve continues to fp32 rounding).
- ``save_model``: at stages 1 and 2 every rank holds the full parameters after ``step()``, so the Trainer's own
  ``save_pretrained`` on the main process writes them: the optimizer's fp32 master, or its rounding to the param
  dtype, exactly what :func:`zero_ext.checkpoint.consolidate` of the same step writes. Not collective at stages 1
  and 2; collective at stage 3 (below), as transformers documents ``save_model`` anyway: call it on every rank.

- *Device placement*: ZeroAdamW's flat buffers hold the parameters, so the model is placed before the optimizer is
  built and never moved after (a move copies tensors out of the buffers: refused). A placement that would move
  nothing is skipped; on CPU the Trainer's ``model.to("cpu:0")`` would otherwise copy every tensor.

Stage 3 (``zero_stage=3``: the parameters are sharded too; outside forward and backward each rank holds only its
shard, and reading a parameter there raises an error naming it):

- *Training*: every module's forward and backward gathers its parameters (collectives), so every rank must run the
  same forwards: the Trainer's training loop does (the distributed sampler gives every rank as many batches).
- *Evaluation* (``evaluate()``, ``predict()``, the evaluations during ``train()``, ``Seq2SeqTrainer``'s generation):
  ``evaluation_loop`` runs inside one ``opt.gathered_params()`` on every rank. A forward there is local (no
  collective, the gather schedule untouched), so the ranks may run different numbers of forwards: generation runs
  one per new token and stops when its batch is done, prompts differ in length per rank, and with accelerate's
  ``even_batches=False`` the ranks get unequal batches. Chosen over forwards kept in step across ranks (generate's
  ``synced_gpus``, as under DeepSpeed ZeRO-3: every rank runs as many forwards as the slowest, each gathering every
  bucket) because it is right for any evaluation code and communicates the model once per loop instead of once
  per forward and token. The cost: for the whole loop every rank holds the full parameters in the param dtype (2
  or 4 bytes per parameter, what DDP holds throughout) beside its shards; a model whose parameters do not fit on
  one device cannot evaluate here.
- ``save_model`` (and each checkpoint's weights): inside ``opt.gathered_params()`` on every rank (the same full
  parameters, briefly), then the main process writes; collective.
- *Loading weights into the model* (``load_best_model_at_end``; ``resume_from_checkpoint`` once the optimizer
  exists, e.g. after ``create_optimizer()``): inside ``opt.gathered_params(modifier_rank=0)``: every rank reads the
  same file and rank 0's values go into the shards and the fp32 master.
- Anything else that reads ``trainer.model``'s parameters after the optimizer exists (``model.generate`` in a
  callback, ``model.save_pretrained``) does it inside ``with trainer.zero_optimizer.gathered_params():`` on every
  rank. The Trainer itself reads only shapes and sizes, which shards keep.

Refused with a clear error: DeepSpeed, FSDP, tensor/context parallelism (ZeroAdamW is the data-parallel engine),
``nn.DataParallel`` (several GPUs in one process), fp16 loss scaling (bf16 autocast and fp32 work),
``fp16_full_eval``/``bf16_full_eval`` (they cast the model), an optimizer other than ZeroAdamW (one passed in
``optimizers`` must be built with ``module=`` the model), ZeroAdamW options the Trainer owns, and clipping a subset
of the parameters through the accelerator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

import torch

from .. import checkpoint
from ..optimizer import ZeroAdamW
from . import rng
from .optimizer_swap import TRAINER_OWNED as _TRAINER_OWNED
from .optimizer_swap import check_all_trainable, unavailable_names
from .optimizer_swap import on_device as _on_device

# The Trainer methods ZeroTrainer overrides (transformers 5.x). Should a release rename one, the Trainer would quietly
# go back to its own (e.g. torch.save of rank 0's shard alone): refuse instead.
_OVERRIDDEN = ("create_accelerator_and_postprocess", "create_optimizer", "_move_model_to_device",
               "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_save_rng_state", "_load_rng_state",
               "save_model", "_load_from_checkpoint", "_load_best_model", "evaluation_loop")  # fmt: skip
# Without a suitable transformers this module still imports (as every zero_ext module does), but hands out no
# ZeroTrainer: `from zero_ext.integrations.transformers import ZeroTrainer` raises this ImportError (see the end).
_UNAVAILABLE: Optional[tuple[str, Optional[BaseException]]] = None
try:
    from transformers import Seq2SeqTrainer, Trainer
except ImportError as e:
    Trainer = Seq2SeqTrainer = object  # type: ignore[assignment,misc]
    _UNAVAILABLE = ('zero_ext.integrations.transformers needs transformers (with accelerate): pip install "zero_ext[hf]"',
                    e)  # fmt: skip
else:
    _gone = [name for name in _OVERRIDDEN if not callable(getattr(Trainer, name, None))]
    if _gone:
        _UNAVAILABLE = (f"zero_ext.integrations.transformers: this transformers' Trainer has no {_gone}; "
                        "ZeroTrainer supports transformers 5.x", None)  # fmt: skip

__all__ = ["ZeroTrainer", "ZeroSeq2SeqTrainer", "ZERO_CHECKPOINT"]

logger = logging.getLogger(__name__)

ZERO_CHECKPOINT = "zero_ext"  # the sharded optimizer checkpoint's folder inside a Trainer checkpoint
_EXTRA_FORMAT = "zero_ext.integrations.transformers/1"
_ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_apex_fused"}  # `optim` values that mean plain AdamW


class ZeroTrainer(Trainer):
    """A transformers ``Trainer`` that trains with :class:`zero_ext.ZeroAdamW` and never wraps the model in DDP
    (see the module docstring for each Trainer habit).

    Args:
        zero_stage: 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too).
        zero_options: further ZeroAdamW keywords: ``bucket_size``, ``reduce_dtype``, ``staging_buffers``, ``offload``;
            at stage 3 ``reshard_after_forward`` and ``prefetch``. The
            hyperparameters, ``stage``, ``module``, clipping and the process group (the world) come from the Trainer
            and its ``TrainingArguments``.
        *args, **kwargs: ``Trainer``'s. ``optimizers=(opt, scheduler)`` may pass a ZeroAdamW built with
            ``module=model``.
    """

    def __init__(self, *args, zero_stage: int = 2, zero_options: Optional[dict[str, Any]] = None, **kwargs):
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"ZeroTrainer: `zero_stage` must be 1, 2 or 3, got {zero_stage!r}")
        options = dict(zero_options or {})
        owned = sorted(set(options) & _TRAINER_OWNED)
        if owned:
            raise ValueError(
                f"ZeroTrainer: `zero_options` may not set {owned}: the hyperparameters and max_grad_norm come from "
                "TrainingArguments, the stage from `zero_stage`, the model and the (world) process group from the "
                "Trainer, and the Trainer reads parameters outside forward (no deferred all-gather)"
            )
        self.zero_stage, self.zero_options = zero_stage, options
        self._zero_rng: Optional[tuple[str, list]] = None  # (checkpoint, every saved rank's generators)
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()

    # ------------------------------------------------------------------ set-up
    def _refuse_unsupported(self) -> None:
        where = "ZeroTrainer"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            raise ValueError(f"{where}: {engine} is configured; ZeroTrainer is the sharded data-parallel engine itself")
        if getattr(self.accelerator, "parallelism_config", None) is not None:
            raise ValueError(f"{where}: a ParallelismConfig (tensor/context parallelism) is configured; ZeroTrainer is "
                             "data-parallel only")  # fmt: skip
        if self.args.n_gpu > 1:
            raise ValueError(f"{where}: {self.args.n_gpu} GPUs in one process (nn.DataParallel); launch one process "
                             "per GPU with torchrun")  # fmt: skip
        if getattr(self.accelerator, "scaler", None) is not None:
            raise ValueError(f"{where}: fp16 mixed precision with a GradScaler is not supported (the scaler reads "
                             "param.grad, which stage 2 never fills); use bf16=True or fp32")  # fmt: skip
        if self.args.fp16_full_eval or self.args.bf16_full_eval:
            raise ValueError(f"{where}: fp16_full_eval/bf16_full_eval cast the model itself, which would take its "
                             "parameters out of ZeroAdamW's buffers; use autocast (bf16=True) instead")  # fmt: skip
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError(f"{where}: `optimizer_cls_and_kwargs` is not supported: it always trains with ZeroAdamW "
                             "(options through `zero_options`)")  # fmt: skip
        if self.optimizer is not None:
            model_state = getattr(self.optimizer, "sharded_state", None)
            if not isinstance(self.optimizer, ZeroAdamW) or model_state is None:
                raise ValueError(f"{where}: `optimizers` must hold a zero_ext.ZeroAdamW (or None to let the Trainer "
                                 f"build one), got {type(self.optimizer).__name__}")  # fmt: skip
            if model_state.model is None or model_state.model.module is not self.model:
                raise ValueError(f"{where}: the ZeroAdamW passed in `optimizers` must be built with `module=` the "
                                 "Trainer's model (complete checkpoints, DDP refusal)")  # fmt: skip
            if not _on_device(self.model, model_state.device):
                raise ValueError(f"{where}: the model was moved to {self.args.device} after its ZeroAdamW was built "
                                 f"on {model_state.device}; build the optimizer after model.to(args.device)")  # fmt: skip
        elif str(getattr(self.args.optim, "value", self.args.optim)) not in _ADAMW:
            raise ValueError(f"{where}: TrainingArguments.optim={self.args.optim!r}; ZeroTrainer trains with "
                             f"ZeroAdamW, so `optim` must name plain AdamW ({sorted(_ADAMW)})")  # fmt: skip

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self._route_accelerator()

    def _route_accelerator(self) -> None:
        """Send the accelerator's model wrapping, clipping and no_sync to ZeroAdamW (for this trainer's model)."""
        acc = self.accelerator
        prepare_model, clip_grad_norm_, no_sync = acc.prepare_model, acc.clip_grad_norm_, acc.no_sync

        def prepare_model_unwrapped(model, device_placement=None, evaluation_mode=False):
            if model is not self.model:
                return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
            if _on_device(model, acc.device):
                device_placement = False  # already there; and on CPU `.to("cpu:0")` would copy every tensor
            else:
                self._refuse_moving_optimized_model(acc.device)
            # evaluation_mode=True: autocast and torch.compile as configured, but no DDP/FSDP wrapper.
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        def clip_grad_norm_through_optimizer(parameters, max_norm, norm_type=2):
            opt = self.zero_optimizer
            if opt is None:
                return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
            check_all_trainable(parameters, opt, "ZeroTrainer")
            return opt.clip_grad_norm_(float(max_norm), float(norm_type))

        @contextlib.contextmanager
        def no_sync_through_optimizer(model=None):
            opt = self.zero_optimizer
            with opt.no_sync() if opt is not None else no_sync(model):
                yield

        acc.prepare_model = prepare_model_unwrapped
        acc.clip_grad_norm_ = clip_grad_norm_through_optimizer
        acc.no_sync = no_sync_through_optimizer

    @property
    def zero_optimizer(self) -> Optional[ZeroAdamW]:
        """The ZeroAdamW under accelerate's wrapper (None before the optimizer exists)."""
        opt = getattr(self, "optimizer", None)  # also asked during Trainer.__init__
        while opt is not None and not isinstance(opt, ZeroAdamW):
            opt = getattr(opt, "optimizer", None)
        return opt

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        model = self.model if model is None else model
        if self.optimizer is None:
            args = self.args
            if not _on_device(model, args.device):  # ZeroAdamW takes the parameters where they are
                self._move_model_to_device(model, args.device)
            decay = set(self.get_decay_parameter_names(model))
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            self.optimizer = ZeroAdamW(
                [g for g in groups if g["params"]],
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
                stage=self.zero_stage,
                module=model,
                **self.zero_options,
            )
        return self.optimizer

    def _move_model_to_device(self, model, device) -> None:
        if _on_device(model, device):
            return  # nothing to move; on CPU `.to("cpu:0")` would copy every tensor
        self._refuse_moving_optimized_model(device)
        super()._move_model_to_device(model, device)

    def _refuse_moving_optimized_model(self, device) -> None:
        """Moving a model copies its tensors: the parameters would leave ZeroAdamW's flat buffers, and training
        would update buffers the model no longer reads."""
        if self.zero_optimizer is not None:
            raise RuntimeError(
                f"ZeroTrainer: the model must move to {device}, but its ZeroAdamW already exists and holds the "
                "parameters where they are; build the optimizer after moving the model (model.to(args.device))"
            )

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank (the Trainer calls this on all of them): the optimizer shards, the scheduler and every rank's
        generators, through zero_ext.checkpoint (atomic, checksummed, loadable at any world size)."""
        opt = self._require_optimizer("save a checkpoint")
        comm = opt.sharded_state.comm
        extra = {
            "format": _EXTRA_FORMAT,
            "world_size": comm.process_count,
            "scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "rng": rng.gather(comm),
        }
        checkpoint.save(os.path.join(output_dir, ZERO_CHECKPOINT), opt, extra=extra)

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing: every rank's generators were saved with the optimizer (``_save_optimizer_and_scheduler``)."""

    def _load_optimizer_and_scheduler(self, resume_from: Optional[str]) -> None:
        """Every rank: the optimizer shards (any world size and stage), the scheduler; the generators are kept for
        ``_load_rng_state``, which the Trainer calls when it reaches the resumed batch."""
        if resume_from is None:
            return
        opt = self._require_optimizer("resume from a checkpoint")
        path = os.path.join(resume_from, ZERO_CHECKPOINT)
        seen = opt.sharded_state.comm.agree(int(os.path.isdir(path)))
        if 0 < sum(seen) < len(seen):
            raise FileNotFoundError(f"ZeroTrainer: {path} is visible on ranks {[r for r, s in enumerate(seen) if s]} "
                                    "only; every rank must see the checkpoint (a shared filesystem)")  # fmt: skip
        if not seen[0]:
            foreign = [f for f in ("optimizer.pt", "optimizer.bin") if os.path.exists(os.path.join(resume_from, f))]
            if foreign:
                raise ValueError(f"ZeroTrainer: {resume_from} holds a torch optimizer's state ({foreign[0]}), not a "
                                 "zero_ext checkpoint; ZeroTrainer cannot load it")  # fmt: skip
            logger.warning("ZeroTrainer: %s has no optimizer state (saved with save_only_model?): the optimizer, the "
                           "scheduler and the random generators start afresh", resume_from)  # fmt: skip
            return
        extra = checkpoint.load(path, opt)
        if not (isinstance(extra, dict) and extra.get("format") == _EXTRA_FORMAT):
            raise ValueError(f"ZeroTrainer: {path} was not saved by ZeroTrainer (no scheduler or generator state)")
        if self.lr_scheduler is not None and extra["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["scheduler"])
        self._zero_rng = (resume_from, extra["rng"])
        saved, now = extra["world_size"], opt.sharded_state.comm.process_count
        if saved != now:
            logger.warning("ZeroTrainer: %s was saved at %d ranks and resumes at %d: rank r takes saved rank r %% %d's "
                           "random generators, and the ranks see other samples than before, so dropout differs from "
                           "an uninterrupted run", resume_from, saved, now, saved)  # fmt: skip

    def _load_rng_state(self, resume_from: Optional[str]) -> None:
        if resume_from is None:
            return
        if self._zero_rng is None or self._zero_rng[0] != resume_from:
            return super()._load_rng_state(resume_from)  # a checkpoint without optimizer state
        rng.restore(self._zero_rng[1], self.zero_optimizer.sharded_state.comm.process_rank)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (``save_pretrained`` on the main process) on the full parameters: at stages 1
        and 2 once this rank's parameter all-gathers are complete (not collective); at stage 3 inside
        ``gathered_params()`` (collective: every rank calls it, as the Trainer does)."""
        with self._full_parameters():
            super().save_model(output_dir, _internal_call=_internal_call)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The Trainer's, writing into the shards at stage 3 (every rank reads the same file; rank 0's copy is kept).
        At the start of ``train()`` the optimizer does not exist yet and the model is an ordinary one."""
        with self._full_parameters(modifier_rank=0):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        with self._full_parameters(modifier_rank=0):
            super()._load_best_model()

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop (``evaluate()``, ``predict()``, ``Seq2SeqTrainer``'s generation) on the full parameters
        at stage 3: every rank runs it inside one ``gathered_params()``, so each forward is local (no collective),
        and a rank may run more forwards than another (generation stops per batch; the last batch is smaller)."""
        with self._full_parameters():
            return super().evaluation_loop(*args, **kwargs)

    @contextlib.contextmanager
    def _full_parameters(self, modifier_rank: Optional[int] = None):
        """Stage 3: the optimizer's ``gathered_params()`` (collective), writing rank ``modifier_rank``'s changes back;
        otherwise (stages 1 and 2, or no optimizer yet) the parameters are full already: wait for their gathers."""
        opt = self.zero_optimizer
        if opt is None or opt.stage != 3:
            if opt is not None:
                opt.wait_for_params()
            yield
            return
        with opt.gathered_params(modifier_rank=modifier_rank):
            yield

    def _require_optimizer(self, what: str) -> ZeroAdamW:
        opt = self.zero_optimizer
        if opt is None:
            raise RuntimeError(f"ZeroTrainer: cannot {what} before the optimizer exists")
        return opt


class ZeroSeq2SeqTrainer(ZeroTrainer, Seq2SeqTrainer):
    """:class:`ZeroTrainer` over transformers' ``Seq2SeqTrainer``: ``predict_with_generate`` generates in
    ``evaluate()`` and ``predict()`` (inside ``gathered_params()`` at stage 3, like every evaluation forward)."""


if _UNAVAILABLE is not None:
    del ZeroTrainer, ZeroSeq2SeqTrainer
    __getattr__ = unavailable_names(__name__, ("ZeroTrainer", "ZeroSeq2SeqTrainer"), _UNAVAILABLE)
