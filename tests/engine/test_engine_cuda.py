"""ZeroAdamW on CUDA (NCCL, world size 1: all one GPU allows): the same parity as on CPU, the Triton and CUDA
kernels in the loop, and no host synchronisation inside step()."""

import pytest
import torch
from engine_reference import check_against_reference, rank_grads, reference, set_mean_grads
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm import NcclCommunicator

pytestmark = pytest.mark.cuda
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _to_cuda(model):
    return model.to("cuda")


@pytest.fixture(params=[False, True], ids=["direct", "through_nccl"])
def one_rank_path(request):
    """One rank skips communication by default; ``through_nccl`` gives the optimizer an NCCL communicator on the
    one-rank group, so it takes the path several GPUs would (side streams, events, Triton cast_scale staging,
    reduce-scatter, accumulate)."""
    return (lambda: NcclCommunicator(None, torch.device("cuda"))) if request.param else (lambda: None)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_unsharded_adamw(nccl_world, one_rank_path, stage, dtype):
    model = _to_cuda(build(dtype))
    opt = ZeroAdamW(
        model.named_parameters(),
        **HYPER,
        stage=stage,
        bucket_size=2000,
        max_grad_norm=1.0,
        communicator=one_rank_path(),
    )
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    for step in range(8):
        tokens = batch(step, 0).cuda()
        per_rank = rank_grads(model, list(model.parameters()), [tokens], loss_fn)
        set_mean_grads(ref_params, [[g.cpu() for g in per_rank[0]]])
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref_opt.step()
        loss_fn(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_cuda_step_never_synchronises_with_the_host(nccl_world, one_rank_path, stage):
    model = _to_cuda(build(torch.bfloat16))
    opt = ZeroAdamW(
        model.named_parameters(),
        **HYPER,
        stage=stage,
        bucket_size=2000,
        max_grad_norm=1.0,
        communicator=one_rank_path(),
    )
    for step in range(3):
        loss_fn(model, batch(step, 0).cuda()).backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert opt.step_count == 3 and torch.isfinite(opt.grad_norm)


def test_cuda_nonfinite_gradient_skips_the_step(nccl_world):
    model = _to_cuda(build(torch.bfloat16))
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000)
    before = [p.detach().clone() for p in model.parameters()]
    (loss_fn(model, batch(0, 0).cuda()) * float("nan")).backward()
    opt.step()
    assert opt.skipped_steps == 1 and opt.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
