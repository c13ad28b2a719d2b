"""``sync_module_states``: ranks that built their model from different seeds (``torch.manual_seed(1234 + rank)``,
the per-rank seeding many trainers use, DDP hiding it by broadcasting rank 0's weights) start from rank 0's
parameters (trainable and frozen), buffers and tied weights, and train as an unsharded torch.optim.AdamW started
from rank 0's weights does, at stages 1, 2 and 3; with False each rank keeps its own values."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_on_ranks
from engine_reference import params_digest
from torch import nn

from zero_ext import ZeroAdamW
from zero_ext.comm import communicator_for
from zero_ext.construction.module_sync import broadcast_from_rank0

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
VOCAB, DIM, SEED = 37, 24, 1234


class Net(nn.Module):
    """Tied embedding and head, a frozen layer and a buffer that scales the embeddings: a rank whose frozen layer,
    buffer or tied weight was not synchronised trains differently from the reference."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, tokens):
        h = self.embed(tokens) * self.scale
        return self.head(torch.tanh(self.proj(h)) + self.frozen(h))


def _build(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(100 * step + rank))


def _full(opt, stage):
    return opt.gathered_params() if stage == 3 else contextlib.nullcontext()


def _differing(model, expected) -> list[str]:
    ours = model.state_dict()
    return [key for key, value in expected.state_dict().items() if not torch.equal(ours[key], value)]


def _assert_same_state(model, expected, what: str) -> None:
    differ = _differing(model, expected)
    assert not differ, f"{what}: {differ} differ"


def _train(rank, world, stage, steps=4):
    model = _build(SEED + rank)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, module=model, bucket_size=600)
    rank0 = _build(SEED)
    with _full(opt, stage):
        differ = _differing(model, rank0)
    # Every rank fails together (rank 0 holds its own values whatever happened; it must not go on alone and wait).
    failed = torch.tensor([len(differ)])
    dist.all_reduce(failed)
    assert not failed.item(), f"rank {rank} after construction: {differ} differ from rank 0's (all ranks: {failed})"
    assert model.head.weight is model.embed.weight
    # The reference: torch's AdamW from rank 0's weights, on the mean of every rank's gradients.
    ref_opt = torch.optim.AdamW([p for p in rank0.parameters() if p.requires_grad], **HYPER)
    for step in range(steps):
        ref_opt.zero_grad()
        sum(_loss(rank0, _batch(step, r)) for r in range(world)).div(world).backward()
        ref_opt.step()
        _loss(model, _batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with _full(opt, stage):
            for (name, p), ref in zip(model.named_parameters(), rank0.parameters()):
                torch.testing.assert_close(p.detach(), ref.detach(), msg=lambda m: f"step {step} {name}: {m}")
            assert torch.equal(model.scale, rank0.scale) and torch.equal(model.frozen.weight, rank0.frozen.weight)
    with _full(opt, stage):
        return params_digest(model)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_start_from_rank0_and_match_adamw(world, stage):
    digests = run_on_ranks(world, _train, stage)
    assert len(set(digests)) == 1, "params differ between ranks"


def _unsynced(rank, world, stage):
    model = _build(SEED + rank)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, module=model, sync_module_states=False)
    with _full(opt, stage):
        if stage == 3:  # every rank gathers the others' shards of their own initialisations: a patchwork
            params = dict(model.named_parameters())
            assert not torch.equal(params["embed.weight"], _build(SEED).embed.weight)
        else:
            _assert_same_state(model, _build(SEED + rank), f"rank {rank} without sync")
        return params_digest(model), model.scale.sum().item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_false_skips_the_broadcast(stage):
    results = run_on_ranks(2, _unsynced, stage)
    assert len({scale for _, scale in results}) == 2, "ranks hold the same buffer without sync_module_states"
    if stage < 3:
        assert len({digest for digest, _ in results}) == 2, "ranks hold the same values without sync_module_states"


def _bad_value(rank, world, values):
    model = _build(SEED)
    with pytest.raises((ValueError, RuntimeError)) as e:
        ZeroAdamW(model.parameters(), module=model, sync_module_states=values[rank])
    return str(e.value)


def test_a_non_bool_fails_every_rank_naming_it():
    messages = run_on_ranks(2, _bad_value, ["yes", "yes"])
    assert all("`sync_module_states` must be True or False, got 'yes'" in m for m in messages), messages
    messages = run_on_ranks(2, _bad_value, [True, 1])  # one rank alone: the other learns which failed
    assert "`sync_module_states` must be True or False, got 1" in messages[1], messages
    assert "failed on rank(s) [1]" in messages[0], messages


def test_ranks_disagreeing_on_it_fail_every_rank():
    messages = run_on_ranks(2, _bad_value, [True, False])
    assert all("settings differ between ranks" in m for m in messages), messages


def _not_a_module(rank, world):
    model = _build(SEED)
    with pytest.raises(ValueError, match="`module` must be a torch.nn.Module"):
        ZeroAdamW(model.parameters(), module="model")


def test_a_refused_module_is_reported_not_listed():
    run_on_ranks(2, _not_a_module)


def _mixed_buckets(rank, world):
    torch.manual_seed(SEED + rank)
    base = torch.randn(6, 5)
    tensors = [base, torch.randn(7).bfloat16(), torch.randint(0, 9, (4,)), base.t()[1:], torch.randn(300)]
    expected = [t.clone() for t in tensors]
    own_column = base[:, 0].clone()  # outside the view: not sent, stays this rank's
    if rank != 0:
        torch.manual_seed(SEED)
        first = torch.randn(6, 5)
        expected = [first, torch.randn(7).bfloat16(), torch.randint(0, 9, (4,)), first.t()[1:], torch.randn(300)]
    # 64 bytes per bucket: the large vector travels alone and in place, the rest in several flat buckets, a
    # non-contiguous view through a flat copy.
    broadcast_from_rank0(communicator_for(None, torch.device("cpu")), tensors[1:], bucket_bytes=64)
    for i, (t, e) in enumerate(zip(tensors[1:], expected[1:])):
        assert t.dtype == e.dtype and torch.equal(t, e), f"tensor {i + 1} is not rank 0's"
    assert torch.equal(base[:, 0], own_column)


def test_broadcast_buckets_mixed_dtypes_and_views():
    run_on_ranks(3, _mixed_buckets)
