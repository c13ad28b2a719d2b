"""The CUDA/NCCL paths no CPU test can reach, written for the first GPU run (scripts/gpu_session.sh runs them):
devices and streams the user chose, delayed side streams, the deferred all-gather on two GPUs, skip-on-inf and
clipping through NCCL, fp16 and mixed-dtype params, a bf16 mean, non-contiguous gradients, a device-tensor lr,
and process groups built the three usual ways. One GPU runs everything but the two-GPU tests."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_reference import check_against_reference, params_digest, rank_grads, reference, set_mean_grads
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm import NcclCommunicator

pytestmark = pytest.mark.cuda
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 GPUs, found {torch.cuda.device_count()}")


def _nccl(device="cuda"):
    return NcclCommunicator(None, torch.device(device))


def _train_against_reference(model, opt, dtype, steps=4, device="cuda", clip=None, stream=None, tokens_fn=None):
    """Train on CUDA and check every step against torch.optim.AdamW on fp32 CPU copies fed the same gradients."""
    ref_params, ref_opt = reference(build(dtype), **HYPER)
    for step in range(steps):
        tokens = batch(step, 0).to(device) if tokens_fn is None else tokens_fn(step)
        per_rank = rank_grads(model, list(model.parameters()), [tokens], loss_fn)
        set_mean_grads(ref_params, [[None if x is None else x.cpu() for x in per_rank[0]]])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_params, clip)
        ref_opt.step()
        if stream is None:
            loss_fn(model, tokens).backward()
        else:  # forward and backward on the user's stream, step() on the default one
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                loss_fn(model, tokens).backward()
            torch.cuda.current_stream().wait_stream(stream)
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, 0)


@pytest.mark.parametrize("through_nccl", [False, True], ids=["direct", "through_nccl"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_params(nccl_world, through_nccl, dtype):
    model = build(dtype).cuda()
    comm = _nccl() if through_nccl else None
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000, communicator=comm)
    _train_against_reference(model, opt, dtype)


class _TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inner = torch.nn.Linear(24, 40)
        self.outer = torch.nn.Linear(40, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)).to(torch.bfloat16)).float()


@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_fp32_and_bf16_groups_through_nccl(nccl_world, stage):
    model = _TwoDtypes().cuda()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=256, communicator=_nccl())
    ref = _TwoDtypes()
    ref_params, ref_opt = reference(ref, **HYPER)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)
        grads = torch.autograd.grad(torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()), list(model.parameters()))
        for p, gr in zip(ref_params, grads):
            p.grad = gr.float().cpu()
        ref_opt.step()
        torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_mean_through_nccl(nccl_world, stage):
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=2000, communicator=_nccl(),
                    reduce_dtype=torch.bfloat16)  # fmt: skip
    for step in range(3):
        loss_fn(model, batch(step, 0).cuda()).backward()
        opt.step()
        opt.zero_grad()
    assert opt.step_count == 3 and torch.isfinite(opt.grad_norm)
    assert opt.comm_stats()["reduce_scatter_bytes"] == 3 * sum(g.layout.numel for g in opt.sharded_state.groups) * 2


@pytest.mark.parametrize("stage", [1, 2])
def test_skip_on_inf_and_clipping_through_nccl(nccl_world, stage):
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=2000, max_grad_norm=0.05,
                    communicator=_nccl())  # fmt: skip
    _train_against_reference(model, opt, torch.bfloat16, steps=3, clip=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    (loss_fn(model, batch(9, 0).cuda()) * float("inf")).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and opt.step_count == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_non_contiguous_gradients(nccl_world):
    """A tensor hook hands autograd a transposed (non-contiguous) gradient; staging flattens it correctly."""
    model = build(torch.bfloat16).cuda()
    for p in model.parameters():
        if p.dim() == 2:
            p.register_hook(lambda g: g.t().contiguous().t())
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000, communicator=_nccl())
    _train_against_reference(model, opt, torch.bfloat16)


def test_lr_as_a_device_tensor_never_synchronises(nccl_world):
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), **{**HYPER, "lr": torch.tensor(HYPER["lr"], device="cuda")}, stage=2,
                    bucket_size=2000, communicator=_nccl())  # fmt: skip
    for step in range(3):
        loss_fn(model, batch(step, 0).cuda()).backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    opt.param_groups[0]["lr"].fill_(0.0)  # a schedule writing the tensor in place takes effect
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, batch(5, 0).cuda()).backward()
    opt.step()
    decayed = [p for p, b in zip(model.parameters(), before) if not torch.equal(p, b)]
    assert not decayed, "lr 0 moved a parameter"


def test_forward_on_the_users_stream_step_on_the_default_one(nccl_world):
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000, communicator=_nccl())
    _train_against_reference(model, opt, torch.bfloat16, stream=torch.cuda.Stream())


class SlowStreams(NcclCommunicator):
    """Sleeps on the side stream before every collective and before its epilogue (the accumulate into the grad
    shard): the stream ordering, not timing, must make the results right."""

    SLEEP_CYCLES = 20_000_000  # ~10 ms on an H100

    def _on_stream(self, stream, kind, collective, epilogue, tensors, bucket=None):
        def slow_collective():
            torch.cuda._sleep(self.SLEEP_CYCLES)
            return collective()

        def slow_epilogue():
            torch.cuda._sleep(self.SLEEP_CYCLES)
            if epilogue is not None:
                epilogue()

        return super()._on_stream(stream, kind, slow_collective, slow_epilogue, tensors, bucket)


@pytest.mark.parametrize("stage", [1, 2])
def test_delayed_side_streams_change_nothing(nccl_world, stage):
    digests = []
    for comm in (_nccl(), SlowStreams(None, torch.device("cuda"))):
        model = build(torch.bfloat16).cuda()
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=2000, communicator=comm,
                        defer_all_gather_to=model)  # fmt: skip
        for step in range(4):
            loss_fn(model, batch(step, 0).cuda()).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_sync()
        digests.append(params_digest(model.cpu()))
    assert digests[0] == digests[1]


@TWO_GPUS
@pytest.mark.parametrize("through_nccl", [False, True], ids=["direct", "through_nccl"])
def test_params_on_another_device_than_the_current_one(nccl_world, through_nccl):
    """Params on cuda:1 while cuda:0 is current: every launch and collective must follow the params."""
    torch.cuda.set_device(0)
    model = build(torch.bfloat16).to("cuda:1")
    comm = _nccl("cuda:1") if through_nccl else None
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000, communicator=comm)
    _train_against_reference(model, opt, torch.bfloat16, device="cuda:1")
    assert torch.cuda.current_device() == 0


HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")  # tests/helpers
_PG_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {helpers!r})
    from tiny_transformer import batch, build, loss_fn
    from zero_ext import ZeroAdamW
    from zero_ext.comm import NcclCommunicator, backend_for
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1")
    how = {how!r}
    if how == "default":
        dist.init_process_group()
    elif how == "mixed":
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    assert backend_for(None, torch.device("cuda")) == "nccl", dist.get_backend_config()
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), lr=1e-3, stage=2, bucket_size=2000,
                    communicator=NcclCommunicator(None, torch.device("cuda")))
    for step in range(3):
        loss_fn(model, batch(step, 0).cuda()).backward()
        opt.step()
        opt.zero_grad()
    assert opt.step_count == 3 and opt.comm_stats()["reduce_scatter_elements"] > 0
    dist.destroy_process_group()
    print("ok")
    """
)


@pytest.mark.parametrize("how", ["default", "mixed", "device_id"])
def test_process_group_built_three_ways(how):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = _PG_SCRIPT.format(helpers=HELPERS, port=port, how=how)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


_TWO_RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path[:0] = [{tests!r}, {helpers!r}]
    from test_engine_cuda_paths import SlowStreams
    from engine_reference import params_digest
    from tiny_transformer import batch, build, loss_fn
    from zero_ext import ZeroAdamW
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    digests = []
    for slow in (False, True):
        model = build(torch.bfloat16).cuda()
        comm = SlowStreams(None, torch.device("cuda", rank)) if slow else None
        opt = ZeroAdamW(model.named_parameters(), lr=3e-3, stage={stage}, bucket_size=2000, communicator=comm,
                        defer_all_gather_to=model if slow else None)
        for step in range(4):
            loss_fn(model, batch(step, rank).cuda()).backward()
            opt.step()
            opt.zero_grad()
        opt.finish_sync()
        digests.append(params_digest(model.cpu()))
    assert digests[0] == digests[1], "the deferred gather was read before it landed"
    dist.destroy_process_group()
    print("ok", digests[0])
    """
)


@TWO_GPUS
@pytest.mark.parametrize("stage", [1, 2])
def test_deferred_all_gather_on_two_gpus(stage, tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANK_SCRIPT.format(tests=os.path.dirname(__file__), helpers=HELPERS, stage=stage))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len({line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")}) == 1


@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_through_nccl_equals_stage2(nccl_world, reshard):
    """Stage 3 on one GPU through NCCL (gathers and frees on the all_gather stream) gives stage 2's parameters."""
    digests = []
    for stage in (2, 3):
        model = build(torch.bfloat16).cuda()
        kw = dict(reshard_after_forward=reshard) if stage == 3 else {}
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=1200, module=model,
                        communicator=_nccl(), **kw)  # fmt: skip
        for step in range(4):
            loss_fn(model, batch(step, 0).cuda()).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            digests.append(params_digest(model.cpu() if stage == 2 else _cpu_copy(model)))
    assert digests[0] == digests[1]


def _cpu_copy(model):
    copy = build(torch.bfloat16)
    copy.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    return copy


def test_stage3_training_step_never_synchronises(nccl_world):
    model = build(torch.bfloat16).cuda()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=3, bucket_size=1200, module=model, communicator=_nccl())
    for step in range(3):
        tokens = batch(step, 0).cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = loss_fn(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert opt.step_count == 3
