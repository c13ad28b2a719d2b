"""``opt.named_full_params()``: every parameter whole, in the model's dtype, under every ``state_dict`` name (the tied
``head.weight`` and ``embed.weight`` both), at stages 1-3 and 1-2 ranks, offloaded or not; a fresh copy of the model
loads it with ``load_state_dict(strict=True)`` and computes the same outputs bit for bit. Stage 3 streams: while the
caller drops each tensor after use, at most one run of buckets (one bucket, or one split parameter) is alive beyond
the model's own storage, measured on this process's live storages."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import LiveStorages
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

BUCKET = 1500  # the tiny GPT's MLP weights (24 x 93 = 2232) are split across two buckets


def _make(stage, module=True, named=False):
    model = build(torch.bfloat16)
    params = model.named_parameters() if named else model.parameters()
    return model, ZeroAdamW(params, lr=3e-3, stage=stage, module=model if module else None, bucket_size=BUCKET)


def _train(model, opt, steps, rank):
    for step in range(steps):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def _stream(rank, world, stage, offloaded):
    model, opt = _make(stage)
    _train(model, opt, 2, rank)
    with opt.gathered_params():
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        tokens = batch(50, 0)[:, :-1]
        with torch.no_grad():
            logits = model(tokens)
    if offloaded:
        opt.offload_states()
    got = [(name, t.clone()) for name, t in opt.named_full_params()]
    names = [n for n, _ in got]
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))  # every key once, ties too
    for name, t in got:
        assert t.dtype == expected[name].dtype == torch.bfloat16 and t.shape == expected[name].shape
        assert torch.equal(t, expected[name]), name
    fresh = build(torch.bfloat16, seed=11)
    fresh.load_state_dict(dict(got), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), logits)
    opt.reload_states()
    return True


@pytest.mark.parametrize("offloaded", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_named_full_params_two_ranks(stage, offloaded):
    assert run_on_ranks(2, _stream, stage, offloaded) == [True, True]


@pytest.mark.parametrize("stage", [1, 3])
def test_named_full_params_one_rank(stage):
    assert run_on_ranks(1, _stream, stage, True) == [True]


def test_stage3_streams_one_run_at_a_time():
    model, opt = _make(3)
    _train(model, opt, 1, 0)
    layout = opt.sharded_state.groups[0].layout
    largest = max(run.numel for run in layout.runs) * 2  # bf16 bytes of the largest run (a split parameter's)
    assert any(len(run.buckets) > 1 for run in layout.runs)  # a split parameter is streamed whole
    total = sum(p.numel() for p in model.parameters()) * 2
    before = LiveStorages()
    peak = 0
    for name, t in opt.named_full_params():
        peak = max(peak, before.born_bytes())
        del t
    assert peak <= largest + 4096, (peak, largest, total)
    assert peak < total / 2  # not the whole model at once


class WithBuffer(torch.nn.Module):
    """A frozen parameter and a persistent buffer beside the trainable ones."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale + self.frozen


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_and_buffers(stage):
    torch.manual_seed(0)
    model = WithBuffer()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, module=model)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    params = dict(opt.named_full_params())
    assert sorted(params) == ["frozen", "lin.bias", "lin.weight"]
    whole = dict(opt.named_full_params(buffers=True))
    assert sorted(whole) == sorted(model.state_dict(keep_vars=True))  # (not the non-persistent buffer)
    fresh = WithBuffer()
    fresh.load_state_dict(whole, strict=True)
    x = torch.randn(2, 8)
    with opt.gathered_params(), torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_names_without_module():
    """Without module=: the optimizer's names, one each; the model passed here gives every state_dict name."""
    model, opt = _make(2, module=False, named=True)
    _train(model, opt, 1, 0)
    own = [n for n, _ in opt.named_full_params()]
    assert sorted(own) == sorted(n for n, _ in model.named_parameters())  # (head.weight is embed.weight: once)
    assert sorted(n for n, _ in opt.named_full_params(model)) == sorted(model.state_dict())
    with pytest.raises(ValueError, match="`module`"):
        next(iter(opt.named_full_params(torch.nn.Linear(2, 2))))


def test_training_unchanged_by_streaming():
    model, opt = _make(3)
    ref_model, ref = _make(3)
    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch(step, 0)).backward()
            o.step()
            o.zero_grad()
        for _ in opt.named_full_params():
            pass
    with opt.gathered_params(), ref.gathered_params():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert opt.comm_stats() == ref.comm_stats()  # (one rank: nothing communicated either way)


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_or_reload_between_items(stage):
    """The caller may offload (or reload) while iterating: each item is read from wherever its bytes are then."""
    model, opt = _make(stage)
    _train(model, opt, 1, 0)
    expected = [(n, t.clone()) for n, t in opt.named_full_params()]
    got = []
    for i, (name, t) in enumerate(opt.named_full_params()):
        got.append((name, t.clone()))
        if i == 2:
            opt.offload_states()
        if i == 6:
            opt.reload_states()
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
