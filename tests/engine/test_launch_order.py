"""Buckets launch in the order backward completes them, whatever the param groups. With the usual decay / no-decay
split (every layer's norms and biases in one small group) or ZeroMuon's matrices / rest split, one bucket holds
parameters of every layer and completes only when backward reaches the first layer. Keyed by its latest-registered
parameter it launched first and held back every other bucket's reduce-scatter to the end of backward, each keeping
its staging entry: the pool grew to one entry per bucket (stage 2 then held the whole gradient in the wire dtype:
15 MiB instead of 6 on the main job's GPT, 17.5 instead of 5 for ZeroMuon). Keyed by its earliest parameter (when
it completes), the pool stays at its ``staging_buffers`` entries."""

import pytest
import torch
from distributed import run_on_ranks
from muon_reference import zero_muon_groups
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, ZeroMuon


def _decay_groups(model) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _pool(rank, world, stage, rule):
    model = build(torch.bfloat16)
    if rule == "adamw":
        opt = ZeroAdamW(_decay_groups(model), lr=1e-3, stage=stage, module=model, bucket_size=1500)
    else:
        opt = ZeroMuon(zero_muon_groups(model), lr=0.02, stage=stage, module=model, bucket_size=1500)
    for step in range(2):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    pool = opt.bucket_runtimes.staging
    out = len(pool.entries), pool.capacity, len(opt.bucket_runtimes)
    opt.close()
    return out


@pytest.mark.parametrize("rule", ["adamw", "muon"])
@pytest.mark.parametrize("stage", [2, 3])
def test_the_staging_pool_keeps_its_entries_with_a_group_spanning_every_layer(stage, rule):
    for entries, capacity, buckets in run_on_ranks(2, _pool, stage, rule):
        assert buckets >= capacity + 3  # enough buckets that waiting behind one would grow the pool
        assert entries == capacity, f"{entries} staging entries for {buckets} buckets (capacity {capacity})"
