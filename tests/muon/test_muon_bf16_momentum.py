"""ZeroMuon with ``moment_dtype=torch.bfloat16``: the momentum buffer stored in bf16 with stochastic rounding keyed
on (seed, step, canonical element index): every stage and offload gives the same bits on 2 and 3 ranks (the
rounding does not depend on where an element lives: stage 3 and nvme lay the shards out differently), the run stays close to the fp32-momentum run, the buffer takes 2 bytes
per element, and checkpoints cross between the two settings."""

import math

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import offload_kwargs, params_digest
from muon_reference import MUON, MuonReference, distance, group_names, zero_muon_groups
from test_muon_parity import means_at, model_for
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


def _reference(round_momentum: bool) -> dict[str, torch.Tensor]:
    """The unsharded run (torch.optim.Muon + the AdamW kernel, one process, this machine's GEMMs), its Muon momentum
    rounded to nearest-even bf16 after every step or kept fp32: how far a bf16-sized momentum error moves the
    parameters in three steps through Newton-Schulz (bf16 GEMMs whose rounding depends on the CPU's instruction set)."""
    ref = MuonReference(model_for(torch.float32))
    for step in range(3):
        ref.step(means_at(ref, step, 1, torch.float32))
        if round_momentum:
            for state in ref.muon.state.values():
                state["momentum_buffer"].copy_(state["momentum_buffer"].bfloat16())
    return ref.master


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
    # Close to the fp32 momentum run by a bound computed here, not observed on one CPU (issue 46: a fixed
    # atol/rtol held on the AVX2 EPYC, and one element of 1728 broke it on the AVX-512-BF16 Xeon, whose bf16 GEMMs
    # round differently). The bound is the same run's distance when the momentum is rounded to nearest bf16
    # instead, on this machine's GEMMs: stochastic rounding's error has sqrt(2) times round-to-nearest's rms
    # (variance ulp^2/6 against ulp^2/12 over uniform fractions), so about 1.4x that distance is expected; 4x is
    # allowed. Per matrix whose momentum is stored in bf16 (first order: ratios 0.9-1.2 measured on AVX-512-BF16 and
    # oneDNN's AVX2 GEMMs), and over the whole model: the AdamW parameters move only through the gradients' second
    # order dependence on the matrices, 1e-5 against 1e-2, too small a signal to bound one by one. A tensor that
    # both references leave equal (frozen) stays bitwise equal.
    rounded, exact = _reference(True), _reference(False)
    names = [n for n, _ in model_for(torch.float32).named_parameters()]
    muon_matrices = set(sum(group_names(model_for(torch.float32))[:2], []))
    ours, theirs = [], []
    for name, a, b in zip(names, bf16, fp32):
        ours.append(distance(a, b))
        theirs.append(distance(rounded[name], exact[name]))
        if theirs[-1] == 0:
            assert torch.equal(a, b), f"{name}: the fp32 references leave it alone; the bf16 momentum moved it"
        elif name in muon_matrices:
            assert ours[-1] <= 4 * theirs[-1], (
                f"{name}: moved {ours[-1]:.3g} by the bf16 momentum, bound {4 * theirs[-1]:.3g}"
            )
    assert math.hypot(*ours) <= 4 * math.hypot(*theirs), (math.hypot(*ours), math.hypot(*theirs))


@pytest.mark.slow
def test_checkpoints_cross_momentum_dtypes(tmp_path):
    ck32, ck16 = str(tmp_path / "ck32"), str(tmp_path / "ck16")
    run_on_ranks(2, _run, 2, None, "float32", str(tmp_path), ck32)
    run_on_ranks(2, _run, 2, None, "bfloat16", str(tmp_path), ck16)
    # fp32 -> bf16 rounds the buffer to nearest even; bf16 -> fp32 widens exactly: both train on
    out = run_on_ranks(3, _run, 1, None, "bfloat16", str(tmp_path), None, ck32)
    back = run_on_ranks(1, _run, 3, "cpu", "float32", str(tmp_path), None, ck16)
    assert len({d for d, _ in out}) == 1 and back
