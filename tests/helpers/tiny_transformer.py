"""The engine tests' model: the benchmarks' GPT (bench/gpt_model.py, the one GPT of this repository) at odd sizes,
so that buckets, shards and padding are uneven. Attributes: ``embed``, ``pos`` (learned positions, a parameter on the
root), ``blocks``, ``ln_f``, ``head`` (weight tied to ``embed.weight``) and, with ``unused_branch=True``, ``extra``
(used only by ``forward(tokens, use_extra=True)``: its params get no gradient otherwise).

``build`` seeds torch's generator and builds the model in bench/gpt_model.py's init order, so what the tests check
depends on that order: tests/tooling/test_gpt_model.py pins the model's shape at these sizes. ``GPT(GPTConfig(...))``
builds other sizes (the stage-3 memory tests use larger ones; they name every size, not bench's defaults)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # gpt_model, as bench's scripts import it
from gpt_model import GPT, GPTConfig  # noqa: E402

VOCAB, DIM, HEADS, SEQ = 37, 24, 2, 9


def build(dtype: torch.dtype = torch.float32, seed: int = 0, *, blocks: int = 2, unused_branch: bool = False) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(VOCAB, SEQ, DIM, blocks, HEADS, mlp_hidden=4 * DIM - 3, extra_branch=unused_branch)
    return GPT(config).to(dtype)


def batch(step: int, sample: int, size: int = 2) -> torch.Tensor:
    """Tokens for one data-parallel rank: a function of (step, sample) only."""
    g = torch.Generator().manual_seed(1000 * step + sample)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor, **kw) -> torch.Tensor:
    logits = model(tokens[:, :-1], **kw)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
