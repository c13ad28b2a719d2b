"""ZeroMuon's communication: DDP's volume. At stages 1 and 2 each step reduce-scatters and all-gathers every flat
group once (the owner layout's buckets carry whole matrices to their owners and back), so each rank passes 2 x
the padded flat numel per step, counted by ``comm_stats()``; with the default buckets the padding that evens the
owners' slices of a GPT's repeating blocks stays within a few percent of the matrices (a group of a handful of
matrices pads more: its slices cannot be even)."""

import pytest
import torch
from distributed import run_on_ranks
from muon_reference import ADAM, MUON
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroMuon
from zero_ext.owner_layout import OwnerLayout

STEPS = 3


def _counted(rank, world, stage):
    model = build(torch.float32, blocks=8)  # a GPT's repeating blocks: 32 matrices in one Muon group
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    groups = [{"params": matrices}, {"params": rest, "use_muon": False, **ADAM}]
    opt = ZeroMuon(groups, **MUON, stage=stage, module=model)  # default buckets
    for step in range(STEPS):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    c = opt.comm_stats()
    groups = opt.sharded_state.groups
    padded = sum(g.layout.numel for g in groups)
    real = sum(g.layout.real_numel for g in groups)
    muon = [g.layout for g in groups if isinstance(g.layout, OwnerLayout)]
    assert muon, "no owner layout"
    assert c["reduce_scatter_elements"] == STEPS * padded, c
    assert c["all_gather_elements"] == STEPS * padded, c
    return padded, real, sum(layout.numel for layout in muon), sum(layout.real_numel for layout in muon)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_ddp_volume(world, stage):
    padded, real, muon_padded, muon_real = run_on_ranks(world, _counted, stage)[0]
    # the owners' slices are even to within the bucket's alignment: a few percent of a GPT's matrices
    assert muon_padded <= 1.08 * muon_real + world * 64, (muon_padded, muon_real)
    assert padded <= 1.08 * real + 2 * world * 64 * 4, (padded, real)


def _stage3(rank, world, reshard):
    model = build(torch.float32, blocks=8)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    groups = [{"params": matrices}, {"params": rest, "use_muon": False, **ADAM}]
    opt = ZeroMuon(groups, **MUON, stage=3, module=model, bucket_size=4096, reshard_after_forward=reshard)
    padded = sum(g.layout.numel for g in opt.sharded_state.groups)
    for step in range(3):  # the first step learns the order; from the second on each bucket moves as planned
        before = opt.comm_stats()
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        c = {k: v - before[k] for k, v in opt.comm_stats().items()}
        if step == 0:
            continue
        assert c["reduce_scatter_elements"] == padded, c
        if reshard:  # forward, and backward again but for the buckets it needs first (kept from forward)
            assert padded < c["all_gather_elements"] < 2 * padded, (c, padded)
        else:  # gathered once, kept until its gradients are reduced: DDP's 2 Psi
            assert c["all_gather_elements"] == padded, (c, padded)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_volume(reshard):
    assert run_on_ranks(2, _stage3, reshard) == [True, True]
