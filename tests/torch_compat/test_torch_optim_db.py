"""ZeroAdamW through torch's own list of AdamW inputs (``torch.testing._internal.common_optimizers``, what
PyTorch's generic optimizer tests run every optimizer through): every error input raises (or warns) as torch does,
with an error of torch's type whose message matches torch's pattern; every configuration input trains like
torch.optim.AdamW on the ranks' mean gradient, at every stage, on 1 and 2 ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, rank_grads, reference, set_mean_grads
from pairwise import pairwise_params
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")  # (needs expecttest: dev extra)
ADAMW = next(info for info in common_optimizers.optim_db if info.optim_cls is torch.optim.AdamW)
ERRORS = ADAMW.optim_error_inputs_func(device="cpu", dtype=torch.float32)
INPUTS = ADAMW.optim_inputs_func(device="cpu", dtype=torch.float32)
CONSTRUCTION = common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR


def _params(given):
    # torch's inputs with no params check only the hyperparameters (checked before the params are looked at)
    return [torch.nn.Parameter(torch.randn(2, 3))] if given is None else given


@pytest.mark.parametrize("error", ERRORS, ids=[e.optimizer_error_input.desc for e in ERRORS])
def test_every_torch_error_input_fails_as_torch_fails(error):
    case = error.optimizer_error_input
    params = _params(case.params)

    def build_then_step():
        opt = ZeroAdamW(params, **case.kwargs)
        if error.error_on != CONSTRUCTION:
            opt.step()
        return opt

    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            build_then_step().close()
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            build_then_step()


def _train(rank, world, stage, kwargs):
    model, twin = build(torch.float32), build(torch.float32)  # the twin computes every rank's gradients
    ref_params, ref_opt = reference(model, **kwargs)  # torch's AdamW on fp32 masters, fed the ranks' mean gradient
    opt = ZeroAdamW(model.parameters(), **kwargs, stage=stage, module=model, bucket_size=1024)
    for step in range(3):
        batches = [batch(step, r) for r in range(world)]
        with opt.gathered_params(), torch.no_grad():  # (stage 3: the parameters are whole only in here)
            for mine, theirs in zip(model.parameters(), twin.parameters()):
                theirs.copy_(mine)
        set_mean_grads(ref_params, rank_grads(twin, list(twin.parameters()), batches, loss_fn))
        ref_opt.step()
        loss_fn(model, batches[rank]).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        check_against_reference(opt, model, ref_params, rank)
    opt.close()
    return True


# Every input at every stage, each pair of (input, world size) and (stage, world size) once: 21 runs of the 42
# combinations (tests/helpers/pairwise.py).
AXES = {"case": INPUTS, "stage": [1, 2, 3], "world": [1, 2]}


@pytest.mark.parametrize("case,stage,world", pairwise_params(AXES, ids={"case": [c.desc for c in INPUTS]}))
def test_every_torch_configuration_input_trains_as_torch(case, stage, world):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no input of torch's list makes ZeroAdamW warn
        assert all(run_on_ranks(world, _train, stage, case.kwargs))
