"""The stream ordering of offload's copies, shown on CPU: the placement of an offloaded optimizer is switched into its
CUDA path with stand-in streams and events that record what waits for what (no GPU here; the same orderings run
for real in tests/engine/test_engine_cuda_offload.py).

- The device-to-host copy of a landed gradient is queued on the copy stream only after that stream waited for the
  stream that produced the bytes, whether the reduce-scatter returned an event (NCCL) or none (one rank: a copy on
  the compute stream; once, the copy stream waited for nothing and read the previous round's bytes).
- The pinned fp32 master, which fp32 parameters are copied to the device from, is written by the CPU (a loaded
  state, the next update) only after the event of that copy completed."""

import contextlib

import pytest
import torch
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm import DONE, Pending
from zero_ext.layout import Range
from zero_ext.placement.host import HostGradients


class Timeline:
    """What the stand-ins were asked, in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = Stream(self, "compute")


class Stream:
    def __init__(self, timeline: Timeline, name: str):
        self.timeline, self.name = timeline, name

    def wait_stream(self, other: "Stream") -> None:
        self.timeline.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "Event") -> None:
        self.timeline.log.append(("wait_event", self.name, event.name))


class Event:
    count = 0

    def __init__(self, timeline: Timeline, name: str = ""):
        Event.count += 1
        self.timeline, self.name = timeline, name or f"event{Event.count}"

    def record(self, stream: Stream = None) -> None:
        stream = stream or self.timeline.current
        self.timeline.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.timeline.log.append(("synchronize", self.name))

    def query(self) -> bool:
        return True


@pytest.fixture
def timeline(monkeypatch):
    t = Timeline()

    @contextlib.contextmanager
    def on_stream(stream):
        previous, t.current = t.current, stream
        t.log.append(("enter", stream.name))
        try:
            yield
        finally:
            t.current = previous
            t.log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: t.current)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(t))
    # One process on the CPU would add the gradients straight into the grad shard, with no landing ring to walk.
    monkeypatch.setattr(HostGradients, "IN_PLACE_WITHOUT_GPU", False)
    return t


def _to_cuda_path(opt, timeline) -> None:
    """Every placement of ``opt`` takes its CUDA path: the copies stay real (CPU tensors, so synchronous), the
    streams and events are the stand-ins."""
    for group in opt.sharded_state.groups:
        state = group.state
        state.cuda = True
        state.copy_stream = Stream(timeline, "copy")
        state.ring.host_buffers = [torch.empty_like(b) for b in state.ring.device_buffers]


def _offloaded(dtype, timeline):
    """An offloaded optimizer with one step behind it (CPU path), its placement then switched to the CUDA path."""
    model = build(dtype)
    opt = ZeroAdamW(model.parameters(), lr=1e-3, stage=2, bucket_size=2000, offload="cpu")
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    opt.zero_grad()
    _to_cuda_path(opt, timeline)
    return opt, opt.sharded_state.groups[0].state


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_training_through_the_cuda_path_orders_every_copy(timeline, tmp_path, offload, dtype):
    """Three steps through the CUDA path give the CPU path's parameters bit for bit; every landing copy was queued
    after the copy stream waited for the compute stream; the host-to-device copies' events were waited for (nvme:
    before step() returns, the window's slots being reused; cpu: before the next write of what they read)."""
    params = []
    for cuda_path in (False, True):
        model = build(dtype)
        kw = dict(offload=offload)
        if offload == "nvme":
            kw.update(offload_dir=str(tmp_path), offload_window=3 * 14 * 1024 * 2)
        opt = ZeroAdamW(model.parameters(), lr=1e-3, stage=2, bucket_size=2000, **kw)
        if cuda_path:
            _to_cuda_path(opt, timeline)
        for step in range(3):
            loss_fn(model, batch(step, 0)).backward()
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*params))
    log = timeline.log
    copies = [i for i, e in enumerate(log) if e == ("enter", "copy")]
    assert len(copies) >= 3 * 4, log  # a landing per bucket and step
    for previous, i in zip([-1] + copies, copies):
        assert ("wait_stream", "copy", "compute") in log[previous + 1 : i], f"landing copy {i} waited for nothing"
    recorded = [e[1] for e in log if e[0] == "record" and e[2] == "compute"]  # after host-to-device copies
    waited = {e[1] for e in log if e[0] == "synchronize"} & set(recorded)
    if offload == "nvme":
        assert recorded[-1] in waited, "step() returned before the window's last copy to the device finished"
    elif dtype == torch.float32:  # steps 2 and 3 wrote the master only after the copies of steps 1 and 2 from it
        assert len(waited) >= 2, log
    # (cpu, bf16: the staging ring's events follow the parameters' device, which stays the CPU here)


@pytest.mark.parametrize("with_event", [False, True], ids=["one_rank_no_event", "nccl_event"])
def test_the_landing_copy_waits_for_the_stream_that_produced_the_gradient(timeline, with_event):
    opt, state = _offloaded(torch.bfloat16, timeline)
    bucket = state.layout.buckets[0]
    target, direct = state.grad_target(bucket)
    assert not direct
    target.copy_(torch.arange(target.numel(), dtype=torch.float32))  # the reduce-scatter's result, on "compute"
    pending = DONE if not with_event else Pending(event=Event(timeline, "reduce_scatter"), device=torch.device("cpu"))
    timeline.log.clear()
    state.landed(bucket, target, pending, accumulate=False)
    log = timeline.log
    assert ("enter", "copy") in log, log
    before_copy = log[: log.index(("enter", "copy"))]
    assert ("wait_stream", "copy", "compute") in before_copy, f"the copy stream did not wait for the producer: {log}"
    if with_event:
        assert ("wait_event", "copy", "reduce_scatter") in before_copy, log
    state.finish_landing()  # the host reads the bytes only after the copy's event
    assert [e for e in timeline.log if e[0] == "synchronize"], timeline.log
    shard = bucket.shard_range.of(state.grad)
    assert torch.equal(shard, torch.arange(shard.numel(), dtype=torch.float32))
    opt.close()


def test_the_fp32_master_is_written_only_after_its_copy_to_the_device(timeline):
    opt, state = _offloaded(torch.float32, timeline)
    assert state.out is None  # fp32 parameters: copied to the device from the master itself
    bucket = state.layout.buckets[0]
    (unit,) = list(state.units([bucket]))
    timeline.log.clear()
    state.unit_done(unit, [Range(0, bucket.shard_numel)])
    recorded = [e for e in timeline.log if e[0] == "record"]
    assert recorded and recorded[-1][2] == "compute", f"no event after the host-to-device copy: {timeline.log}"
    for write in (
        lambda: state.write("master", bucket.shard_range, torch.zeros(bucket.shard_numel)),
        lambda: state.host_view("master", bucket.shard_range),
        lambda: next(iter(state.units([bucket]))),
    ):
        timeline.log.clear()
        state.unit_done(unit, [Range(0, bucket.shard_numel)])
        copy_event = [e for e in timeline.log if e[0] == "record"][-1][1]
        write()
        assert ("synchronize", copy_event) in timeline.log, f"the master was written before its copy: {timeline.log}"
    opt.close()
