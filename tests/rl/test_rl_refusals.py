"""While offloaded, every call that would read or write a parked byte fails with an error naming ``reload_states()``,
on every rank, and nothing changes: after the reload the run goes on bitwise as one that never tried. ``step()`` fails
on every rank even when only one rank offloaded (the step's agreement carries it), and so does ``checkpoint.save``."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from optimizer_snapshot import assert_same, snapshot
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.checkpoint import CheckpointError

RELOAD = r"reload_states\(\)"


def _make(stage):
    model = build(torch.bfloat16)
    return model, ZeroAdamW(model.parameters(), lr=3e-3, stage=stage, module=model, bucket_size=1500)


def _train(model, opt, steps, first=0, rank=0):
    for step in range(first, first + steps):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def _attempts(model, opt, tmp, rank):
    """Every refused call, each checked to raise naming reload_states()."""
    calls = {
        "step": opt.step,
        "clip_grad_norm_": lambda: opt.clip_grad_norm_(1.0),
        "zero_grad": opt.zero_grad,
        "finish_sync": opt.finish_sync,
        "state_dict": opt.state_dict,
        "opt.state": lambda: [opt.state[p]["exp_avg"] for p in opt.state],
        "add_param_group": lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}),
        "gathered_params": lambda: opt.gathered_params().__enter__(),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=RELOAD):
            call()
            pytest.fail(f"{what} did not raise")
    with pytest.raises(RuntimeError, match=RELOAD):
        opt.load_state_dict({"state": {}, "param_groups": opt.param_groups})
    with pytest.raises((RuntimeError, CheckpointError), match=RELOAD):
        checkpoint.save(os.path.join(tmp, "ck"), opt)
    assert not os.path.exists(os.path.join(tmp, "ck"))


def _refused(rank, world, stage, tmp):
    model, opt = _make(stage)
    ref_model, ref = _make(stage)
    _train(model, opt, 2, rank=rank)
    _train(ref_model, ref, 2, rank=rank)
    checkpoint.save(os.path.join(tmp, "good"), opt)  # for the refused load below
    opt.offload_states()
    _attempts(model, opt, tmp, rank)
    with pytest.raises((RuntimeError, CheckpointError), match=RELOAD):
        checkpoint.load(os.path.join(tmp, "good"), opt)
    # the forward: stages 1-2 with module= refuse it while the parameters are parked; stage 3's gathers refuse it
    with pytest.raises(RuntimeError, match=RELOAD):
        loss_fn(model, batch(5, rank))
    assert all(p.grad is None for p in model.parameters())
    opt.reload_states()
    # a backward reaching the gradient hooks: the parameters (stage 3: the master its gathers round) on the device
    opt.offload_states(include=["optim_states", "grads"] if stage < 3 else ["grads"])
    loss = loss_fn(model, batch(5, rank))
    with pytest.raises(RuntimeError, match=RELOAD):
        loss.backward()
    opt.reload_states()
    model.zero_grad()  # (autograd's own .grad of the refused backward; the optimizer's state is untouched)
    _train(model, opt, 2, first=2, rank=rank)
    _train(ref_model, ref, 2, first=2, rank=rank)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_refused_on_every_rank_nothing_changed(stage, tmp_path):
    assert run_on_ranks(2, _refused, stage, str(tmp_path), timeout=300) == [True, True]


def test_refused_alone(tmp_path):
    """One rank, stage 2: the same refusals (no collective to pair)."""
    assert run_on_ranks(1, _refused, 2, str(tmp_path)) == [True]


def _one_rank_offloaded(rank, world, stage, tmp):
    model, opt = _make(stage)
    ref_model, ref = _make(stage)
    _train(model, opt, 1, rank=rank)
    _train(ref_model, ref, 1, rank=rank)
    loss_fn(model, batch(1, rank)).backward()  # gradients waiting for the step
    loss_fn(ref_model, batch(1, rank)).backward()
    if rank == 0:
        opt.offload_states()
    errors = []
    for call in (opt.step, lambda: checkpoint.save(os.path.join(tmp, "ck"), opt)):
        with pytest.raises((RuntimeError, ValueError, CheckpointError)) as e:
            call()
        errors.append(str(e.value))
    if rank == 0:
        opt.reload_states()
    opt.step()
    opt.zero_grad()
    ref.step()
    ref.zero_grad()
    _train(model, opt, 1, first=2, rank=rank)
    _train(ref_model, ref, 1, first=2, rank=rank)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))
    return errors


def test_not_inside_gathered_params():
    model, opt = _make(3)
    _train(model, opt, 1)
    with opt.gathered_params():
        with pytest.raises(RuntimeError, match="offload_states: called while parameters are gathered"):
            opt.offload_states()
    assert set(opt.states_device().values()) == {"device"}
    opt.offload_states()
    opt.reload_states()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_offloaded_fails_every_rank(stage, tmp_path):
    errors = run_on_ranks(2, _one_rank_offloaded, stage, str(tmp_path), timeout=300)
    assert all("reload_states()" in e for e in errors[0])
    assert "failed on 1 other rank" in errors[1][0]  # the step's agreement
    assert "failed" in errors[1][1]  # the checkpoint's


def _no_sync_pending(rank, world, stage):
    """Gradients accumulated under no_sync() and not reduced yet: the offload issues no collective (rank 1 offloads
    alone, then both step), and the step after the reload reduces them as it would have."""
    model, opt = _make(stage)
    ref_model, ref = _make(stage)
    for m, o in ((model, opt), (ref_model, ref)):
        with o.no_sync():
            loss_fn(m, batch(0, rank)).backward()
    if rank == 1:
        before = opt.comm_stats()
        opt.offload_states()
        opt.reload_states()
        assert opt.comm_stats() == before  # nothing communicated
    for o in (opt, ref):
        o.step()
        o.zero_grad()
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))
    return True


def test_offload_is_collective_free_with_no_sync_gradients():
    assert run_on_ranks(2, _no_sync_pending, 1, timeout=120) == [True, True]
