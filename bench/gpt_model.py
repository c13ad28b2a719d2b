"""The one GPT of this repository, built in code, and synthetic but learnable data for it: nothing is downloaded.

The model is the usual decoder-only transformer: token embedding (``embed``) + learned positions (``pos``, a
parameter on the root), pre-LayerNorm blocks (causal self-attention, GELU MLP), a final LayerNorm (``ln_f``) and an
LM head (``head``) whose weight is the token embedding's. The benchmarks train it at the main job's size
(``GPTConfig()``: ~3.3M params). ``extra_branch`` adds an ``extra`` Linear that only ``forward(..., use_extra=True)``
uses (its params get no gradient otherwise). The engine tests build this model too, at odd sizes
(tests/helpers/tiny_transformer.py), so a change here changes what they check: tests/tooling/test_gpt_model.py pins
the parameters they are built around.

The data is a fixed random Markov chain over the vocabulary, generated from a seed: every token has a few
successors with random probabilities, so the best achievable loss is the chain's entropy rate (printed by
the main job), well below the ln(vocab) of an untrained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 512
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: Optional[int] = None  # default 4 * d_model
    extra_branch: bool = False  # an ``extra`` Linear used only by forward(..., use_extra=True)


def add_model_args(parser) -> None:
    """The model-shape flags every benchmark shares (defaults: the main job's ~3.3M-param GPT)."""
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)


def model_config(args) -> GPTConfig:
    """The GPTConfig the flags of :func:`add_model_args` describe."""
    return GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)


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


def backward_first(model: GPT) -> list[nn.Module]:
    """The modules with parameters of their own in the order backward reaches them: the root (its output's gradient
    arrives first), then forward's order reversed (head, ln_f, the last block's out, fc, ln2, proj, qkv, ln1, ...,
    embed). Stage 3 keeps the first ``prefetch + 1`` buckets of these from forward into backward."""
    forward = [model.embed]
    for b in model.blocks:
        forward += [b.ln1, b.qkv, b.proj, b.ln2, b.fc, b.out]
    return [model, *reversed(forward + [model.ln_f, model.head])]


def num_params(model: nn.Module) -> int:
    """Trainable parameters, the tied embedding counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class MarkovData:
    """Token sequences from a fixed random Markov chain (``branching`` successors per token).

    ``batch(step)`` is a pure function of (seed, step): every recipe sees exactly the same global batch at
    the same step, and rank r of N takes rows [r * B/N, (r+1) * B/N).
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, branching: int = 4):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
        self.prob = torch.softmax(2.0 * torch.randn(vocab, branching, generator=g), dim=-1)

    def entropy_rate(self) -> float:
        """Nats per token of the best possible predictor (the chain's stationary conditional entropy)."""
        trans = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        trans.scatter_(1, self.succ, self.prob.double())
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(500):
            pi = pi @ trans
        pi = pi / pi.sum()
        h = -(self.prob.double() * self.prob.double().log()).sum(-1)
        return float((pi * h).sum())

    def batch(self, step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seqs = torch.empty(global_batch, self.seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(self.vocab, (global_batch,), generator=g)
        u = torch.rand(self.seq_len, global_batch, 1, generator=g)
        cdf = self.prob.cumsum(-1)
        for t in range(self.seq_len):
            cur = seqs[:, t]
            k = torch.searchsorted(cdf[cur], u[t]).clamp_(max=self.succ.shape[1] - 1)
            seqs[:, t + 1] = self.succ[cur].gather(1, k).squeeze(1)
        per = global_batch // world
        rows = seqs[rank * per : (rank + 1) * per]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
