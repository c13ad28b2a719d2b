"""ZeroMuon: ``torch.optim.Muon`` (with AdamW for the parameters Muon does not take) on ZeroAdamW's engine.

Each 2-D parameter of a Muon group belongs whole to one *owner* rank (:mod:`zero_ext.owner_layout`): the gradient
reduction delivers its mean gradient there, the owner runs the momentum, Newton-Schulz and the update
(:mod:`zero_ext.update.muon`, torch's operations), and the all-gather brings the parameter to every rank. Param
groups with ``"use_muon": False`` (embeddings, head, norms, biases) are AdamW groups sliced by elements as in
ZeroAdamW, in the same optimizer. Everything else (stages, offload, checkpoints, ``no_sync``, clipping, memory
reports) is ZeroAdamW's: one engine, two rules.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from .optimizer import ZeroAdamW, document_options
from .owner_layout import OwnerLayout
from .update.muon import NS_COEFFICIENTS
from .update.registry import RULE_KEY

# The defaults of a "use_muon": False group's AdamW keys it does not give (the Muon repository's MuonWithAuxAdam
# convention: lr 3e-4, betas (0.9, 0.95), eps 1e-10, no weight decay), and AdamW's fixed switches.
AUX_ADAMW_DEFAULTS = dict(
    lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0, amsgrad=False, maximize=False, foreach=None,
    capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True,
)  # fmt: skip
USE_MUON = "use_muon"


def _check_muon_arguments(lr, weight_decay, momentum, adjust_lr_fn) -> None:
    """torch.optim.Muon's checks, in its words."""
    import torch

    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


@document_options
class ZeroMuon(ZeroAdamW):
    """Muon whose optimizer state, gradients and (stage 3) parameters are sharded across data-parallel ranks.

    After ``backward()`` on every rank and ``step()``, every rank holds what one process running
    ``torch.optim.Muon`` on the Muon groups and ``torch.optim.AdamW`` on the others would hold, on fp32 master
    copies, from the mean of the ranks' gradients.

    Args:
        params: parameters, ``(name, parameter)`` pairs or param-group dicts. A group is a Muon group unless it has
            ``"use_muon": False``; every trainable parameter of a Muon group must be 2-D (as torch.optim.Muon
            requires; the optimizer refuses another on every rank, naming it). A group with ``"use_muon": False``
            is updated by AdamW with its own ``lr``, ``betas``, ``eps``, ``weight_decay`` (missing ones: 3e-4,
            (0.9, 0.95), 1e-10, 0.0, the Muon repository's ``MuonWithAuxAdam`` defaults) and AdamW's other keys
            (``amsgrad``, ``maximize``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s,
            with its meaning, for the Muon groups.
        <options>

    The keyword options are :class:`zero_ext.ZeroAdamW`'s, with its meaning (``moment_dtype=torch.bfloat16`` also
    stores the Muon momentum in bf16, with stochastic rounding; ``param_remainders=True`` and
    ``moment_dtype=torch.int8`` apply to the AdamW groups, exactly as in ZeroAdamW; a Muon group keeps its fp32 master
    and an fp32 momentum with them).

    :meth:`owners` says which rank updates each Muon matrix and how even the Newton-Schulz work is.
    """

    default_rule = "muon"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        **options: Any,
    ):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list))
                        else ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)  # fmt: skip
        self._construct(params, defaults, lambda: _check_muon_arguments(lr, weight_decay, momentum, adjust_lr_fn),
                        options)  # fmt: skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`ZeroAdamW.add_param_group`; a group with ``"use_muon": False`` is an AdamW group (its missing
        keys: :data:`AUX_ADAMW_DEFAULTS`), any other a Muon group (its missing keys: the optimizer's defaults)."""
        if isinstance(param_group, dict):
            param_group = dict(param_group)
            use_muon = param_group.setdefault(USE_MUON, True)
            if not isinstance(use_muon, bool):
                raise ValueError(
                    f"zero_ext.ZeroMuon: a param group's {USE_MUON!r} must be True or False, got {use_muon!r}"
                )
            if use_muon:
                param_group.setdefault(RULE_KEY, "muon")
            else:
                param_group.setdefault(RULE_KEY, "adamw")
                for key, value in AUX_ADAMW_DEFAULTS.items():
                    param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def owners(self) -> list[dict[str, Any]]:
        """Every Muon matrix: its name, shape, owner rank and Newton-Schulz cost (about rows x cols x min), in
        placement order; ``memory_report()`` and the docs say how even the owners' costs are."""
        out = []
        for group in self.sharded_state.groups:
            layout = group.layout
            if not isinstance(layout, OwnerLayout):
                continue
            for i, p in enumerate(group.params):
                out.append(dict(name=group.names[i], shape=tuple(p.shape), owner=layout.owners[i],
                                cost=layout.costs[i]))  # fmt: skip
        return out

    def owner_balance(self) -> dict[str, Any]:
        """The Newton-Schulz cost per rank (every Muon group together) and its max / mean (1.0: even)."""
        owned = [g.layout for g in self.sharded_state.groups if isinstance(g.layout, OwnerLayout)]
        per_rank = [sum(layout.rank_costs[r] for layout in owned) for r in range(self.sharded_state.world_size)]
        mean = sum(per_rank) / len(per_rank)
        return dict(cost_per_rank=per_rank, max_over_mean=max(per_rank) / mean if mean else 1.0)


__all__ = ["ZeroMuon", "AUX_ADAMW_DEFAULTS", "USE_MUON"]
