"""offload="cpu" / "nvme" on one GPU, written for the first GPU run (scripts/gpu_session.sh, step `engine`).

The offloaded state is updated on the host, so every byte crosses between streams and the host: each reduced
gradient bucket goes device-to-host on a copy stream during backward, and the new parameters (fp32: the master
itself) go host-to-device in step(). These tests delay the stream that produces the bytes with
``torch.cuda._sleep`` so that only stream ordering, never timing, can make the results right.

What they catch:
- the landing copy reading a bucket before the reduce-scatter wrote it. At one rank the "reduce-scatter" is a copy
  on the compute stream with no event (``LocalCommunicator``), and the copy stream once waited only for that
  (absent) event: it read the previous round's bytes, and offload trained on stale gradients;
- the host overwriting the pinned fp32 master (the next update, a loaded state) while the host-to-device copy of the
  parameters from it is still queued.

Each delayed run is compared bit for bit first with the same offloaded run whose reduce-scatters are each followed
by a device synchronisation (nothing can be read early there: a difference is a stale read), then with the
in-memory run, which updates with the CUDA kernel where offload runs the CPU kernel. Both spell out the same fused
multiply-adds (csrc/adamw_math.h), so they should agree to the bit; a difference there alone (the first comparison
passing) is the two kernels' rounding, not stream ordering: report it against adamw_math.h / fused_adamw.cu.
"""

import pytest
import torch
from engine_reference import state_shards
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm import LocalCommunicator, NcclCommunicator
from zero_ext.layout import Range

pytestmark = pytest.mark.cuda
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SLEEP_CYCLES = 20_000_000  # ~10 ms on an H100: thousands of times what the host takes to queue the landing copy
STEPS = 4
DEVICE = "cuda"  # a dry run of the helpers on CPU sets "cpu" (and no-op sleeps)


class _Delayed:
    """The compute stream sleeps before each reduce-scatter is queued, so the bucket's reduced bytes exist only
    ~10 ms after the host moved on to the landing copy."""

    def start_reduce_scatter(self, send, out, **kw):
        torch.cuda._sleep(SLEEP_CYCLES)
        return super().start_reduce_scatter(send, out, **kw)


class _Synchronous:
    """Every reduce-scatter has finished before anything else is queued: the ordering nothing can get wrong."""

    def start_reduce_scatter(self, send, out, **kw):
        pending = super().start_reduce_scatter(send, out, **kw)
        torch.cuda.synchronize()
        return pending


class DelayedLocal(_Delayed, LocalCommunicator):
    pass


class SynchronousLocal(_Synchronous, LocalCommunicator):
    pass


class DelayedNccl(_Delayed, NcclCommunicator):
    pass


class SynchronousNccl(_Synchronous, NcclCommunicator):
    pass


COMMS = {
    "local": {"delayed": lambda d: DelayedLocal(d), "synchronous": lambda d: SynchronousLocal(d), "plain": None},
    "nccl": {
        "delayed": lambda d: DelayedNccl(None, d),
        "synchronous": lambda d: SynchronousNccl(None, d),
        "plain": lambda d: NcclCommunicator(None, d),
    },
}


def _train(path, kind, offload, stage, dtype, root):
    """STEPS steps of the tiny GPT on cuda; per step, the parameters and this rank's state on the host."""
    device = torch.device(DEVICE)
    model = build(dtype).to(device)
    make = COMMS[path][kind]
    kw = dict(offload=offload)
    if offload == "nvme":
        directory = root / f"{path}-{kind}"
        directory.mkdir()
        kw.update(offload_dir=str(directory), offload_window=3 * 14 * 1024 * 2)  # several chunks per shard
    if stage == 3:
        kw.update(module=model)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=2000,
                    communicator=None if make is None else make(device), **kw)  # fmt: skip
    snapshots = []
    for step in range(STEPS):
        loss_fn(model, batch(step, 0).to(device)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            params = [p.detach().cpu().clone() for p in model.parameters()]
        snapshots.append((params, state_shards(opt)))
    opt.close()
    return snapshots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["local", "nccl"])
@pytest.mark.parametrize(
    "offload,stage", [("cpu", 2), ("nvme", 2), ("cpu", 3)], ids=["cpu_stage2", "nvme_stage2", "cpu_stage3"]
)
def test_offload_reads_finished_gradients(nccl_world, tmp_path, offload, stage, path, dtype):
    """A delayed compute stream changes no bit of an offloaded run (one rank, directly and through NCCL)."""
    delayed = _train(path, "delayed", offload, stage, dtype, tmp_path)
    ordered = _train(path, "synchronous", offload, stage, dtype, tmp_path)
    for step, ((p_a, s_a), (p_b, s_b)) in enumerate(zip(delayed, ordered)):
        for i, (a, b) in enumerate(zip(p_a, p_b)):
            assert torch.equal(a, b), f"step {step}: parameter {i} differs from the synchronised run (a stale read)"
        for i, (a, b) in enumerate(zip(s_a, s_b)):
            assert torch.equal(a, b), f"step {step}: state tensor {i} differs from the synchronised run"
    in_memory = _train(path, "plain", None, stage, dtype, tmp_path)
    kernels = "offload (CPU kernel) and in memory (CUDA kernel) round differently: see the module docstring"
    for step, ((p_a, s_a), (p_b, s_b)) in enumerate(zip(delayed, in_memory)):
        for i, (a, b) in enumerate(zip(p_a, p_b)):
            assert torch.equal(a, b), f"step {step}: parameter {i}: {kernels}"
        assert torch.equal(s_a[0], s_b[0]), f"step {step}, master: {kernels}"


def test_the_fp32_master_is_written_only_after_its_copy_to_the_device(nccl_world):
    """fp32 parameters are copied to the device from the pinned master itself; a CPU write of the master right after
    step() (what a loaded state or a followed parameter edit does, through the placement's write) must wait for that
    copy, else the device receives the written bytes instead of the step's result."""
    results = []
    for wait_first in (True, False):
        model = build(torch.float32).cuda()
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=2000, offload="cpu")
        loss_fn(model, batch(0, 0).cuda()).backward()
        torch.cuda._sleep(10 * SLEEP_CYCLES)  # the step's host-to-device copies queue behind ~100 ms of sleep
        opt.step()
        queued = torch.cuda.Event()
        queued.record()
        if wait_first:
            torch.cuda.synchronize()
        else:
            assert not queued.query(), "the sleep ended before step() returned: this test shows nothing; sleep longer"
        for group in opt.sharded_state.groups:
            n = group.layout.shard_numel
            group.state.write("master", Range(0, n), torch.full((n,), 1234.5))
        torch.cuda.synchronize()
        results.append([p.detach().cpu().clone() for p in model.parameters()])
        opt.close()
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"parameter {i} was copied from the master written after step()"
    assert not any(bool((p == 1234.5).any()) for p in results[0])
