"""The communicators on gloo: the all-to-all reduce-scatter (exact rank-order fp32 sums divided by N, pre-scaled
low-precision sums, overwrite or accumulate into the shard), several collectives in flight at once, argument
checks, the policy each backend answers, backend detection, and agreement with a deadline."""

import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks

import zero_ext.comm.nccl as comm_module
from zero_ext.comm import (
    CollectiveTimeout,
    GlooCommunicator,
    LocalCommunicator,
    backend_for,
    communicator_for,
    warn_if_blocking_wait,
)


def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # many exponents: sums that round
    return x.to(dtype)


def _mean_reference(world, rank, numel, grad_dtype, reduce_dtype):
    """Rank ``rank``'s slice of the mean as the communicator promises it: fp32 -> every input widened to fp32,
    added in rank order, divided by N once; low precision -> each input pre-scaled by 1/N and rounded, summed in
    the reduce dtype."""
    shard = numel // world
    parts = [_rank_input(r, numel, grad_dtype)[rank * shard : (rank + 1) * shard] for r in range(world)]
    if reduce_dtype == torch.float32:
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        return acc / world if world > 1 else acc
    acc = None
    for p in parts:
        scaled = (p.float() * (1.0 / world)).to(reduce_dtype)
        acc = scaled if acc is None else acc + scaled
    return acc.float()


def _reduce_scatter(rank, world, grad_name, reduce_name, accumulate):
    grad_dtype, reduce_dtype = getattr(torch, grad_name), getattr(torch, reduce_name)
    comm = GlooCommunicator(None, torch.device("cpu"))
    numel = world * 64 * 5
    wire = comm.wire_dtype(grad_dtype, reduce_dtype)
    x = (_rank_input(rank, numel, grad_dtype).float() * comm.prescale(grad_dtype, reduce_dtype)).to(wire)
    before = x.clone()
    out = torch.full((numel // world,), 0.25 if accumulate else float("nan"))
    workspace = torch.empty(comm.workspace_bytes(numel, wire, reduce_dtype, accumulate) + 7, dtype=torch.uint8)
    pending = comm.start_reduce_scatter(x, out, reduce_dtype=reduce_dtype, accumulate=accumulate, workspace=workspace)
    pending.wait()
    pending.wait()  # a second wait is a no-op
    if not accumulate:
        assert torch.equal(x, before), "the input was modified"
    expected = _mean_reference(world, rank, numel, grad_dtype, reduce_dtype)
    if accumulate:
        expected = torch.full_like(expected, 0.25) + expected
    assert torch.equal(out, expected)
    assert comm.counts.as_dict()["reduce_scatter_bytes"] == x.numel() * x.element_size()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    "grad_name,reduce_name",
    [("float32", "float32"), ("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "bfloat16")],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_reduce_scatter_is_the_rank_order_mean(world, grad_name, reduce_name, accumulate):
    assert all(run_on_ranks(world, _reduce_scatter, grad_name, reduce_name, accumulate))


def _many_in_flight(rank, world):
    """Four reduce-scatters in flight at once, each with its own workspace, waited for in reverse order."""
    comm = GlooCommunicator(None, torch.device("cpu"))
    numel = world * 64 * 3
    jobs = []
    for k in range(4):
        x = _rank_input(rank + 10 * k, numel, torch.float32)
        out = torch.empty(numel // world)
        workspace = torch.empty(comm.workspace_bytes(numel, torch.float32, torch.float32, False), dtype=torch.uint8)
        pending = comm.start_reduce_scatter(x, out, reduce_dtype=torch.float32, accumulate=False, workspace=workspace)
        jobs.append((k, out, pending))
    shard = numel // world
    for k, out, pending in reversed(jobs):
        pending.wait()
        parts = [_rank_input(r + 10 * k, numel, torch.float32)[rank * shard : (rank + 1) * shard] for r in range(world)]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        assert torch.equal(out, acc / world), f"collective {k}"


def test_reduce_scatters_in_flight_together():
    run_on_ranks(3, _many_in_flight)


def _bad_workspace(rank, world):
    comm = GlooCommunicator(None, torch.device("cpu"))
    x = torch.ones(world * 64)
    out = torch.empty(64)
    need = comm.workspace_bytes(world * 64, torch.float32, torch.float32, False)
    for workspace in (None, torch.empty(need - 1, dtype=torch.uint8), torch.empty(need // 4)):
        with pytest.raises(ValueError, match=f"`workspace` must be a uint8 buffer of at least {need} bytes"):
            comm.start_reduce_scatter(x, out, reduce_dtype=torch.float32, accumulate=False, workspace=workspace)
    assert comm.counts.as_dict()["reduce_scatter_bytes"] == 0, "a refused call was counted"
    # Both ranks refused locally before communicating: the group still works.
    ws = torch.empty(need, dtype=torch.uint8)
    comm.start_reduce_scatter(x, out, reduce_dtype=torch.float32, accumulate=False, workspace=ws).wait()
    assert torch.equal(out, torch.ones(64))
    return True


def test_reduce_scatter_rejects_a_missing_or_small_workspace():
    assert all(run_on_ranks(2, _bad_workspace))


def _accumulate_reuses_the_sent_buffer(rank, world):
    """Accumulating bf16 gradients needs no fp32 scratch shard: the sent buffer holds the sum once transferred."""
    comm = GlooCommunicator(None, torch.device("cpu"))
    numel = world * 64 * 4
    plain = comm.workspace_bytes(numel, torch.bfloat16, torch.float32, False)
    accumulating = comm.workspace_bytes(numel, torch.bfloat16, torch.float32, True)
    assert plain == accumulating == numel * 2  # just the receive buffer
    return True


def test_accumulate_needs_no_extra_workspace():
    assert all(run_on_ranks(2, _accumulate_reuses_the_sent_buffer))


def _policies(rank, world):
    gloo = GlooCommunicator(None, torch.device("cpu"))
    # fp32 mean: gradients travel in their own dtype, unscaled (summed in fp32 after the transfer).
    assert gloo.wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert gloo.prescale(torch.bfloat16, torch.float32) == 1.0
    # a low-precision mean: pre-scaled by 1/N so that the low-precision sum cannot overflow.
    assert gloo.wire_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert gloo.prescale(torch.float32, torch.bfloat16) == 1.0 / world
    assert gloo.buckets_per_model == 4 and gloo.communicates
    local = LocalCommunicator(torch.device("cpu"))
    assert not local.communicates and local.prescale(torch.bfloat16, torch.float32) == 1.0
    assert local.agree(7) == [7]
    chosen = communicator_for(None, torch.device("cpu"))
    assert isinstance(chosen, LocalCommunicator if world == 1 else GlooCommunicator)
    assert backend_for(None, torch.device("cpu")) == "gloo"
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_each_backend_answers_its_own_policy(world):
    assert all(run_on_ranks(world, _policies))


@pytest.mark.parametrize(
    "config,device,expected",
    [
        ("nccl", "cuda", "nccl"),
        ("gloo", "cuda", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cuda:nccl,cpu:gloo", "cpu", "gloo"),
    ],
)
def test_backend_is_read_per_device_type(monkeypatch, config, device, expected):
    """A group built as "cpu:gloo,cuda:nccl" (or by default) sends CUDA tensors to NCCL, CPU tensors to gloo."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert backend_for(None, torch.device(device)) == expected


def test_blocking_wait_warns_once(monkeypatch):
    monkeypatch.setattr(comm_module, "_warned_blocking_wait", False)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.warns(UserWarning, match="TORCH_NCCL_BLOCKING_WAIT is set"):
        assert warn_if_blocking_wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_blocking_wait()  # once only
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    monkeypatch.setattr(comm_module, "_warned_blocking_wait", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_blocking_wait()


def _agree_with_a_deadline(rank, world):
    """Rank 0 calls agree() alone: it gives up after the deadline instead of waiting for ever."""
    comm = GlooCommunicator(None, torch.device("cpu"))
    assert comm.agree(rank + 5, timeout=30) == [5 + r for r in range(world)]
    if rank == 0:
        with pytest.raises(CollectiveTimeout, match="within 0.5 s"):
            comm.agree(1, timeout=0.5)
    return True


def test_agree_times_out_when_a_rank_does_not_call():
    # The abandoned collective leaves the group unusable: this pool is thrown away afterwards.
    from distributed import discard_pool

    try:
        assert all(run_on_ranks(2, _agree_with_a_deadline))
    finally:
        discard_pool(2)
