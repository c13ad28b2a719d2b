"""``offload_states()`` / ``reload_states()`` / ``states_device()`` on CPU, measured from outside the engine: the
storages of the buffers the ledger lists (``sharded_state``'s flat groups, the staging pool) hold 0 bytes while
offloaded and their bytes again after; the process's live storages are moved, not duplicated; the host buffers are
reused; bad input raises naming the parameter and changes nothing; offload="cpu"/"nvme" state is not copied."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import live_storage_bytes, offload_kwargs
from optimizer_snapshot import assert_same, snapshot
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW


def _make(stage, offload=None, root="", rank=0, **kw):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.parameters(), lr=3e-3, stage=stage, module=model, bucket_size=1500,
                    **offload_kwargs(offload, root, rank, f"s{stage}", 1 << 16), **kw)  # fmt: skip
    return model, opt


def _train(model, opt, steps, first=0, rank=0):
    for step in range(first, first + steps):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def _storages(opt) -> dict[str, list]:
    """The optimizer's buffers by group, as the ledger's seam lists them (not the offload code's own list)."""
    out = {"optim_states": [], "grads": [], "params": []}
    for group in opt.sharded_state.groups:
        where = group.state.where()
        for key, t in group.tensors().items():
            kind = key.split(".")[0]
            if kind == "params":
                out["params"].append(t)
            elif kind in ("grads", "grad_shard", "landing"):
                if where.get(kind, "device") == "device" or kind == "grads":
                    out["grads"].append(t)
            elif where.get(kind, "device") == "device":
                out["optim_states"].append(t)
    out["grads"] += opt.bucket_runtimes.staging.tensors()
    return out


def _nbytes(ts) -> int:
    seen = {}
    for t in ts:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("include", [None, "optim_states", "grads", "params"])
def test_storages_freed_and_restored(stage, include):
    model, opt = _make(stage)
    _train(model, opt, 2)
    groups = _storages(opt)
    before = {g: _nbytes(ts) for g, ts in groups.items()}
    live = live_storage_bytes()
    opt.offload_states(include=include)
    chosen = ["optim_states", "grads", "params"] if include is None else [include]
    after = {g: _nbytes(ts) for g, ts in groups.items()}
    for g in groups:
        assert after[g] == (0 if g in chosen else before[g]), (g, before, after)
        assert opt.states_device()[g] == ("host" if g in chosen and before[g] else "device")
    moved = sum(before[g] for g in chosen)
    assert moved > 0 or (stage == 3 and include == "params")  # (stage 3 casts its shard from the master)
    # moved into the host copies, not duplicated (this process's every live storage, found by the collector)
    assert abs(live_storage_bytes() - live) < 64 * 1024
    opt.reload_states()
    assert {g: _nbytes(ts) for g, ts in groups.items()} == before
    assert set(opt.states_device().values()) == {"device"}
    assert abs(live_storage_bytes() - live) < 64 * 1024  # CPU: the host copies are freed by the reload
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offloaded_state_stays_where_it_is(offload, tmp_path):
    model, opt = _make(2, offload, str(tmp_path))
    _train(model, opt, 2)
    host = []
    for group in opt.sharded_state.groups:
        where = group.state.where()
        for key, t in group.tensors().items():
            if where.get(key.split(".")[0]) in ("host", "disk"):
                host.append((t, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
    assert host
    expected = opt.states_device()
    assert expected["optim_states"] == ("host" if offload == "cpu" else "disk")
    on_device = _nbytes([t for ts in _storages(opt).values() for t in ts])
    opt.offload_states()
    for t, ptr, n in host:  # not copied, not freed: the placement's own host memory
        assert (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) == (ptr, n)
    lot = opt._sleep.lot
    assert lot.parked_bytes() == on_device  # the device's bytes only (parameters, staging), each once
    assert all(s.tensor.untyped_storage().nbytes() == 0 for s in lot.slots.values() if s.parked)
    assert opt.states_device()["optim_states"] == expected["optim_states"]
    opt.reload_states()
    _train(model, opt, 1, first=2)
    opt.close()


def test_idempotent_and_buffers_reused():
    model, opt = _make(2)
    ref_model, ref = _make(2)
    _train(model, opt, 2)
    _train(ref_model, ref, 2)
    lot = opt._sleep.lot
    lot.keeps_buffers = True  # as on CUDA: the host buffers outlive the reload and are reused
    opt.offload_states()
    parked = lot.parked_bytes()
    ptrs = {k: s.host.data_ptr() for k, s in lot.slots.items() if s.parked}
    opt.offload_states()  # twice is once
    opt.offload_states(include=["params"])
    assert lot.parked_bytes() == parked
    for _ in range(5):
        opt.reload_states()
        opt.reload_states()
        opt.offload_states()
        assert {k: s.host.data_ptr() for k, s in lot.slots.items() if s.parked} == ptrs
    opt.reload_states()
    _train(model, opt, 2, first=2)
    _train(ref_model, ref, 2, first=2)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))


BAD = [
    (dict(include="moments"), ValueError, "`include`"),
    (dict(include=5), TypeError, "`include`"),
    (dict(include=[3]), TypeError, "`include`"),
    (dict(include=[]), ValueError, "`include`"),
    (dict(pin_memory="yes"), TypeError, "`pin_memory`"),
    (dict(non_blocking=1), TypeError, "`non_blocking`"),
]


def _bad_inputs(rank, world):
    model, opt = _make(2)
    ref_model, ref = _make(2)
    _train(model, opt, 1, rank=rank)
    _train(ref_model, ref, 1, rank=rank)
    for kwargs, error, name in BAD:
        with pytest.raises(error, match=name):
            opt.offload_states(**kwargs)
        assert set(opt.states_device().values()) == {"device"}
    with pytest.raises(TypeError, match="`non_blocking`"):
        opt.reload_states(non_blocking=None)
    with pytest.raises(TypeError, match="`module`"):
        opt.named_full_params(module=3)
    with pytest.raises(TypeError, match="`buffers`"):
        opt.named_full_params(buffers=1)
    _train(model, opt, 2, first=1, rank=rank)  # nothing changed: the run goes on as one that saw no bad call
    _train(ref_model, ref, 2, first=1, rank=rank)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))
    return True


def test_bad_input_raises_on_every_rank_and_changes_nothing():
    assert run_on_ranks(2, _bad_inputs) == [True, True]


def test_deepspeed_enum_members_accepted():
    class Member:  # DeepSpeed's OffloadStateTypeEnum.optim_states: a `value` string
        value = "optim_states"

    model, opt = _make(1)
    _train(model, opt, 1)
    opt.offload_states(include=[Member()], non_blocking=True)  # (non_blocking is synchronous without a GPU)
    assert opt.states_device() == {"optim_states": "host", "grads": "device", "params": "device"}
    opt.reload_states(non_blocking=True)
    assert set(opt.states_device().values()) == {"device"}


def test_close_while_offloaded_gives_the_model_back():
    model, opt = _make(2)
    _train(model, opt, 1)
    with torch.no_grad():
        expected = model(batch(9, 0)[:, :-1])
    opt.offload_states()
    opt.close()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(batch(9, 0)[:, :-1]), expected)
