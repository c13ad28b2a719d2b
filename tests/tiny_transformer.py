"""A small transformer-like model for engine tests: embedding, layernorms, attention and MLP linears, and an
LM head tied to the embedding. Odd sizes so that buckets, shards and padding are uneven."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ = 37, 24, 2, 9


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM - 3)
        self.out = nn.Linear(4 * DIM - 3, DIM)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, blocks: int = 2, unused_branch: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        # A branch only used when forward(use_extra=True): its params get no gradient otherwise.
        self.extra = nn.Linear(DIM, DIM) if unused_branch else None

    def forward(self, tokens, use_extra: bool = False):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        if use_extra and self.extra is not None:
            x = x + self.extra(x)
        return self.head(self.ln_f(x))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kw).to(dtype)


def batch(step: int, sample: int, size: int = 2) -> torch.Tensor:
    """Tokens for one data-parallel rank: a function of (step, sample) only."""
    g = torch.Generator().manual_seed(1000 * step + sample)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor, **kw) -> torch.Tensor:
    logits = model(tokens[:, :-1], **kw)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
