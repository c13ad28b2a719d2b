"""Sharded checkpoints of a :class:`zero_ext.ZeroAdamW`: save in parallel, load at any world size and stage,
consolidate offline.

- :func:`save` / :func:`load` (``saving.py``, ``loading.py``): collective; every rank writes or reads only its own
  byte ranges.
- :class:`Checkpoint` (``reader.py``): a checkpoint's verified metadata and where any parameter's elements live;
  :func:`read_extra`: the ``extra`` it was saved with, read before the model is built (no process group).
- :func:`consolidate` / ``python -m zero_ext.checkpoint consolidate PATH OUT`` (``consolidate.py``): no process
  group, no GPU; streams parameter by parameter into ``OUT/optimizer.safetensors`` (fp32 ``param/<name>``, then
  ``<kind>/<name>`` for every moment of the parameter's update rule under torch.optim's names, ``step/<name>``;
  param groups in the metadata) and
  ``OUT/model.safetensors`` (weights in the param dtype, for ``model.load_state_dict``).
- The file layout: :mod:`zero_ext.checkpoint.format`.
- :func:`get_state_dict` / :func:`set_state_dict` (``dcp_state_dict.py``): the state in
  ``torch.distributed.checkpoint.state_dict``'s layout (FSDP2 + torch.optim keys), each value this rank's pieces of
  the global tensor, for ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``; :class:`AppState` (a DCP ``Stateful``) and
  :func:`load_dcp` (a strict ``dcp.load``) in ``dcp_app.py``; :class:`CachedStager` (``dcp.async_save`` staging into
  reused host buffers) in ``dcp_staging.py``; consolidation of a DCP checkpoint: ``dcp_export.py``.

:func:`save` and :func:`load` write and read files, not a torch state dict: torch.optim's state-dict hooks
(``register_state_dict_pre_hook`` and the three others) run around ``opt.state_dict()`` / ``opt.load_state_dict()``
only (:mod:`zero_ext.torch_compat.state_dict_hooks`); state of your own goes in ``extra``.
"""

import importlib

from .consolidate import adamw_state_dict, consolidate, torch_state_dicts
from .format import FORMAT_VERSION, CheckpointError
from .loading import load
from .reader import Checkpoint, read_extra
from .saving import save

__all__ = [
    "save",
    "get_state_dict",
    "set_state_dict",
    "load_dcp",
    "AppState",
    "CachedStager",
    "load",
    "read_extra",
    "consolidate",
    "adamw_state_dict",
    "torch_state_dicts",
    "Checkpoint",
    "CheckpointError",
    "FORMAT_VERSION",
]

# The DCP names load torch.distributed.checkpoint (and with it DTensor and sympy): 0.6 s of the 2.6 s `import
# zero_ext` took on this 2-core machine, paid by every process that imports zero_ext (each gloo rank, each torchrun
# child) whether it checkpoints through DCP or not. They are imported on first use instead.
_LAZY = {
    "AppState": "dcp_app",
    "load_dcp": "dcp_app",
    "CachedStager": "dcp_staging",
    "get_state_dict": "dcp_state_dict",
    "set_state_dict": "dcp_state_dict",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
