"""ZeroMuon with ``moment_dtype=torch.bfloat16``: the momentum buffer stored in bf16 with stochastic rounding keyed
on (seed, step, canonical element index): every stage and offload gives the same bits on 2 and 3 ranks (the
rounding does not depend on where an element lives: stage 3 and nvme lay the shards out differently), the run stays close to the fp32-momentum run, the buffer takes 2 bytes
per element, and checkpoints cross between the two settings."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs, params_digest
from muon_reference import MUON, zero_muon_groups
from test_muon_parity import model_for
from tiny_transformer import batch, loss_fn

from zero_ext import ZeroMuon, checkpoint
from zero_ext.owner_layout import OwnerLayout

WINDOW = 3 * 12 * 4096


def _run(rank, world, stage, offload, moment_dtype, root, save=None, load=None):
    model = model_for(torch.float32)
    opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=stage, module=model, bucket_size=1500,
                   moment_dtype=getattr(torch, moment_dtype), **offload_kwargs(offload, root, rank, f"s{stage}", WINDOW))  # fmt: skip
    if load is not None:
        checkpoint.load(load, opt)
    for step in range(3):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        checkpoint.save(save, opt)
    muon = [g for g in opt.sharded_state.groups if isinstance(g.layout, OwnerLayout)]
    if offload is None:
        assert all(g.state.buffers["momentum_buffer"].dtype == getattr(torch, moment_dtype) for g in muon)
    with opt.gathered_params():
        digest = params_digest(model)
        params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return digest, params


@pytest.mark.slow
def test_every_stage_offload_and_world_size_rounds_alike(tmp_path):
    root = str(tmp_path)
    for world, variants in {2: [(1, None), (2, "cpu"), (3, "nvme")], 3: [(1, "cpu"), (3, None)]}.items():
        digests = set()
        for stage, offload in variants:
            digests |= {d for d, _ in run_on_ranks(world, _run, stage, offload, "bfloat16", root)}
        assert len(digests) == 1, f"bf16 momentum rounds differently at some stage or offload on {world} ranks"
    bf16 = run_on_ranks(1, _run, 2, None, "bfloat16", root)[0][1]
    fp32 = run_on_ranks(1, _run, 2, None, "float32", root)[0][1]
    assert any(not torch.equal(a, b) for a, b in zip(bf16, fp32)), "the bf16 momentum changed nothing"
    for a, b in zip(bf16, fp32):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0.05)


@pytest.mark.slow
def test_checkpoints_cross_momentum_dtypes(tmp_path):
    ck32, ck16 = str(tmp_path / "ck32"), str(tmp_path / "ck16")
    run_on_ranks(2, _run, 2, None, "float32", str(tmp_path), ck32)
    run_on_ranks(2, _run, 2, None, "bfloat16", str(tmp_path), ck16)
    # fp32 -> bf16 rounds the buffer to nearest even; bf16 -> fp32 widens exactly: both train on
    out = run_on_ranks(3, _run, 1, None, "bfloat16", str(tmp_path), None, ck32)
    back = run_on_ranks(1, _run, 3, "cpu", "float32", str(tmp_path), None, ck16)
    assert len({d for d, _ in out}) == 1 and back
