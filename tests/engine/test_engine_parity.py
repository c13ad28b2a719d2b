"""ZeroAdamW stages 1 and 2 against an unsharded torch.optim.AdamW fed the ranks' averaged gradients, on 1, 2
and 3 gloo ranks (3 makes the padding uneven), with bf16 and fp32 params."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import (
    FusedReference,
    check_against_reference,
    check_grad_shard_is_mean,
    mean_grads,
    params_digest,
    rank_grads,
    reference,
    set_mean_grads,
)
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm import GlooCommunicator
from zero_ext.layout import Range

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train(rank, world, dtype_name, steps, bucket_size, communicate_at_one_rank=False):
    return _train_both_stages(rank, world, getattr(torch, dtype_name), steps, bucket_size, communicate_at_one_rank)


def _train_both_stages(rank, world, dtype, steps, bucket_size, communicate_at_one_rank):
    runs = {}
    for stage in (1, 2):
        model = build(dtype)
        # One rank normally communicates nothing; a gloo communicator on the one-rank group runs the collectives.
        comm = GlooCommunicator(None, torch.device("cpu")) if communicate_at_one_rank else None
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=bucket_size, communicator=comm)
        runs[stage] = (model, opt)
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    fused = FusedReference(build(dtype), **HYPER)
    for step in range(steps):
        model1 = runs[1][0]
        per_rank = rank_grads(model1, list(model1.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        means = set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        fused.step(means)
        for model, opt in runs.values():
            loss_fn(model, batch(step, rank)).backward()
            check_grad_shard_is_mean(opt, means, rank)
            opt.step()
            opt.zero_grad()
        for model, opt in runs.values():
            check_against_reference(opt, model, ref_params, rank)
            # The gloo path's mean is exact (fp32 sum in rank order / N): sharding changes no bit.
            fused.check(opt, model)
        for (n, a), b in zip(runs[1][0].named_parameters(), runs[2][0].parameters()):
            assert torch.equal(a, b), f"stage 1 and stage 2 differ at step {step} in {n}"
        states = [opt.sharded_state for _, opt in runs.values()]
        for g1, g2 in zip(states[0].groups, states[1].groups):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                a, b = (g.state.read(kind, Range(0, g.layout.shard_numel)) for g in (g1, g2))
                assert torch.equal(a, b), f"stage 1 and 2 {kind} differ at step {step}"
    assert len(states[0].groups[0].layout.buckets) > 3, "the test wants several buckets"
    return params_digest(runs[1][0])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matches_unsharded_adamw(world, dtype):
    digests = run_on_ranks(world, _train, dtype, 10, 2000)
    assert len(set(digests)) == 1, "params differ between ranks"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_rank_through_the_collectives(dtype):
    """One rank normally skips communication; given a gloo communicator it runs the collectives (staging, the
    all-to-all, the rank-order sum) on the one-rank group."""
    run_on_ranks(1, _train, dtype, 4, 2000, True)


def _bf16_reduce(rank, world, stage):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=2000, reduce_dtype=torch.bfloat16)
    comm = opt.sharded_state.comm
    assert comm.prescale(torch.bfloat16, torch.bfloat16) == 1.0 / world  # bf16 sums are pre-scaled: no overflow
    for step in range(3):
        params = list(model.parameters())
        per_rank = rank_grads(model, params, [batch(step, r) for r in range(world)], loss_fn)
        loss_fn(model, batch(step, rank)).backward()
        opt.finish_sync()
        # Error bound: each grad is scaled by 1/N and rounded to bf16, then N - 1 bf16 additions round; each
        # rounding is at most half a bf16 ulp (2**-9 relative) of a value no larger than sum(|g|) / N.
        bound = [
            sum(g[i].float().abs() for g in per_rank) / world * (2 * world - 1) * 2.0**-9 for i in range(len(params))
        ]
        means = mean_grads(per_rank, params)
        for ref in opt.sharded_state.pieces():
            i, piece = ref.param_index, ref.piece
            mine = ref.group.state.read("grad", piece.shard_range)
            err = (mine - means[i].reshape(-1)[piece.start : piece.end]).abs()
            assert bool((err <= bound[i].reshape(-1)[piece.start : piece.end]).all()), f"parameter {ref.name}"
            assert mine.abs().sum() > 0
        opt.step()
        opt.zero_grad()
    return params_digest(model)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_dtype_bfloat16_is_the_mean_within_bf16_rounding(world, stage):
    assert len(set(run_on_ranks(world, _bf16_reduce, stage))) == 1


class _TwoDtypes(torch.nn.Module):
    """fp32 and bf16 parameters in one model: two flat groups whose gradients travel in different dtypes
    through the one staging pool."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inner = torch.nn.Linear(24, 40)  # fp32
        self.outer = torch.nn.Linear(40, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)).to(torch.bfloat16)).float()


def _two_dtypes_loss(model, b):
    x, y = b
    return torch.nn.functional.mse_loss(model(x), y)


def _two_dtypes_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)


def _two_dtypes(rank, world, stage):
    model = _TwoDtypes()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=256)
    assert sorted(str(g.dtype) for g in opt.sharded_state.groups) == ["torch.bfloat16", "torch.float32"]
    ref_params, ref_opt = reference(_TwoDtypes(), **HYPER)
    fused = FusedReference(_TwoDtypes(), **HYPER)
    for step in range(4):
        per_rank = rank_grads(
            model, list(model.parameters()), [_two_dtypes_batch(step, r) for r in range(world)], _two_dtypes_loss
        )
        means = set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        _two_dtypes_loss(model, _two_dtypes_batch(step, rank)).backward()
        check_grad_shard_is_mean(opt, means, rank)
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
        fused.step(means)
        fused.check(opt, model)
    return params_digest(model)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_and_bf16_params_in_one_model(world, stage):
    assert len(set(run_on_ranks(world, _two_dtypes, stage))) == 1
