"""zero_ext.memory.estimate against the ZeRO paper, and ZeroAdamW.memory_report() byte for byte."""

from fractions import Fraction

import pytest
import torch
from distributed import run_on_ranks
from pairwise import pairwise_params
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, memory
from zero_ext.memory import INT8_BLOCK, estimate, estimate_breakdown, moment_bytes, state_bytes_per_element
from zero_ext.update.adamw import AdamW
from zero_ext.update.blockwise_int8 import BLOCK


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


def test_estimate_docstring_examples():
    import doctest

    assert doctest.testmod(memory.formula, raise_on_error=True).attempted >= 2  # estimate()'s examples


@pytest.mark.parametrize(
    "remainders,moments,k",
    [(False, torch.float32, 12), (True, torch.float32, 10), (False, torch.bfloat16, 8), (True, torch.bfloat16, 6),
     (False, torch.int8, 4 + 2 * (1 + Fraction(4, 64))), (True, torch.int8, 2 + 2 * (1 + Fraction(4, 64)))],
)  # fmt: skip
def test_state_bytes_per_element_by_precision(remainders, moments, k):
    assert INT8_BLOCK == BLOCK  # the int8 kernels' block
    rule = AdamW(torch.bfloat16, param_remainders=remainders, moment_dtype=moments)  # the widths the rule stores
    assert rule.bytes_per_element() == k
    assert state_bytes_per_element(param_remainders=remainders, moment_dtype=moments) == k
    assert state_bytes_per_element(param_remainders=remainders, moment_dtype=moments, amsgrad=True) == (
        k + moment_bytes(moments)
    )
    psi, n = 6400, 8
    assert estimate(psi, n, 1, param_remainders=remainders, moment_dtype=moments) == 4 * psi + k * psi / n
    assert estimate(psi, n, 3, param_remainders=remainders, moment_dtype=moments) == (4 + k) * psi / n
    # What the engine keeps: an fp32 gradient shard; at stage 3 the bf16 shard only where it is half the master.
    kept = estimate_breakdown(psi, n, 3, param_remainders=remainders, moment_dtype=moments, engine=True)
    assert kept == {"params": 2 * psi / n if remainders else 0, "grads": 4 * psi / n, "optimizer_states": k * psi / n}
    kept1 = estimate_breakdown(psi, n, 1, param_remainders=remainders, moment_dtype=moments, engine=True)
    assert kept1 == {"params": 2 * psi, "grads": 2 * psi + 4 * psi / n, "optimizer_states": k * psi / n}


def test_estimate_precision_errors():
    with pytest.raises(ValueError, match="moment_dtype must be torch.float32, torch.bfloat16 or torch.int8"):
        estimate(10, 2, 1, moment_dtype=torch.float16)
    with pytest.raises(ValueError, match="optimizer_state_bytes .* or moment_dtype, not both"):
        estimate(10, 2, 1, optimizer_state_bytes=8, moment_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="engine=True describes ZeroAdamW: stage must be 1, 2 or 3"):
        estimate(10, 2, 0, engine=True)


def _covered(numel, ranges):
    mask = torch.zeros(numel, dtype=torch.bool)
    for a, b in ranges:
        assert not mask[a:b].any(), "overlapping ranges"
        mask[a:b] = True
    return int(mask.sum())


def _report(rank, world, stage, dtype_name, fp32_accumulation=False, remainders=False, moments="float32"):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    accum = torch.float32 if fp32_accumulation else None
    lean = {"moment_dtype": getattr(torch, moments)} if moments != "float32" else {}
    opt = ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=1500, grad_accum_dtype=accum,
                    param_remainders=remainders, module=model if stage == 3 else None, **lean)  # fmt: skip
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    report = opt.memory_report()

    # Every persistent tensor, found independently of memory_report().
    state = opt.sharded_state
    tensors, padding_elems = [], 0
    for group in state.groups:
        kept = group.flat_params.tensors()
        if stage == 3:  # bf16: no param shard (each gather rounds the master); fp32: the shard is the master;
            # remainders: the bf16 shard is the master's high half
            assert ("params" in kept) == (dtype == torch.float32 or remainders)
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
    staging = opt.bucket_runtimes.staging.tensors()
    if state.world_size > 1:
        assert staging and opt.bucket_runtimes.staging.workspace_bytes > 0
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
    if stage == 3 and dtype == torch.bfloat16 and not remainders:
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
    kept = allocated - report.padding - report.staging  # the live storages, less padding and the bounded pool
    return report.formula, report.owned_numel, report.num_params, report.widths, report.estimate, kept


# World size, stage and the dtype settings act independently on the report: every pair of their values (15 runs of
# the 45 combinations, tests/helpers/pairwise.py).
REPORT_AXES = {
    "world": [1, 2, 3],
    "stage": [1, 2, 3],
    "dtype": ["bfloat16", "float32", "bfloat16-remainders", "bfloat16-bf16moments", "bfloat16-remainders-bf16moments"],
}


@pytest.mark.parametrize("world,stage,dtype", pairwise_params(REPORT_AXES))
def test_memory_report_byte_for_byte(world, stage, dtype):
    remainders = "-remainders" in dtype
    moments = torch.bfloat16 if dtype.endswith("-bf16moments") else torch.float32
    results = run_on_ranks(world, _report, stage, dtype.split("-")[0], False, remainders, str(moments)[6:])
    formulas, owned, psis, widths, estimates, kept = zip(*results)
    psi = psis[0]
    assert sum(owned) == psi, "the ranks' shards must hold every real parameter element exactly once"
    # The formula's Psi/N is the average rank: the mean of the per-rank formulas is exactly the estimate.
    expected = sum(estimate_breakdown(psi, world, stage, **widths[0]).values())
    assert Fraction(sum(formulas), world) == expected
    assert estimates[0] == float(expected)
    # estimate(engine=True) is what the ranks really hold on average (live storages), padding and staging aside.
    engine = estimate_breakdown(psi, world, stage, param_remainders=remainders, engine=True, **widths[0])
    assert Fraction(sum(kept), world) == sum(engine.values()), (kept, engine)
    # The ledger's width is the update rule's, and the formula's: 12, 10 (remainders), 8 (bf16), 6 (both).
    if dtype.startswith("bfloat16"):  # (fp32 params are their own master: 8)
        k = state_bytes_per_element(param_remainders=remainders, moment_dtype=moments)
        assert widths[0]["optimizer_state_bytes"] == k == 12 - 2 * remainders - 4 * (moments == torch.bfloat16)


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
