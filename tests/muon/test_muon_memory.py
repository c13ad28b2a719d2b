"""ZeroMuon's memory: the ledger (memory_report) counts what is really alive and its identity holds with Muon's
8 bytes of state per owned matrix element next to AdamW's 12; each rank holds Muon state for the matrices it owns
only; ``memory.estimate(muon_params=)`` and ``memory.muon_owner_bytes`` agree with what the engine builds."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import LiveStorages
from test_muon_parity import model_for, optimizer
from tiny_transformer import batch, loss_fn

from zero_ext import memory
from zero_ext.owner_layout import OwnerLayout


def _ledger(rank, world, stage, root):
    model = model_for(torch.bfloat16)
    before = LiveStorages()
    opt = optimizer(model, stage, None, root, rank, "mem")
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    report = opt.memory_report()
    assert report.optimizer == "ZeroMuon" and "whole matrices" in report.owners
    assert report.total == (
        report.formula + report.padding + report.staging + report.grad_shard_fp32 - report.param_shard_not_kept
    )
    # Muon state per rank: master and momentum of the matrices it owns (whole), padding included, nothing else
    muon = [g for g in opt.sharded_state.groups if isinstance(g.layout, OwnerLayout)]
    owned = sum(p.numel for g in muon for p in g.owned_pieces())
    assert owned == sum(p.numel() for g in muon for i, p in enumerate(g.params) if g.layout.owners[i] == rank)
    assert report.allocated["momentum_buffer"] == 4 * sum(g.layout.shard_numel for g in muon)
    # what is alive grew by no more than the ledger says (the model's own bf16 parameters were alive before)
    grown = before.born_bytes()
    assert grown <= report.total + 64 * 1024, (grown, report.total)
    opt.close()
    return owned


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ledger_counts_muon_state_on_owners_only(tmp_path, stage):
    owned = run_on_ranks(2, _ledger, stage, str(tmp_path))
    model = model_for(torch.bfloat16)
    matrices = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2
                   and p.requires_grad)  # fmt: skip
    assert sum(owned) == matrices and all(owned)


def test_estimate_knows_muon():
    psi, muon = 10_000, 6_000
    adamw_only = memory.estimate_breakdown(psi, 4, 2)["optimizer_states"]
    mixed = memory.estimate_breakdown(psi, 4, 2, muon_params=muon)["optimizer_states"]
    assert memory.MUON_STATE_BYTES == 8
    assert adamw_only - mixed == muon * (12 - 8) / 4
    with pytest.raises(ValueError, match="muon_params"):
        memory.estimate(psi, 4, 2, muon_params=psi + 1)


def test_owner_bytes_report_the_matrices_that_bound_the_balance():
    shapes = [(1024, 1024)] + [(64, 64)] * 6
    out = memory.muon_owner_bytes(shapes, 4, bucket_size=2**20)
    assert out["larger_than_average"] == [(1024, 1024)]
    assert max(out["owned_elements_per_rank"]) >= 1024 * 1024
    even = memory.muon_owner_bytes([(256, 256)] * 8, 4)
    assert even["cost_max_over_mean"] == 1.0 and even["larger_than_average"] == []
