"""ZeroAdamW takes torch.optim.AdamW's keywords: ``ZeroAdamW(params, **adamw_kwargs)`` works for every one of them
(amsgrad the sixth positional, the rest keyword-only, as torch); ``foreach``, ``fused`` and ``capturable`` select
implementations, so any value torch accepts is taken and changes no bit (one fused kernel always);
``differentiable=True`` is refused (the step is not differentiable); every param group carries the six flags as
torch's do; a value of the wrong type names its keyword; an unknown keyword is Python's own TypeError."""

from __future__ import annotations

import inspect

import pytest
import torch
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

# Every keyword of torch.optim.AdamW, none at its default, each a value ZeroAdamW supports.
ADAMW_KWARGS = dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, amsgrad=True, maximize=True,
                    foreach=False, capturable=True, differentiable=False, fused=False)  # fmt: skip
FLAG_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")
SELECTORS = ("foreach", "capturable", "differentiable", "fused")  # torch's choice of implementation
STEPS = 4


def _torch_keywords() -> set[str]:
    return set(inspect.signature(torch.optim.AdamW.__init__).parameters) - {"self", "params"}


def test_the_kwargs_are_every_torch_adamw_keyword():
    """(A torch that adds a keyword fails here: decide what ZeroAdamW does with it.)"""
    assert set(ADAMW_KWARGS) == _torch_keywords()
    defaults = {k: p.default for k, p in inspect.signature(torch.optim.AdamW.__init__).parameters.items()}
    assert [k for k in ADAMW_KWARGS if ADAMW_KWARGS[k] == defaults[k]] == ["differentiable"]  # True is refused


def _train(opt, model, steps=STEPS):
    for step in range(steps):
        loss_fn(model, batch(step, 0)).backward()
        opt.step()
        opt.zero_grad()


def test_every_torch_adamw_keyword_is_taken_and_applied():
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **ADAMW_KWARGS, stage=2, bucket_size=1500)
    group = opt.param_groups[0]
    for key, value in ADAMW_KWARGS.items():
        assert group[key] == value, (key, group[key], value)
    ref_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(ref_params, **{k: v for k, v in ADAMW_KWARGS.items() if k not in SELECTORS})
    for step in range(STEPS):
        grads = torch.autograd.grad(loss_fn(model, batch(step, 0)), list(model.parameters()))
        for p, g in zip(ref_params, grads):
            p.grad = g
        ref.step()
        loss_fn(model, batch(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()["state"]
    for index, (p, r) in enumerate(zip(model.parameters(), ref_params)):
        torch.testing.assert_close(p.detach(), r.detach())  # lr, betas, eps, weight_decay, maximize applied
        for kind in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):  # amsgrad applied: torch's moments, bitwise
            assert torch.equal(sd[index][kind], ref.state[r][kind].reshape(-1)), (index, kind)


def _run(**kwargs):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), amsgrad=True, stage=2, bucket_size=1500, **kwargs)
    _train(opt, model)
    return [p.detach().clone() for p in model.parameters()], opt


SELECTOR_VALUES = [("foreach", None), ("foreach", True), ("foreach", False), ("fused", None), ("fused", True),
                   ("fused", False), ("capturable", True), ("capturable", False), ("differentiable", False)]  # fmt: skip


@pytest.mark.parametrize("key,value", SELECTOR_VALUES, ids=[f"{k}={v}" for k, v in SELECTOR_VALUES])
def test_implementation_selectors_are_accepted_and_change_no_bit(key, value):
    expected, _ = _run()
    got, opt = _run(**{key: value})
    assert opt.param_groups[0][key] is value
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_param_groups_carry_torch_flags():
    """Every group has the six flags, with torch's defaults and per-group overrides, as torch.optim.AdamW's."""
    model = build(torch.bfloat16)
    named = list(model.named_parameters())
    groups = [{"params": named[:3]}, {"params": named[3:], "amsgrad": True, "maximize": True, "foreach": True}]
    theirs = torch.optim.AdamW([dict(g, params=[p for _, p in g["params"]]) for g in groups])
    ours = ZeroAdamW(groups, stage=2, bucket_size=1500)
    for mine, torch_group in zip(ours.param_groups, theirs.param_groups):
        assert {k: mine[k] for k in FLAG_KEYS} == {k: torch_group[k] for k in FLAG_KEYS}
    assert ours.param_groups[1]["amsgrad"] is True and ours.param_groups[0]["amsgrad"] is False


def test_amsgrad_is_the_sixth_positional_argument_and_maximize_keyword_only():
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, True)
    assert opt.param_groups[0]["amsgrad"] is True and opt.param_groups[0]["maximize"] is False
    opt.close()
    with pytest.raises(TypeError):
        ZeroAdamW(build(torch.bfloat16).named_parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, True, True)


BAD = [
    (dict(differentiable=True), "differentiable"),
    (dict(differentiable="no"), "differentiable"),
    (dict(foreach="yes"), "foreach"),
    (dict(foreach=1), "foreach"),
    (dict(fused=0), "fused"),
    (dict(fused="cuda"), "fused"),
    (dict(capturable=None), "capturable"),
    (dict(capturable="yes"), "capturable"),
    (dict(amsgrad="yes"), "amsgrad"),
    (dict(amsgrad=None), "amsgrad"),
    (dict(maximize=1), "maximize"),
]


@pytest.mark.parametrize("kwargs,name", BAD, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _ in BAD])
def test_bad_values_name_the_keyword_and_leave_the_model_alone(kwargs, name):
    model = build(torch.bfloat16)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"`{name}`"):
        ZeroAdamW(model.named_parameters(), **kwargs)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    loss_fn(model, batch(0, 0)).backward()  # no hooks left behind: torch's own .grad
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("key,value", [("amsgrad", "yes"), ("maximize", None), ("differentiable", True)])
def test_bad_values_in_a_param_group_name_the_keyword(key, value):
    named = list(build(torch.bfloat16).named_parameters())
    with pytest.raises(ValueError, match=f"`{key}`"):
        ZeroAdamW([{"params": named[:3]}, {"params": named[3:], key: value}])


def test_an_unknown_keyword_is_pythons_type_error():
    with pytest.raises(TypeError, match="amsgard"):
        ZeroAdamW(build(torch.bfloat16).named_parameters(), amsgard=True)


def _keywords_on_every_rank(rank, world):
    with pytest.raises(ValueError, match="`differentiable`"):
        ZeroAdamW(build(torch.bfloat16).named_parameters(), differentiable=True)
    model = build(torch.bfloat16)
    # (foreach=True with fused=True is torch's RuntimeError: tests/torch_compat/test_adamw_arguments.py)
    opt = ZeroAdamW(model.named_parameters(), amsgrad=True, maximize=True, foreach=False, fused=True, capturable=True,
                    bucket_size=1500)  # fmt: skip
    _train(opt, model, 2)
    return opt.step_count


def test_keywords_on_two_ranks():
    assert run_on_ranks(2, _keywords_on_every_rank) == [2, 2]
