"""A model wrapped in DistributedDataParallel is refused with one message at every stage: ZeroAdamW reduces the
gradients itself, do not wrap. Whichever comes first: wrapped before the optimizer is built (the forward inside DDP
is refused), or after it, as trainers do (``opt = ...; model = DDP(model)``): at stage 3 DDP's constructor reads the
sharded parameters (it broadcasts them), which must name DDP rather than ask for ``gathered_params()``."""

import pytest
import torch
import torch.nn as nn
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

DO_NOT_WRAP = r"DistributedDataParallel\. ZeroAdamW reduces the gradients itself: .* do not wrap it in"


def _wrapped_before(rank, world, stage):
    model = build(torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError, match="`module` is wrapped in " + DO_NOT_WRAP):
        ZeroAdamW(model.parameters(), module=ddp, stage=stage)
    opt = ZeroAdamW(model.parameters(), module=model, stage=stage, bucket_size=1500)
    with pytest.raises(RuntimeError, match="running inside " + DO_NOT_WRAP):
        loss_fn(ddp, batch(0, rank))
    opt.close()
    return True


def _wrapped_after(rank, world, stage):
    model = build(torch.float32)
    opt = ZeroAdamW(model.parameters(), module=model, stage=stage, bucket_size=1500)
    with pytest.raises(RuntimeError, match=DO_NOT_WRAP) as refused:
        ddp = nn.parallel.DistributedDataParallel(model)  # stages 1 and 2: wrapping works ...
        loss_fn(ddp, batch(0, rank))  # ... and the forward is refused
    assert "sharded here" not in str(refused.value)
    loss_fn(model, batch(0, rank)).backward()  # the unwrapped model still trains
    opt.step()
    opt.close()
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_wrapped_in_ddp_is_refused_with_the_ddp_message(stage):
    assert all(run_on_ranks(2, _wrapped_before, stage, timeout=90))
    assert all(run_on_ranks(2, _wrapped_after, stage, timeout=90))
