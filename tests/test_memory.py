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


def _report(rank, world, stage, dtype_name, fp32_accumulation=False):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    accum = torch.float32 if fp32_accumulation else None
    opt = ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=1500, grad_accum_dtype=accum,
                    module=model if stage == 3 else None)  # fmt: skip
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    report = opt.memory_report()

    # Every persistent tensor, found independently of memory_report().
    state = opt.sharded_state
    tensors, padding_elems = [], 0
    for group in state.groups:
        kept = group.flat_params.tensors()
        if stage == 3:  # bf16: no param shard (each gather rounds the master); fp32: the shard is the master
            assert ("params" in kept) == (dtype == torch.float32)
        params = kept.get("params")  # the full flat buffer; at stage 3 the rank's shard of it, if kept
        full = ([params] if stage < 3 else []) + ([group.grad_buffer] if group.grad_buffer is not None else [])
        st = group.state
        shards = [*st.buffers.values(), st.grad]  # one buffer per kind of the update rule (no master for fp32)
        shards += [params] if stage == 3 and params is not None else []
        layout = group.layout
        real_full = _covered(layout.numel, [s.param_range for s in layout.slots])
        real_shard = _covered(layout.shard_numel, [p.shard_range for p in layout.owned_pieces(rank)])
        padding_elems += sum(t.element_size() * (t.numel() - real_full) for t in full)
        padding_elems += sum(t.element_size() * (t.numel() - real_shard) for t in shards)
        tensors += full + shards
    # The pool: reduce-scatter send buffers and the communicator's workspace (on gloo with more than one rank: the
    # all-to-all receive buffers). One rank communicates nothing and stages nothing.
    staging = state.staging.tensors()
    if state.world_size > 1:
        assert staging and state.staging.workspace_bytes > 0
    else:
        assert staging == []
    allocated = sum(t.untyped_storage().nbytes() for t in tensors + staging)

    assert report.total == allocated
    assert report.padding == padding_elems
    assert report.staging == sum(t.untyped_storage().nbytes() for t in staging)
    assert (report.staging > 0) == (state.world_size > 1)
    assert report.total == (
        report.formula + report.padding + report.staging + report.grad_shard_fp32 - report.param_shard_not_kept
    )
    if stage == 3 and dtype == torch.bfloat16:
        assert report.param_shard_not_kept == 2 * report.owned_numel
    else:
        assert report.param_shard_not_kept == 0
    expected_extra = report.owned_numel * (4 if stage == 1 else 4 - report.widths["grad_bytes"])
    if fp32_accumulation:  # an fp32 stage-1 grad buffer: 4 bytes per parameter where the formula counts 2
        expected_extra += report.num_params * (4 - report.widths["grad_bytes"])
    assert report.grad_shard_fp32 == expected_extra
    if stage == 3:  # the gathered window is not persistent: bounded, and within its bound so far
        every = sum(b.numel for g in state.groups for b in g.layout.buckets) * dtype.itemsize
        assert 0 < report.window_peak <= report.window_bound <= every
    return report.formula, report.owned_numel, report.num_params, report.widths, report.estimate


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
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


@pytest.mark.parametrize("world", [1, 2])
def test_memory_report_with_an_fp32_stage1_grad_buffer(world):
    run_on_ranks(world, _report, 1, "bfloat16", True)


def test_memory_report_prints_a_readable_table():
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), stage=2, bucket_size=1500)
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    text = str(opt.memory_report())
    for needle in ("B/param", "= ZeRO formula", "+ staging pool", "+ fp32 gradients beyond it", "KiB", "total"):
        assert needle in text, text
    assert "0.00 MiB" not in text  # units follow the size
