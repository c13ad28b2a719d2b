"""zero_ext.memory.estimate against the ZeRO paper, and ZeroAdamW.memory_report() byte for byte."""

from fractions import Fraction

import pytest
import torch
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.memory import estimate, estimate_breakdown


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_estimate_reproduces_zero_paper_table_1(stage, expected_gb):
    # Rajbhandari et al. 2019, Table 1: 7.5B parameters on 64 data-parallel ranks, K = 12.
    assert round(estimate(7_500_000_000, 64, stage) / 1e9, 1) == expected_gb


def test_estimate_formulas_and_errors():
    psi, n = 1000, 8
    assert estimate(psi, n, 1) == 4 * psi + 12 * psi / n
    assert estimate(psi, n, 2) == 2 * psi + 14 * psi / n
    assert estimate(psi, 1, 0) == estimate(psi, 1, 3) == 16 * psi
    assert estimate(psi, n, 2, param_bytes=4, grad_bytes=4, optimizer_state_bytes=8) == 4 * psi + 12 * psi / n
    for args, match in [((-1, 2, 1), "num_params"), ((10, 0, 1), "world_size"), ((10, 2, 4), "stage")]:
        with pytest.raises(ValueError, match=match):
            estimate(*args)


def _covered(numel, ranges):
    mask = torch.zeros(numel, dtype=torch.bool)
    for a, b in ranges:
        assert not mask[a:b].any(), "overlapping ranges"
        mask[a:b] = True
    return int(mask.sum())


def _report(rank, world, stage, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    opt = ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=1500)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    report = opt.memory_report()

    # Every persistent tensor, found independently of memory_report().
    tensors, padding_elems = [], 0
    for fg, grad_buffer in zip(opt._flat_groups, opt._reducer.grad_buffers):
        full = [fg.param_buffer] + ([grad_buffer] if grad_buffer is not None else [])
        shards = [fg.exp_avg, fg.exp_avg_sq, fg.grad_shard] + ([fg.master] if fg.master is not None else [])
        real_full = _covered(fg.layout.numel, [(s.offset, s.offset + s.numel) for s in fg.layout.slots])
        real_shard = _covered(
            fg.layout.shard_numel,
            [(p.shard_offset, p.shard_offset + p.end - p.start) for p in fg.layout.owned_pieces(rank)],
        )
        padding_elems += sum(t.element_size() * (t.numel() - real_full) for t in full)
        padding_elems += sum(t.element_size() * (t.numel() - real_shard) for t in shards)
        tensors += full + shards
    # The pool: reduce-scatter inputs, outputs (when not written straight into the grad shard) and, on gloo with
    # more than one rank, the all-to-all receive buffers. One rank communicates nothing and stages nothing.
    staging = [t for e in opt._reducer.pool for t in (e.input, e.output, e.scratch) if t is not None]
    if opt._comm.world_size > 1 and not next(iter(opt.param_groups[0]["params"])).is_cuda:
        assert opt._reducer.pool and all(e.scratch is not None for e in opt._reducer.pool)
    if opt._comm.world_size == 1:
        assert staging == []
    allocated = sum(t.untyped_storage().nbytes() for t in tensors + staging)

    assert report.total == allocated
    assert report.padding == padding_elems
    assert report.staging == sum(t.untyped_storage().nbytes() for t in staging)
    assert (report.staging > 0) == (opt._comm.world_size > 1)
    assert report.total == report.formula + report.padding + report.staging + report.grad_shard_fp32
    expected_extra = report.owned_numel * (4 if stage == 1 else 4 - report.widths["grad_bytes"])
    assert report.grad_shard_fp32 == expected_extra
    return report.formula, report.owned_numel, report.num_params, report.widths, report.estimate


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_memory_report_byte_for_byte(world, stage, dtype):
    results = run_on_ranks(world, _report, stage, dtype)
    formulas, owned, psis, widths, estimates = zip(*results)
    psi = psis[0]
    assert sum(owned) == psi, "the ranks' shards must hold every real parameter element exactly once"
    # The formula's Psi/N is the average rank: the mean of the per-rank formulas is exactly the estimate.
    expected = sum(estimate_breakdown(psi, world, stage, **widths[0]).values())
    assert Fraction(sum(formulas), world) == expected
    assert estimates[0] == float(expected)
