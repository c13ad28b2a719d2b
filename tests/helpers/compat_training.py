"""A small model trained a few steps by ZeroAdamW on every rank and by torch.optim.AdamW on the mean gradients,
for the torch.optim conformance tests (tests/torch_compat/)."""

from __future__ import annotations

import torch

from zero_ext import ZeroAdamW

HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build(seed: int = 0) -> torch.nn.Module:
    """Four parameters of 35, 7, 21 and 3 elements: on 2 ranks each rank owns pieces of some and none of others."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def make(model: torch.nn.Module, stage: int, named: bool = True, **kw) -> ZeroAdamW:
    params = model.named_parameters() if named else model.parameters()
    return ZeroAdamW(params, **{**HYPER, **kw}, stage=stage, module=model)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(model: torch.nn.Module, opt, rank: int, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        model(_batch(step, rank)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def reference(world: int, steps: int, **kw) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """torch.optim.AdamW on the same model, fed the mean of every rank's gradient at each step."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **{**HYPER, **kw})
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            model(_batch(step, r)).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return model, opt
