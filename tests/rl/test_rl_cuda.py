"""offload_states / reload_states on CUDA, measured by the allocator's own counters (marked cuda: skipped without a GPU;
written ahead of a GPU session, see the report in docs/rl.md): ``memory_allocated()`` falls by the bytes offloaded
(within 1 MiB) and ``memory_reserved()`` falls too (the call empties the allocator's cache); a second process can
allocate the memory given back, which it could not before; a non-blocking offload returns before its copies ran and
the copies still read the values written just before it (``torch.cuda._sleep`` holds the stream); 100 cycles grow
neither device nor host memory; the RL detour is bitwise invisible on the GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from optimizer_snapshot import assert_same, snapshot

from zero_ext import ZeroAdamW

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 2**20


def _model(seed=0, dim=1024, layers=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to("cuda", torch.bfloat16)


def _make(stage, **kw):
    model = _model()
    return model, ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, module=model, **kw)


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _device_bytes(opt) -> int:
    """The optimizer's device buffers, from the ledger's seam (flat groups, staging), each storage once."""
    seen = {}
    for group in opt.sharded_state.groups:
        for t in group.tensors().values():
            if t.is_cuda:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    for t in opt.bucket_runtimes.staging.tensors():
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_allocated_and_reserved_drop(stage):
    model, opt = _make(stage)
    _train(model, opt, 2)
    before = snapshot(model, opt)
    torch.cuda.synchronize()
    owned = _device_bytes(opt)
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    opt.offload_states()
    assert opt.states_device() == {"optim_states": "host", "grads": "host", "params": "host"}
    freed = allocated - torch.cuda.memory_allocated()
    assert abs(freed - owned) <= MiB, (freed, owned)
    assert reserved - torch.cuda.memory_reserved() >= owned - 8 * MiB  # the cache was emptied: given back
    opt.reload_states()
    assert torch.cuda.memory_allocated() == allocated
    assert_same(snapshot(model, opt), before)


def _child(conn, nbytes):
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context exists before the parent fills the GPU
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "exit":
            os._exit(0)
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            t.fill_(1)
            torch.cuda.synchronize()
            del t
            torch.cuda.empty_cache()
            conn.send("allocated")
        except torch.OutOfMemoryError:
            conn.send("oom")


def test_second_process_allocates_the_freed_memory():
    model, opt = _make(2)
    _train(model, opt, 1)
    owned = _device_bytes(opt)
    want = owned // 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, want))
    proc.start()
    try:
        assert parent.recv() == "ready"
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(max(0, free - want // 4), dtype=torch.uint8, device="cuda")  # the GPU nearly full
        parent.send("try")
        assert parent.recv() == "oom"  # the inference engine cannot have the memory yet
        opt.offload_states()
        parent.send("try")
        assert parent.recv() == "allocated"  # ... and can once the trainer sleeps
        parent.send("exit")
        proc.join(60)
        del filler
        opt.reload_states()
        _train(model, opt, 1, first=1)
    finally:
        if proc.is_alive():
            proc.kill()


def test_non_blocking_orders_the_copies():
    model, opt = _make(2)
    _train(model, opt, 2)
    opt.offload_states(non_blocking=True)  # a first cycle: the pinned buffers exist from now on
    opt.reload_states(non_blocking=True)
    master = opt.sharded_state.groups[0].state.buffers["master"]
    torch.cuda.synchronize()
    expected = master.clone() + 1
    torch.cuda._sleep(2_000_000_000)  # about a second of one kernel on the current stream ...
    master.add_(1)  # ... then a write the offload's copies must see
    start = time.perf_counter()
    opt.offload_states(non_blocking=True)
    returned = time.perf_counter() - start
    assert returned < 0.2, f"non_blocking offload waited {returned:.3f} s for the stream"
    opt.reload_states(non_blocking=True)  # waits for the offload's copies on the device, not on the host
    assert torch.equal(master, expected)  # (queued after the reload: reads the reloaded bytes)


def test_hundred_cycles_do_not_grow():
    model, opt = _make(2)
    _train(model, opt, 1)
    opt.offload_states()
    opt.reload_states()
    lot = opt._sleep.lot
    pinned = {k: s.host.data_ptr() for k, s in lot.slots.items()}
    assert all(s.host.is_pinned() for s in lot.slots.values())
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    host = rss()
    for _ in range(100):
        opt.offload_states()
        opt.reload_states()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() <= reserved
    assert {k: s.host.data_ptr() for k, s in lot.slots.items()} == pinned  # allocated once, reused
    assert rss() - host < 16 * MiB


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_detour_bitwise_on_gpu(stage):
    model, opt = _make(stage)
    ref_model, ref = _make(stage)
    for step in range(4):
        _train(model, opt, 1, first=step)
        _train(ref_model, ref, 1, first=step)
        opt.offload_states()
        engine = _model(seed=5)
        engine.load_state_dict(dict(opt.named_full_params()), strict=True)
        with torch.no_grad():
            engine(torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16))
        del engine
        opt.reload_states()
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))
