"""The constructors' public signatures (keyword names, defaults, positional order) are pinned here, as they were
before the options were declared once (``zero_ext.engine.config``): a change to the declaration that would change
what callers may pass fails here. Every option is documented in both classes' docstrings, in the signature's order,
and an unknown keyword is Python's own TypeError."""

from __future__ import annotations

import inspect

import pytest
import torch

from zero_ext import ZeroAdamW, ZeroMuon
from zero_ext.update.muon import NS_COEFFICIENTS

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

# (name, kind, default) of every keyword option, in the signature's order (DESIGN.md's public contract)
OPTIONS = [
    ("stage", 2), ("process_group", None), ("bucket_size", None), ("reduce_dtype", torch.float32),
    ("grad_accum_dtype", None), ("max_grad_norm", None), ("module", None), ("sync_module_states", True),
    ("reshard_after_forward", True), ("prefetch", 1), ("gather_units", "auto"), ("param_init", None),
    ("param_device", None), ("defer_all_gather_to", None), ("staging_buffers", 2), ("communicator", None),
    ("mesh", None), ("replicate_state", False), ("inter_node_reduce_dtype", None), ("offload", None),
    ("offload_dir", None), ("offload_window", None),
    ("param_remainders", False), ("moment_dtype", torch.float32), ("collective_timeout", 300.0),
]  # fmt: skip

ZERO_ADAMW = [
    ("params", P, inspect.Parameter.empty), ("lr", P, 1e-3), ("betas", P, (0.9, 0.999)), ("eps", P, 1e-8),
    ("weight_decay", P, 1e-2), ("amsgrad", P, False), ("maximize", K, False), ("foreach", K, None),
    ("capturable", K, False), ("differentiable", K, False), ("fused", K, None),
    *[(name, K, default) for name, default in OPTIONS],
]  # fmt: skip

ZERO_MUON = [
    ("params", P, inspect.Parameter.empty), ("lr", P, 1e-3), ("weight_decay", P, 0.1), ("momentum", P, 0.95),
    ("nesterov", P, True), ("ns_coefficients", P, NS_COEFFICIENTS), ("eps", P, 1e-7), ("ns_steps", P, 5),
    ("adjust_lr_fn", P, None), ("options", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty),
]  # fmt: skip


def _described(cls) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]


def test_zeroadamw_signature_is_unchanged():
    assert _described(ZeroAdamW) == ZERO_ADAMW
    assert NS_COEFFICIENTS == (3.4445, -4.775, 2.0315)


def test_zeromuon_signature_is_unchanged():
    assert _described(ZeroMuon) == ZERO_MUON


@pytest.mark.parametrize("cls", [ZeroAdamW, ZeroMuon])
def test_every_option_is_documented_in_order(cls):
    doc = cls.__doc__
    assert "<options>" not in doc
    places = [doc.find(f"\n        {name}: ") for name, _ in OPTIONS]
    assert all(at > 0 for at in places), [name for (name, _), at in zip(OPTIONS, places) if at < 0]
    assert places == sorted(places)


@pytest.mark.parametrize("cls, args", [(ZeroAdamW, {}), (ZeroMuon, {})])
def test_an_unknown_keyword_is_pythons_type_error(cls, args):
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument 'stages'$"):
        cls(params, stages=2)


def test_zeromuon_refuses_adamw_only_keywords():
    """``maximize`` and torch.optim.AdamW's implementation selectors are ZeroAdamW's own arguments, not options."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'maximize'"):
        ZeroMuon([torch.nn.Parameter(torch.zeros(4, 4))], maximize=True)


def test_options_keep_their_defaults_when_not_given():
    model = torch.nn.Linear(4, 4)
    for cls in (ZeroAdamW, ZeroMuon):
        opt = cls([model.weight])
        assert (opt.stage, opt.max_grad_norm, opt.reduce_dtype, opt.offload) == (2, None, torch.float32, None)
        opt.close()
