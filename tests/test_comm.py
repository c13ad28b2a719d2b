"""Communicator on gloo: the all-to-all reduce-scatter (exact rank-order sums, optional division, a wider output
dtype), several collectives in flight at once, and its argument checks."""

import pytest
import torch
from distributed import run_on_ranks

from zero_ext.comm import Communicator


def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # many exponents: sums that round
    return x.to(dtype)


def _reference(world: int, rank: int, numel: int, in_dtype, out_dtype, divide_by: int) -> torch.Tensor:
    """Rank ``rank``'s slice of sum(inputs) / divide_by: each input cast to out_dtype, added in rank order."""
    shard = numel // world
    acc = None
    for r in range(world):
        part = _rank_input(r, numel, in_dtype)[rank * shard : (rank + 1) * shard].to(out_dtype)
        acc = part if acc is None else acc + part
    return acc / divide_by if divide_by != 1 else acc


def _reduce_scatter(rank, world, in_name, out_name, divide_by):
    in_dtype, out_dtype = getattr(torch, in_name), getattr(torch, out_name)
    comm = Communicator(None, torch.device("cpu"))
    assert comm.reduce_scatter_by_all_to_all == (world > 1)
    numel = world * 64 * 5
    x = _rank_input(rank, numel, in_dtype)
    before = x.clone()
    out = torch.full((numel // world,), float("nan"), dtype=out_dtype)
    scratch = torch.empty(comm.scratch_numel(numel) + 7, dtype=in_dtype)  # larger than needed is fine
    then_ran = []
    kwargs = dict(scratch=scratch, divide_by=divide_by) if world > 1 else {}
    if world == 1 and in_dtype != out_dtype:
        # One rank takes torch's reduce-scatter, which sums in the input dtype: a wider output is refused.
        with pytest.raises(ValueError, match="`output` must have the dtype of `input`"):
            comm.reduce_scatter(out, x)
        assert comm.counts.as_dict()["reduce_scatter_bytes"] == 0
        return
    pending = comm.reduce_scatter(out, x, then=lambda: then_ran.append(out.clone()), **kwargs)
    pending.wait()
    pending.wait()  # a second wait is a no-op (the callback ran once)
    assert torch.equal(x, before), "the input was modified"
    assert len(then_ran) == 1 and torch.equal(then_ran[0], out), "`then` ran before the result was complete"
    expected = _reference(world, rank, numel, in_dtype, out_dtype, divide_by if world > 1 else 1)
    assert torch.equal(out, expected)
    assert comm.counts.as_dict()["reduce_scatter_bytes"] == x.numel() * x.element_size()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    "in_name,out_name,divide_by",
    [("float32", "float32", 1), ("float32", "float32", 3), ("bfloat16", "float32", 2), ("float16", "float32", 1)],
)
def test_reduce_scatter_is_the_rank_order_sum(world, in_name, out_name, divide_by):
    run_on_ranks(world, _reduce_scatter, in_name, out_name, divide_by)


def _many_in_flight(rank, world):
    """Four reduce-scatters in flight at once, each with its own scratch, waited for in reverse order."""
    comm = Communicator(None, torch.device("cpu"))
    numel = world * 64 * 3
    jobs = []
    for k in range(4):
        x = _rank_input(rank + 10 * k, numel, torch.float32)
        out = torch.empty(numel // world)
        scratch = torch.empty(comm.scratch_numel(numel))
        jobs.append((k, out, comm.reduce_scatter(out, x, scratch=scratch)))
    for k, out, pending in reversed(jobs):
        pending.wait()
        shard = numel // world
        expected = sum(
            _rank_input(r + 10 * k, numel, torch.float32)[rank * shard : (rank + 1) * shard] for r in range(world)
        )
        assert torch.equal(out, expected), f"collective {k}"


def test_reduce_scatters_in_flight_together():
    run_on_ranks(3, _many_in_flight)


def _bad_scratch(rank, world):
    comm = Communicator(None, torch.device("cpu"))
    x = torch.ones(world * 64)
    out = torch.empty(64)
    for scratch in (None, torch.empty(world * 64 - 1), torch.empty(world * 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="`scratch` must be a torch.float32 buffer of at least"):
            comm.reduce_scatter(out, x, scratch=scratch)
    assert comm.counts.as_dict()["reduce_scatter_bytes"] == 0, "a refused call was counted"
    # Both ranks refused locally before communicating: the group still works.
    comm.reduce_scatter(out, x, scratch=torch.empty(world * 64)).wait()
    assert torch.equal(out, torch.full((64,), float(world)))


def test_reduce_scatter_rejects_a_missing_or_small_scratch():
    run_on_ranks(2, _bad_scratch)


def _output_over_input(rank, world):
    """Stage 2's use: the fp32 result written over the (bf16) input it was computed from."""
    comm = Communicator(None, torch.device("cpu"))
    numel = world * 64 * 4
    raw = torch.empty(numel * 2, dtype=torch.uint8)
    x = raw.view(torch.bfloat16)
    x.copy_(_rank_input(rank, numel, torch.bfloat16))
    out = raw.view(torch.float32)[: numel // world]
    comm.reduce_scatter(out, x, scratch=torch.empty(numel, dtype=torch.bfloat16), divide_by=world).wait()
    assert torch.equal(out, _reference(world, rank, numel, torch.bfloat16, torch.float32, world))


def test_reduce_scatter_output_may_overlap_its_input():
    run_on_ranks(3, _output_over_input)
