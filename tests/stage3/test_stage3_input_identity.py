"""Stage 3 keeps a tensor passed to a module several times one tensor: ``attn(h, h, h)`` still sees ``query is key
is value`` (positional or keyword arguments), and a pure-bf16 model with nn.MultiheadAttention trains bitwise as at stage 2.

Stage 3 passes a module's inputs through an identity autograd function (its backward says the module's backward is
done, backward_hooks.py). It used to give each argument its own output, so ``attn(h, h, h)`` received three distinct
tensors: nn.MultiheadAttention then left its packed in-projection (one matmul for q, k and v, whose input gradient
is rounded to bf16 once) for three projections whose bf16 input gradients autograd sums, and the gradient reaching
the block's LayerNorm (and everything before it) differed from stage 2's in the last bit from the first step
(max |dparam| one bf16 ulp after two steps on a 2-block GPT)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_on_ranks
from engine_reference import params_digest

from zero_ext import ZeroAdamW

VOCAB, SEQ, DIM = 50, 12, 32


class Block(nn.Module):
    def __init__(self, keywords: bool):
        super().__init__()
        self.keywords = keywords
        self.ln = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.ln(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        if self.keywords:
            x = x + self.attn(h, key=h, value=h, attn_mask=mask, need_weights=False)[0]
        else:
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(keywords) for keywords in (False, True)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _record_identity(same: list):
    def hook(module, args, kwargs):
        q, k, v = (*args, kwargs.get("key"), kwargs.get("value"))[:3]  # attn(h, h, h) or attn(h, key=h, value=h)
        same.append(q is k is v)

    return hook


def _train(rank, world, stage):
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)  # pure bf16: no autocast, bf16 gradients
    opt = ZeroAdamW(model.parameters(), lr=3e-3, stage=stage, module=model)
    same = []  # what each MultiheadAttention call received (a hook after the engine's own pre-hooks)
    for block in model.blocks:
        block.attn.register_forward_pre_hook(_record_identity(same), with_kwargs=True)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (6, SEQ + 1), generator=g)
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params() if stage == 3 else torch.no_grad():
        digest = params_digest(model)
    opt.close()
    return all(same) and len(same) == 6, digest


def test_stage3_keeps_repeated_inputs_one_tensor_and_bf16_mha_bitwise_stage2():
    stage2 = run_on_ranks(2, _train, 2)
    stage3 = run_on_ranks(2, _train, 3)
    assert all(identity for identity, _ in stage2 + stage3), "attn(h, h, h) saw distinct tensors"
    assert len({digest for _, digest in stage2 + stage3}) == 1, "stage 3's bf16 params differ from stage 2's"
