"""The engine tests' model: a small GPT at odd sizes, so that buckets, shards and padding are uneven. Attributes:
``embed``, ``pos`` (learned positions, a parameter on the root), ``blocks``, ``ln_f``, ``head`` (weight tied to
``embed.weight``) and, with ``unused_branch=True``, ``extra`` (used only by ``forward(tokens, use_extra=True)``: its
params get no gradient otherwise).

The tests own this model: it is the benchmarks' GPT (bench/gpt_model.py) as it was when the tests stopped importing
it (``GPTConfig``'s defaults are the tests' odd sizes here), so that a change made for a benchmark cannot change
what the engine tests check, and the tests need nothing from bench/. ``GPT(GPTConfig(...))`` builds other sizes
(the stage-3 memory tests use larger ones)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ = 37, 24, 2, 9


@dataclass
class GPTConfig:
    vocab: int = VOCAB
    seq_len: int = SEQ
    d_model: int = DIM
    n_layers: int = 2
    n_heads: int = HEADS
    mlp_hidden: Optional[int] = None  # default 4 * d_model
    extra_branch: bool = False  # an ``extra`` Linear used only by forward(..., use_extra=True)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        hidden = c.mlp_hidden or 4 * c.d_model
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, hidden)
        self.out = nn.Linear(hidden, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Parameter(torch.empty(c.seq_len, c.d_model))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, counted once
        self.extra = nn.Linear(c.d_model, c.d_model) if c.extra_branch else None
        nn.init.normal_(self.pos, std=0.02)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2: scale the residual projections by 1/sqrt(2 * layers)
            nn.init.normal_(b.proj.weight, std=0.02 / math.sqrt(2 * c.n_layers))
            nn.init.normal_(b.out.weight, std=0.02 / math.sqrt(2 * c.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, use_extra: bool = False
    ) -> torch.Tensor:
        """Logits, or with ``targets`` the mean next-token cross-entropy (computed in fp32)."""
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        if use_extra and self.extra is not None:
            x = x + self.extra(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


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
