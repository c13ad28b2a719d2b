"""torch.optim.AdamW's constructor checks (torch/optim/adam.py, torch 2.13), in its order, with its exception types and
its words after zero_ext's prefix, so that code matching torch's messages (``pytest.raises(match=...)``, torch's own
``optim_error_inputs_func_adamw``) matches ZeroAdamW's. ZeroAdamW's own checks (:mod:`zero_ext.ops`: a
finite lr, eps and weight_decay, the types) run after these and are stricter; ``fused`` with ``foreach`` or with
``differentiable``, which torch checks after its param groups, are checked here, before them."""

from __future__ import annotations

from numbers import Real
from typing import Any

import torch

PREFIX = "zero_ext.ZeroAdamW: "


def _comparable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, Real)


def _got(value: Any) -> str:
    """zero_ext's own words for the value, after torch's (which prints a tensor as ``tensor(-1.)``)."""
    return repr(float(value.detach().reshape(()).item()) if isinstance(value, torch.Tensor) else float(value))


def check_adamw_arguments(lr, betas, eps, weight_decay, *, foreach, capturable, differentiable, fused) -> None:
    """Raise torch's error for the first of torch.optim.AdamW's constructor checks that these arguments fail."""
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError(PREFIX + "lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError(PREFIX + "Tensor lr must be 1-element (`lr` must be a number or a one-element tensor, "
                             f"got shape {tuple(lr.shape)})")  # fmt: skip
    if _comparable(lr) and not 0.0 <= lr:  # (written as torch writes it: nan fails)
        raise ValueError(PREFIX + f"Invalid learning rate: {lr} (`lr` must be a finite number >= 0, got {_got(lr)})")
    if _comparable(eps) and not 0.0 <= eps:
        raise ValueError(PREFIX + f"Invalid epsilon value: {eps} (`eps` must be a finite number >= 0, got {_got(eps)})")
    pair = isinstance(betas, (tuple, list)) and len(betas) == 2
    if pair:
        for i, beta in enumerate(betas):
            if _comparable(beta) and not 0.0 <= beta < 1.0:
                raise ValueError(
                    PREFIX + f"Invalid beta parameter at index {i}: {beta} (`betas[{i}]` must be in [0, 1), got "
                    f"{_got(beta)})"
                )
    if _comparable(weight_decay) and not 0.0 <= weight_decay:
        raise ValueError(
            PREFIX + f"Invalid weight_decay value: {weight_decay} (`weight_decay` must be a finite number >= 0, got "
            f"{_got(weight_decay)})"
        )
    if pair:
        if not (
            all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)
        ):  # torch's test: ints are neither (betas=(0, 0) raises there too)
            raise ValueError(PREFIX + "betas must be either both floats or both Tensors")
        for i, beta in enumerate(betas):
            if isinstance(beta, torch.Tensor):
                if not capturable and foreach:
                    raise ValueError(
                        PREFIX + f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True"
                    )
                if beta.numel() != 1:
                    raise ValueError(
                        PREFIX + f"Tensor betas[{i}] must be 1-element (`betas[{i}]` must be a number or a one-element "
                        f"tensor, got shape {tuple(beta.shape)})"
                    )
    if fused:
        if differentiable:
            raise RuntimeError(PREFIX + "`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError(PREFIX + "`fused` and `foreach` cannot be `True` together.")
