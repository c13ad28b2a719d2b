"""Parameters split across buckets (issue 23): training with buckets smaller than the largest parameters gives the
same bits as with one bucket larger than every parameter, at every stage, offload setting and world size, and a
checkpoint saved with one bucket size loads with another. (The buffers' bounds: test_fragment_memory.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from distributed import run_on_ranks
from engine_reference import offload_kwargs

import zero_ext
from zero_ext import checkpoint

VOCAB, DIM, CLASSES = 300, 40, 100
SMALL, HUGE = 2000, 10**7  # SMALL splits the embedding (12000) and the head (4000) into 2-7 fragments each
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3


class VocabNet(nn.Module):
    """A vocabulary table and an output layer larger than a SMALL bucket, and a small layer between them."""

    def __init__(self, dtype):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.to(dtype)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.wte(idx)))).float()


def _build(dtype, stage, offload, bucket_size, root, rank, tag, seed=0):
    torch.manual_seed(seed)
    model = VocabNet(dtype)
    kw = offload_kwargs(offload, root, rank, tag, window=3 * 14 * 4096)
    opt = zero_ext.ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=bucket_size, module=model,
                             **kw)  # fmt: skip
    return model, opt


def _micro_batch(model, step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    idx = torch.randint(0, VOCAB, (5, 3), generator=g)
    y = torch.randn(5, 3, CLASSES, generator=g)
    ((model(idx) - y) ** 2).mean().backward()


def _train(model, opt, rank, steps=range(STEPS)):
    for s in steps:
        for micro in range(1 + s % 2):  # every other step accumulates two micro-batches
            _micro_batch(model, s, micro, rank)
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    """Full parameters, and this rank's state of every kind by (name, element range of the flattened parameter)."""
    with opt.gathered_params() if opt.stage == 3 else contextlib.nullcontext():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {}
    for ref in opt.sharded_state.pieces():
        for kind in ref.group.rule.kind_names:
            values = ref.group.state.read(kind, ref.piece.shard_range).float().clone()
            state.setdefault((ref.name, kind), []).append((ref.piece.start, ref.piece.end, values))
    return params, state


def _full_state(per_rank, model):
    """Every rank's pieces assembled into full flattened tensors {(name, kind): tensor}."""
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    full = {}
    for state in per_rank:
        for (name, kind), pieces in state.items():
            t = full.setdefault((name, kind), torch.full((sizes[name],), float("nan")))
            for start, end, values in pieces:
                t[start:end] = values
    return full


def _splits(opt) -> int:
    return sum(s.split for g in opt.sharded_state.groups for s in g.layout.slots)


def _same_bits_across_bucket_sizes(rank, world, root):
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for stage in (1, 2, 3):
            for offload in (None, "cpu", "nvme"):
                runs = []
                for bucket_size in (SMALL, HUGE):
                    tag = f"{dtype}-{stage}-{offload}-{bucket_size}"
                    model, opt = _build(dtype, stage, offload, bucket_size, root, rank, tag)
                    _train(model, opt, rank)
                    runs.append((_snapshot(model, opt), _splits(opt)))
                    opt.close()
                (small, split), (huge, none) = runs
                assert split == 2 and none == 0, (split, none)
                key = f"{dtype} stage {stage} offload={offload}"
                for name, p in small[0].items():
                    assert torch.equal(p, huge[0][name]), f"{key}: parameter {name} differs"
                out[key] = (small[1], huge[1])
    return out, {n: p.numel() for n, p in VocabNet(torch.float32).named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_split_parameters_train_to_the_same_bits_as_one_huge_bucket(world, tmp_path):
    results = run_on_ranks(world, _same_bits_across_bucket_sizes, str(tmp_path), timeout=600)
    model = VocabNet(torch.float32)
    for key in results[0][0]:
        small = _full_state([r[0][key][0] for r in results], model)
        huge = _full_state([r[0][key][1] for r in results], model)
        assert small.keys() == huge.keys()
        for k, t in small.items():
            assert not t.isnan().any(), f"{key} {k}: elements owned by no rank"
            assert torch.equal(t, huge[k]), f"{key}: {k} differs"


def _checkpoint_across_bucket_sizes(rank, world, root, saved_with, loaded_with, stage, offload):
    path = f"{root}/ckpt-{saved_with}-{stage}-{offload}"
    model, opt = _build(torch.bfloat16, stage, offload, saved_with, root, rank, "save")
    _train(model, opt, rank, range(2))
    checkpoint.save(path, opt)
    _train(model, opt, rank, range(2, STEPS + 1))
    expected = _snapshot(model, opt)[0]
    opt.close()
    # other weights: load must overwrite them
    model, opt = _build(torch.bfloat16, stage, offload, loaded_with, root, rank, "load", seed=1)
    checkpoint.load(path, opt)
    _train(model, opt, rank, range(2, STEPS + 1))
    got = _snapshot(model, opt)[0]
    opt.close()
    for name, p in expected.items():
        assert torch.equal(got[name], p), f"saved with bucket_size={saved_with}, loaded with {loaded_with}: {name}"
    return True


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload", [(1, None), (2, "cpu"), (3, None), (3, "nvme")])
@pytest.mark.parametrize("saved_with,loaded_with", [(SMALL, HUGE), (HUGE, SMALL)])
def test_a_checkpoint_saved_with_one_bucket_size_loads_with_another(saved_with, loaded_with, stage, offload, tmp_path):
    args = (str(tmp_path), saved_with, loaded_with, stage, offload)
    assert run_on_ranks(2, _checkpoint_across_bucket_sizes, *args, timeout=300) == [True, True]


def _local_state_dict_round_trip(rank, world, root):
    model, opt = _build(torch.bfloat16, 2, None, SMALL, root, rank, "sd")
    _train(model, opt, rank, range(2))
    sd = opt.state_dict()
    # a split parameter: one run per bucket on each of several ranks, one merged run on one rank
    entry = sd["state"][0]  # wte.weight
    ranges = entry["shard_ranges"] if world > 1 else [entry["shard_range"]]
    assert sum(e - s for s, e in ranges) == entry["exp_avg"].numel()
    other_model, other = _build(torch.bfloat16, 2, None, SMALL, root, rank, "sd2", seed=1)
    other.load_state_dict(sd)
    other_model.load_state_dict(model.state_dict())
    _train(model, opt, rank, range(2, 4))
    _train(other_model, other, rank, range(2, 4))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))


@pytest.mark.parametrize("world", [1, 2])
def test_local_state_dict_of_split_parameters_round_trips(world, tmp_path):
    assert all(run_on_ranks(world, _local_state_dict_round_trip, str(tmp_path)))
