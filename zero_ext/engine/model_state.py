"""What ``module=`` gives ZeroAdamW: parameter names from the model, a refusal of a model that another gradient
reducer (DDP) also handles, and the model's state outside the optimizer (frozen parameters, buffers, the extra
names of tied weights) for complete checkpoints.

Names: every tensor of ``module.state_dict()`` is known by its keys; the first is its name, the others are aliases
(a tied weight: ``head.weight`` of ``embed.weight``). The optimizer names its parameters after the model, so a
consolidated checkpoint's ``model.safetensors`` has exactly the keys ``model.load_state_dict(strict=True)`` wants.
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from .weak_hooks import remove_all, remove_with, weak_call

_DDP_HINT = (
    "ZeroAdamW reduces the gradients itself: pass the unwrapped model (model.module) and do not wrap it in "
    "DistributedDataParallel (with HF Trainer, use zero_ext.integrations.transformers)"
)


def wrapping_in_ddp(who: str) -> Optional[str]:
    """When DistributedDataParallel's own code is running (its constructor broadcasts the parameters: stage 3 sees a
    read of a sharded parameter), the refusal to give instead of stage 3's "sharded here"; else None. Called only on
    that error path: it walks the Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == DistributedDataParallel.__module__:
            return f"{who}: the model is being wrapped in DistributedDataParallel. {_DDP_HINT}."
        frame = frame.f_back
    return None


class ModelState:
    def __init__(self, module: torch.nn.Module, who: str = "zero_ext.ZeroAdamW"):
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"{who}: `module` must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, DistributedDataParallel):
            raise ValueError(f"{who}: `module` is wrapped in DistributedDataParallel. {_DDP_HINT}.")
        self.module = module
        self.who = who  # how messages name the optimizer
        self.keys_of: dict[int, list[str]] = {}  # id(tensor) -> its state_dict keys, name first
        self.tensor_of: dict[str, torch.Tensor] = {}  # name -> tensor
        for key, t in module.state_dict(keep_vars=True).items():
            keys = self.keys_of.setdefault(id(t), [])
            if not keys:
                self.tensor_of[key] = t
            keys.append(key)
        self._hooks = []

    def install(self) -> None:
        """Hook the model (after the optimizer was built: a failed construction leaves the model untouched)."""
        self._hooks.append(self.module.register_forward_pre_hook(weak_call(self._refuse_ddp)))
        remove_with(self, self._hooks)

    def check_params(self, params: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
        """An error message when a trainable parameter is not the model's, else None."""
        for name, p in params:
            if p.requires_grad and id(p) not in self.keys_of:
                return f"parameter {name!r} is not a parameter of `module` (every optimized parameter must be)"
        return None

    def aliases(self) -> dict[str, str]:
        """Every state_dict key -> the name of its tensor, in state_dict order."""
        return {key: keys[0] for keys in self.keys_of.values() for key in keys}

    def unmanaged(self, managed: set[int]) -> dict[str, torch.Tensor]:
        """The model's tensors the optimizer does not hold (frozen parameters, persistent buffers), by name."""
        return {name: t for name, t in self.tensor_of.items() if id(t) not in managed}

    def _refuse_ddp(self, _module, _args) -> None:
        active = getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
        if active is not None and active.module is self.module:
            raise RuntimeError(f"{self.who}: the model is running inside DistributedDataParallel. {_DDP_HINT}.")

    def remove_hooks(self) -> None:
        remove_all(self._hooks)
