"""The torchtitan pattern, ready made: :class:`AppState` (a DCP ``Stateful`` of a model and its zero_ext optimizer)
and :func:`load_dcp`, a strict ``dcp.load``.

``dcp.load`` reads every key of the state dict it is given and ignores what else the checkpoint holds. A checkpoint
of a smaller model, or of another optimizer, then loads "successfully". :func:`load_dcp` first compares the
checkpoint's metadata with this model and optimizer: keys missing, keys the model does not have, shapes, and the
kind of optimizer state (SGD's ``momentum_buffer`` where AdamW keeps ``exp_avg``). It raises one clear error on
every rank before anything is read, then loads through ``dcp.load`` and :func:`set_state_dict`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ..engine.sleep import asleep
from .agreement import agree, sharded_state_of
from .dcp_state_dict import get_state_dict, set_state_dict
from .format import CheckpointError

MODEL, OPTIM = "model", "optim"


class AppState(Stateful):
    """``{"app": AppState(model, opt)}`` for ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` (torchtitan's
    ``ModelWrapper`` + ``OptimizersContainer`` in one): its state dict is ``{"model": ..., "optim": ...}`` in torch's
    layout, so the same checkpoint loads into FSDP2 under an app state whose keys are the same."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {MODEL: model_sd, OPTIM: optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict[MODEL],
                       optim_state_dict=state_dict[OPTIM])  # fmt: skip


def _kinds(keys, prefix: str) -> dict[str, set[str]]:
    """``{fqn: {state kind}}`` of the flattened keys ``<prefix>.state.<fqn>.<kind>``."""
    out: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(prefix + ".state."):
            fqn, _, kind = key[len(prefix) + 7 :].rpartition(".")
            out.setdefault(fqn, set()).add(kind)
    return out


def check_against_checkpoint(checkpoint_id: str | os.PathLike, state_dict: dict[str, Any], optim: str = OPTIM) -> None:
    """Raise a CheckpointError naming the keys where ``state_dict`` (nested, as given to ``dcp.load``) and the
    checkpoint differ: missing, extra, another shape, another optimizer's state."""
    try:
        metadata = dcp.FileSystemReader(os.fspath(checkpoint_id)).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"{checkpoint_id}: not a complete DCP checkpoint (no .metadata: a save that did not "
                              f"finish?): {e}") from None  # fmt: skip
    except Exception as e:  # noqa: BLE001  (a damaged pickle raises anything)
        raise CheckpointError(f"{checkpoint_id}: cannot read the DCP metadata ({e!r})") from None
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state_dict)
    mine_kinds, saved_kinds = _kinds(flat, optim), _kinds(saved, optim)
    for fqn, kinds in mine_kinds.items():
        theirs = saved_kinds.get(fqn)
        if theirs is not None and theirs != kinds:
            raise CheckpointError(
                f"{checkpoint_id}: the optimizer state of {fqn!r} holds {sorted(theirs)}, this optimizer keeps "
                f"{sorted(kinds)}: the checkpoint was saved by another optimizer (e.g. torch.optim.SGD, which keeps "
                "momentum_buffer) or with another amsgrad"
            )
    missing = sorted(k for k in flat if k not in saved)
    extra = sorted(k for k in saved if k not in flat and not k.startswith(f"{optim}.param_groups"))
    if missing or extra:
        raise CheckpointError(f"{checkpoint_id}: the checkpoint does not match the model and optimizer (another "
                              f"model?): keys missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                              f"; keys the model does not have: {extra[:8]}{' ...' if len(extra) > 8 else ''}")  # fmt: skip
    for key, value in flat.items():
        md = saved[key]
        shape = getattr(value, "shape", None)
        if isinstance(md, TensorStorageMetadata) and shape is not None and tuple(md.size) != tuple(shape):
            raise CheckpointError(f"{checkpoint_id}: {key!r} has shape {tuple(md.size)} in the checkpoint, "
                                  f"{tuple(shape)} here")  # fmt: skip


def load_dcp(checkpoint_id: str | os.PathLike, model, optimizer, *, key: Optional[str] = None) -> None:
    """Collective: load a DCP checkpoint saved as ``{"model": ..., "optim": ...}`` (or under ``key``, e.g. ``"app"``
    for ``{"app": AppState(...)}``) by zero_ext or by FSDP2 + torch.optim, strictly (module docstring)."""
    state = sharded_state_of(optimizer, "load_dcp")
    error, sd = None, None
    try:
        sleeping = asleep(state)
        if sleeping is not None:  # (get_state_dict reads parked state; loading would write it)
            raise sleeping.refusal("zero_ext.checkpoint.load_dcp")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {MODEL: model_sd, OPTIM: optim_sd}
        if key is not None:
            sd = {key: sd}
        check_against_checkpoint(checkpoint_id, sd, f"{key}.{OPTIM}" if key else OPTIM)
    except (CheckpointError, ValueError, TypeError, RuntimeError, OSError) as e:
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"{checkpoint_id}: {e}")
    agree(state.comm, error, f"zero_ext.checkpoint.load_dcp({checkpoint_id})")
    dcp.load(sd, checkpoint_id=checkpoint_id)  # raises on every rank (DCP gathers its errors)
    inner = sd[key] if key is not None else sd
    set_state_dict(model, optimizer, model_state_dict=inner[MODEL], optim_state_dict=inner[OPTIM])
