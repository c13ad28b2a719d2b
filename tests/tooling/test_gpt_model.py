"""bench/gpt_model.py's GPT is also the tests' model: tests/helpers/tiny_transformer.py builds it at odd sizes, and
the engine tests choose their bucket sizes around its parameters (the largest, 2232 and 888 elements, split into
fragments by 500-element buckets or whole). A change made for a benchmark that changes the tiny model's parameters
fails here, instead of silently changing what the engine tests check. Its values follow torch's generator in GPT's
init order; the engine tests compare them bitwise between runs, they are not pinned here (torch's CPU normal_ may
differ in the last bit between instruction sets)."""

import torch
from tiny_transformer import build

BLOCK = [("ln1.weight", (24,)), ("ln1.bias", (24,)), ("qkv.weight", (72, 24)), ("qkv.bias", (72,)),
         ("proj.weight", (24, 24)), ("proj.bias", (24,)), ("ln2.weight", (24,)), ("ln2.bias", (24,)),
         ("fc.weight", (93, 24)), ("fc.bias", (93,)), ("out.weight", (24, 93)), ("out.bias", (24,))]  # fmt: skip


def test_the_tiny_model_keeps_its_parameters():
    model = build(torch.bfloat16, unused_branch=True)
    expected = [("pos", (9, 24)), ("embed.weight", (37, 24))]
    expected += [(f"blocks.{i}.{n}", shape) for i in range(2) for n, shape in BLOCK]
    expected += [("ln_f.weight", (24,)), ("ln_f.bias", (24,)), ("extra.weight", (24, 24)), ("extra.bias", (24,))]
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == expected
    assert model.head.weight is model.embed.weight  # tied: one parameter
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert len(list(build().parameters())) == len(expected) - 2  # the extra branch only when asked for
