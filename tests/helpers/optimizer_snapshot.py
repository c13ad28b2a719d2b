"""A bitwise snapshot of what an optimizer run holds, to compare two runs (or one run before and after a detour):
the full parameters (gathered at stage 3) and this rank's optimizer state, each tensor keyed by its parameter index
and kind."""

from __future__ import annotations

import torch


def snapshot(model: torch.nn.Module, opt) -> tuple[list[torch.Tensor], dict[tuple, torch.Tensor]]:
    """Copies of ``model``'s parameters (inside ``opt.gathered_params()``) and of every tensor in ``opt.state_dict()``."""
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    return params, {(i, k): v.clone() for i, s in sd["state"].items() for k, v in s.items() if torch.is_tensor(v)}


def assert_same(a, b) -> None:
    """Two snapshots equal bit for bit: the same parameters, the same state tensors under the same keys."""
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
