"""torch.optim.AdamW's constructor checks: every error input of torch's own optimizer tests
(torch/testing/_internal/common_optimizers.py: optim_error_inputs_func_adamw and the inputs common to all optimizers,
transcribed here since importing that module needs torch's test dependencies) raises the same exception type from
ZeroAdamW, with a message torch's regex matches (after zero_ext's prefix); a check failing on one rank only fails
every rank, none waits."""

import re
import warnings

import pytest
import torch
from distributed import run_on_ranks
from torch.nn import Parameter

from zero_ext import ZeroAdamW


def _p():
    return Parameter(torch.randn(1, 1))


SP, SP2 = _p(), _p()
# (params or None for one fresh parameter, kwargs, exception type, torch's regex)
ERROR_INPUTS = [
    (SP, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors or dicts"),
    ([SP, SP], {}, UserWarning, ".*a parameter group with duplicate parameters.*"),
    ([{"params": SP}, {"params": SP}], {}, ValueError, "some parameters appear in more than one parameter group"),
    (None, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    ([("weight", SP), SP2], {}, ValueError,
     "all optimizer params should be with/without names. Some param names are missing"),
    ([{"params": [SP], "lr": 1e-2}, {"params": [("weight", SP2)]}], {}, ValueError,
     "all optimizer param groups should be with/without names. cannot add param group with names to the optimizer"),
    (None, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (None, dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (None, dict(lr=torch.tensor(0.001), foreach=True), ValueError,
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
    (None, dict(lr=1e-2, betas=(0.9, torch.tensor(0.99))), ValueError, "betas must be either both floats or both Tensors"),
    (None, dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99)), ValueError, "betas must be either both floats or both Tensors"),
    (None, dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), ValueError,
     r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True"),
    (None, {"foreach": True, "fused": True}, RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (None, {"fused": True, "differentiable": True}, RuntimeError, "`fused` does not support `differentiable`"),
    ([], {}, ValueError, "optimizer got an empty parameter list"),
    # torch/optim/adam.py's other checks
    (None, dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (None, dict(lr=float("nan")), ValueError, "Invalid learning rate: nan"),
    (None, dict(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
    (None, dict(betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1: 1.0"),
    (None, dict(betas=(0.9, torch.tensor(0.99)), foreach=True), ValueError,
     "betas must be either both floats or both Tensors"),
    ([torch.randn(2, requires_grad=True) * 2], {}, ValueError, "can't optimize a non-leaf Tensor"),
    ([1.0], {}, TypeError, "optimizer can only optimize Tensors"),
]  # fmt: skip


def _outcome(cls, params, kwargs):
    params = [_p()] if params is None else params
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cls(params, **kwargs)
        except Exception as e:  # noqa: BLE001
            return type(e), str(e)
    return None, [(w.category, str(w.message)) for w in caught]


@pytest.mark.parametrize("case", range(len(ERROR_INPUTS)))
def test_torchs_error_inputs_raise_torchs_type_and_words(case):
    params, kwargs, error_type, regex = ERROR_INPUTS[case]
    for cls in (torch.optim.AdamW, ZeroAdamW):
        kind, what = _outcome(cls, params, kwargs)
        if issubclass(error_type, Warning):
            assert kind is None and any(issubclass(c, error_type) and re.search(regex, m) for c, m in what), what
        else:
            assert kind is error_type and re.search(regex, what), (cls.__name__, kind, what)


def test_valid_tensor_hyperparameters_are_accepted_as_torch_accepts_them():
    for kwargs in (dict(lr=torch.tensor(1e-3)), dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
                   dict(lr=torch.tensor(1e-3), foreach=True, capturable=True)):  # fmt: skip
        torch.optim.AdamW([_p()], **kwargs)
        ZeroAdamW([_p()], **kwargs)


def _bad_on_one_rank(rank, world, kwargs):
    bad = rank == world - 1
    model = torch.nn.Linear(3, 2)
    match = r"betas must be either both floats or both Tensors" if bad else r"construction failed on rank\(s\)"
    with pytest.raises(ValueError, match=match):
        ZeroAdamW(model.parameters(), **(kwargs if bad else {}))
    ZeroAdamW(model.parameters())  # every rank goes on together
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_a_torch_check_failing_on_one_rank_fails_every_rank(world):
    kwargs = dict(betas=(0.9, torch.tensor(0.99)))
    assert run_on_ranks(world, _bad_on_one_rank, kwargs, timeout=60) == [True] * world
