"""A GPT laid out as nanoGPT's model.py is (``transformer = ModuleDict(wte, wpe, drop, h=ModuleList(blocks), ln_f)``,
``lm_head`` tied to ``wte``), at tests/helpers/tiny_transformer.py's odd sizes, and nanoGPT's loop around it:
evaluation and sampling every few steps. The layout matters to stage 3: the blocks sit in a ModuleList inside a
ModuleDict, which the root iterates without calling, and at inference the head reads only the last position.

``head="functional"`` applies the tied head as ``F.linear(x, self.transformer.wte.weight)`` (a module reading a
weight it does not own, gathered on demand the first time)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_transformer import HEADS, SEQ, VOCAB

DIM = 24


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for y in self.c_attn(self.ln_1(x)).split(c, dim=2))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, hidden=(4 * DIM - 3, 4 * DIM - 3), head: str = "linear"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(SEQ, DIM), drop=nn.Dropout(0.0),
            h=nn.ModuleList(Block(DIM, HEADS, w) for w in hidden), ln_f=nn.LayerNorm(DIM),
        ))  # fmt: skip
        self.head = head
        if head == "linear":
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's tie

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.head == "linear":
            return self.lm_head(x)
        return F.linear(x, self.transformer.wte.weight)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits (nanoGPT's "mini-optimization")
            return self._logits(x[:, [-1], :]), None
        logits = self._logits(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(seed: int = 0, **kw) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(**kw)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """nanoGPT's sampling loop, greedy (so that runs compare token for token): the sequence grows by one each call."""
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -SEQ:])
        idx = torch.cat([idx, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    return idx
