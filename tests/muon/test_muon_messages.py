"""Every message ZeroMuon raises or warns through its public calls names ZeroMuon (never ZeroAdamW): the engine, the
checks and the construction read the optimizer's configured name; nothing rewrites messages afterwards. And
``close()`` (twice, or by a newer optimizer over the same parameters) with nothing stamped on the parameters."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from muon_reference import MUON, zero_muon_groups
from test_muon_parity import model_for
from tiny_transformer import batch, loss_fn

from zero_ext import ZeroAdamW, ZeroMuon

NAMED = r"^zero_ext\.ZeroMuon\b"


def _named_zeromuon(caught) -> None:
    message = str(caught.value)
    assert re.match(NAMED, message), message
    assert "ZeroAdamW" not in message, message


@pytest.mark.parametrize(
    "options",
    [
        dict(stage=4),
        dict(staging_buffers=0),
        dict(max_grad_norm=-1.0),
        dict(bucket_size=0),
        dict(reduce_dtype=torch.int8),
        dict(grad_accum_dtype=torch.bfloat16),
        dict(stage=3),  # no module
        dict(prefetch=-1),
        dict(reshard_after_forward=1),
        dict(gather_units="blocks"),
        dict(offload="tape"),
        dict(offload="cpu", offload_window=1 << 20),
        dict(param_remainders=1),
        dict(moment_dtype=torch.float16),
        dict(collective_timeout=-1),
        dict(replicate_state=True),
        dict(mesh="grid"),
        dict(communicator="gloo"),
    ],
)
def test_construction_errors_name_zeromuon(options):
    model = model_for(torch.float32)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as caught:
        ZeroMuon(zero_muon_groups(model), **MUON, **options)
    _named_zeromuon(caught)


def test_construction_errors_from_the_plan_name_zeromuon():
    model = model_for(torch.float32)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError) as caught:  # a parameter that is not the model's
        ZeroMuon([{"params": [other.weight]}], **MUON, module=model)
    _named_zeromuon(caught)
    with pytest.raises(ValueError) as caught:  # a param group's hyperparameter, checked by its rule
        ZeroMuon([{"params": [model.embed.weight], "use_muon": False, "rule": "adamw", "betas": (0.9, 2.0)}])
    _named_zeromuon(caught)


def test_every_public_call_names_zeromuon():
    model = model_for(torch.float32)
    opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=2, module=model)
    calls = [
        lambda: opt.step(grad_scaler=object()),
        lambda: opt.clip_grad_norm_(1.0, norm_type=1.0),
        lambda: opt.clip_grad_norm_(-1.0),
        lambda: opt.load_state_dict({"state": {}}),
        lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}),
        lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": "yes"}),
        lambda: opt.offload_states(include="weights"),
        lambda: opt.offload_states(include=[3]),
        lambda: opt.offload_states(include=[]),
        lambda: opt.offload_states(pin_memory=1),
        lambda: opt.reload_states(non_blocking=1),
        lambda: next(iter(opt.named_full_params(module=3))),
        lambda: next(iter(opt.named_full_params(buffers=1))),
        lambda: next(iter(opt.named_full_params(module=torch.nn.Linear(2, 2)))),
    ]
    for call in calls:
        with pytest.raises((ValueError, TypeError, RuntimeError)) as caught:
            call()
        _named_zeromuon(caught)
    with pytest.raises(ValueError) as caught:
        with opt.gathered_params(modifier_rank=5):
            pass
    _named_zeromuon(caught)
    # offloaded: every call that would read a parked byte refuses, naming ZeroMuon and reload_states()
    loss_fn(model, batch(0, 0)).backward()
    opt.offload_states()
    for call in (opt.step, lambda: opt.clip_grad_norm_(1.0), opt.zero_grad, opt.finish_sync, opt.state_dict):
        with pytest.raises(RuntimeError, match="reload_states") as caught:
            call()
        _named_zeromuon(caught)
    with pytest.raises(RuntimeError) as caught:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    _named_zeromuon(caught)
    opt.reload_states()
    opt.step()
    # the step's own checks: a parameter frozen at construction made trainable since
    opt.close()
    model = model_for(torch.float32)
    model.head.weight.requires_grad_(False)  # given to the optimizer frozen: it has no shard
    opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=2, module=model)
    model.head.weight.requires_grad_(True)
    with pytest.raises(ValueError) as caught:
        opt.step()
    _named_zeromuon(caught)
    opt.close()
    with pytest.raises(RuntimeError, match="closed") as caught:  # closed
        opt.step()
    _named_zeromuon(caught)


def test_a_newer_optimizer_takes_over_and_names_both():
    model = model_for(torch.float32)
    before = dict(vars(model.blocks[0].qkv.weight))
    first = ZeroMuon(zero_muon_groups(model), **MUON, stage=2, module=model)
    assert dict(vars(model.blocks[0].qkv.weight)) == before  # nothing stamped on the parameters
    with pytest.warns(UserWarning, match=r"^zero_ext\.ZeroMuon: these parameters belonged to an earlier ZeroMuon"):
        second = ZeroMuon(zero_muon_groups(model), **MUON, stage=2, module=model)
    with pytest.raises(RuntimeError, match=r"^zero_ext\.ZeroMuon: this optimizer was closed"):
        first.step()
    second.close()


@pytest.mark.parametrize("cls", [ZeroAdamW, ZeroMuon])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_close_twice_is_once(cls, stage):
    model = model_for(torch.float32)
    groups = zero_muon_groups(model) if cls is ZeroMuon else model.parameters()
    kwargs = MUON if cls is ZeroMuon else {}
    opt = cls(groups, **kwargs, stage=stage, module=model)
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    opt.offload_states()
    opt.close()  # reloads first: the model keeps its parameters
    opt.close()
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match=rf"^zero_ext\.{cls.__name__}: this optimizer was closed"):
        opt.zero_grad()
    # closed: no hook of it is left on the model, and a new optimizer over the parameters takes them without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = cls(zero_muon_groups(model) if cls is ZeroMuon else model.parameters(), **kwargs, stage=stage,
                    module=model)  # fmt: skip
    loss_fn(model, batch(1, 0)).backward()
    again.step()
    again.close()
