"""Each bucket is one BucketRuntime (opt.bucket_runtimes) whose gradient and parameter phases move only
through their paired verbs; a move the tables do not allow raises IllegalTransition and changes nothing."""

import pytest
import torch
import torch.nn as nn

from zero_ext import ZeroAdamW
from zero_ext.engine.bucket_runtime import GradState, IllegalTransition, ParamState


def _opt(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    return model, ZeroAdamW(model.named_parameters(), stage=stage, bucket_size=16 * 17, module=model)


class _NothingToSend:
    """A gradient strategy with nothing on the wire (as one process at stage 2): the launch moves the phase only."""

    reduce_dtype, accumulate, writes_to_staging = torch.float32, True, False

    def send(self, *values):
        return None


_NOTHING_TO_SEND = _NothingToSend()


def _refused(rt, verb, *args):
    before = (rt.grad, rt.params)
    with pytest.raises(IllegalTransition, match=r"bucket \(0, \d\)"):
        verb(*args)
    assert (rt.grad, rt.params) == before


def test_stage3_parameters_move_only_sharded_gathering_gathered_sharded():
    model, opt = _opt(3)
    runtimes = opt.bucket_runtimes
    assert len(runtimes) == 2 and all(rt.params is ParamState.SHARDED for rt in runtimes.values())
    rt = runtimes[(0, 0)]
    _refused(rt, rt.finish_param_sync)  # nothing in flight
    _refused(rt, rt.reshard)  # nothing gathered
    rt.start_param_sync(opt.sharded_state.comm)
    storage = rt.group.flat_params.storage[rt.bucket.index].untyped_storage()  # made at the first gather
    assert rt.params is ParamState.GATHERING and storage.nbytes() == rt.nbytes
    _refused(rt, rt.start_param_sync, opt.sharded_state.comm)  # a second gather of a bucket in flight
    _refused(rt, rt.reshard)  # freed under its own all-gather
    rt.finish_param_sync()
    assert rt.params is ParamState.GATHERED
    _refused(rt, rt.start_param_sync, opt.sharded_state.comm)  # a second gather of a bucket present
    rt.reshard()
    assert rt.params is ParamState.SHARDED and storage.nbytes() == 0
    # Training moves every bucket through the same verbs and leaves each released, its reduction waited for.
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    assert all(rt.params is ParamState.SHARDED and rt.grad is GradState.SYNCED for rt in runtimes.values())
    assert opt.memory_report().window_peak > 0


def test_gradients_move_only_empty_filling_ready_syncing_synced():
    _, opt = _opt(2)
    rt = opt.bucket_runtimes[(0, 0)]
    assert rt.grad is GradState.EMPTY and rt.params is ParamState.GATHERED
    _refused(rt, rt.start_grad_sync, None, _NOTHING_TO_SEND, None)  # launched before its gradients are in
    _refused(rt, rt.finish_grad_sync)  # nothing in flight
    _refused(rt, rt.reshard)  # stages 1 and 2 keep every parameter
    while not rt.grad_arrived():
        assert rt.grad is GradState.FILLING
    assert rt.grad is GradState.READY
    _refused(rt, rt.grad_arrived)  # more gradients than the bucket has, this round
    _refused(rt, rt.finish_grad_sync)
    rt.start_grad_sync(None, _NOTHING_TO_SEND, None)  # nothing to send: no collective
    assert rt.grad is GradState.SYNCING
    _refused(rt, rt.start_grad_sync, None, _NOTHING_TO_SEND, None)  # reduced twice
    rt.finish_grad_sync()
    assert rt.grad is GradState.SYNCED
