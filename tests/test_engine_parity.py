"""ZeroAdamW stages 1 and 2 against an unsharded torch.optim.AdamW fed the ranks' averaged gradients, on 1, 2
and 3 gloo ranks (3 makes the padding uneven), with bf16 and fp32 params."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import (
    check_against_reference,
    check_grad_shard_is_mean,
    mean_grads,
    params_digest,
    rank_grads,
    reference,
)
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train(rank, world, dtype_name, steps, bucket_size):
    dtype = getattr(torch, dtype_name)
    runs = {}
    for stage in (1, 2):
        model = build(dtype)
        runs[stage] = (model, ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=bucket_size))
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    for step in range(steps):
        model1 = runs[1][0]
        per_rank = rank_grads(model1, list(model1.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        means = mean_grads(per_rank, ref_params)
        for p, g in zip(ref_params, means):
            p.grad = g
        ref_opt.step()
        for model, opt in runs.values():
            loss_fn(model, batch(step, rank)).backward()
            check_grad_shard_is_mean(opt, means, rank)
            opt.step()
            opt.zero_grad()
        for model, opt in runs.values():
            check_against_reference(opt, model, ref_params, rank)
        for (n, a), b in zip(runs[1][0].named_parameters(), runs[2][0].parameters()):
            assert torch.equal(a, b), f"stage 1 and stage 2 differ at step {step} in {n}"
        for fg1, fg2 in zip(runs[1][1]._flat_groups, runs[2][1]._flat_groups):
            if fg1.master is not None:
                assert torch.equal(fg1.master, fg2.master), f"stage 1 and 2 masters differ at step {step}"
    assert len(runs[1][1]._flat_groups[0].layout.buckets) > 3, "the test wants several buckets"
    return params_digest(runs[1][0])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matches_unsharded_adamw(world, dtype):
    digests = run_on_ranks(world, _train, dtype, 10, 2000)
    assert len(set(digests)) == 1, "params differ between ranks"
