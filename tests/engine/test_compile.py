"""``torch.compile(model)`` at every stage, counted with dynamo's own counters on a GPT whose blocks have different
widths (so that a graph compiled for one block does not serve the next): stages 1 and 2 compile the whole forward
as one graph with no graph break; stage 3 compiles each block as one graph (its gather unit, zero_ext/engine/
gather_units.py), one graph per other module owning parameters (embedding, final norm, head), nothing recompiled
after the first step and no recompile-limit warning; the losses are bitwise eager's with the ``eager`` backend and
within compiled DDP's own distance from eager with inductor; the window stays within its bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from distributed import run_on_ranks
from dynamo_watch import watching_dynamo
from tiny_transformer import GPT, HEADS, SEQ, VOCAB, GPTConfig, batch, loss_fn

from zero_ext import ZeroAdamW

WIDTHS = (40, 72, 56)  # each block's MLP width: three block shapes
STEPS = 4


def _model() -> nn.Module:
    from gpt_model import Block

    torch.manual_seed(0)
    config = GPTConfig(VOCAB, SEQ, 24, len(WIDTHS), HEADS)
    model = GPT(config)
    model.blocks = nn.ModuleList(Block(replace(config, mlp_hidden=w)) for w in WIDTHS)
    return model


def _losses(net, opt, rank, after_step=lambda: None) -> list:
    """STEPS training steps of ``net`` on this rank's batches; their losses."""
    losses = []
    for step in range(STEPS):
        loss = loss_fn(net, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after_step()
    return losses


def _train(rank, world, stage, backend, gather_units="auto"):
    """Losses of STEPS steps, and with ``backend`` dynamo's counts: graphs compiled after each step, graph breaks,
    recompile-limit warnings."""
    from torch._dynamo.utils import counters

    model = _model()
    opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=stage, module=model, bucket_size=1024,
                    gather_units=gather_units)  # fmt: skip
    with watching_dynamo() as seen:
        net = torch.compile(model, backend=backend) if backend else model
        graphs = []
        losses = _losses(net, opt, rank, after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    report = opt.memory_report()
    opt.close()
    return {
        "losses": losses,
        "graphs": graphs,
        "breaks": seen["breaks"],
        "limit_hits": seen["limit_hits"],
        "window": (report.window_peak, report.window_bound) if stage == 3 else None,
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_compile_the_whole_forward_without_a_graph_break(stage):
    """Nothing of zero_ext runs in forward at stages 1 and 2 but the root's check that the model is not inside DDP,
    which dynamo traces (a guard on DDP's active module): one graph, no break."""
    eager, compiled = (run_on_ranks(1, _train, stage, backend)[0] for backend in (None, "eager"))
    assert compiled["breaks"] == 0, compiled
    assert compiled["graphs"] == [1] * STEPS, compiled
    assert compiled["losses"] == eager["losses"]


@pytest.mark.parametrize("world", [1, 2])
def test_stage3_compiles_each_block_as_one_graph(world):
    """One graph per block shape (3) and per other module owning parameters (embedding, final norm, head: 3), all
    compiled in the first step; one graph break reported (the first unit's gather hook inside the root's loop:
    dynamo then runs the root's own few ops eagerly and compiles every module it calls as its own frame)."""
    eager = run_on_ranks(world, _train, 3, None)
    compiled = run_on_ranks(world, _train, 3, "eager")
    for rank in range(world):
        c = compiled[rank]
        assert c["limit_hits"] == [], c["limit_hits"]
        assert c["graphs"] == [len(WIDTHS) + 3] * STEPS, c  # nothing recompiled after the first step
        assert c["breaks"] <= 1, c
        assert c["losses"] == eager[rank]["losses"]  # bitwise: the eager backend runs the same kernels
        peak, bound = c["window"]
        assert 0 < peak <= bound
        assert c["window"] == eager[rank]["window"]


def test_a_gather_unit_per_module_breaks_the_graph_at_every_module():
    """``gather_units="modules"`` (the finest window) is what stage 3 did before units: dynamo compiles module by
    module (15 graphs here instead of 6); the losses are the same."""
    units = run_on_ranks(1, _train, 3, "eager")[0]
    modules = run_on_ranks(1, _train, 3, "eager", "modules")[0]
    assert modules["graphs"][-1] > units["graphs"][-1]
    assert modules["losses"] == units["losses"]
    assert modules["window"][0] < units["window"][0]  # ... and the smaller window


def test_gather_units_may_name_module_classes():
    """A tuple of module classes makes their instances the units: ``(Block,)`` names what "auto" finds here."""
    from gpt_model import Block

    by_class = run_on_ranks(1, _train, 3, "eager", (Block,))[0]
    auto = run_on_ranks(1, _train, 3, "eager")[0]
    assert by_class["graphs"] == auto["graphs"]
    assert by_class["losses"] == auto["losses"]


@pytest.mark.parametrize("bad", ["blocks", (nn.Linear, "x"), 3, ()])
def test_bad_gather_units_are_refused_naming_the_option(bad):
    model = _model()
    with pytest.raises(ValueError, match="`gather_units` must be 'auto', 'modules' or a tuple of nn.Module classes"):
        ZeroAdamW(model.parameters(), stage=3, module=model, gather_units=bad)


def _ddp_compiled(rank, world, stage):
    model = _model()
    opt = ZeroAdamW(model.named_parameters(), stage=stage, module=model)
    ddp = torch.compile(nn.parallel.DistributedDataParallel(model), backend="eager")
    with pytest.raises(RuntimeError, match="running inside DistributedDataParallel"):
        loss_fn(ddp, batch(0, rank))
    opt.close()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_a_compiled_ddp_wrapper_is_still_refused(stage):
    """The DDP check runs inside the compiled graph now (a guard on DDP's active module): still refused."""
    assert all(run_on_ranks(2, _ddp_compiled, stage))


def _step_compiled(rank, world, stage):
    results = []
    for compile_step in (False, True):
        model = _model()
        opt = ZeroAdamW(model.named_parameters(), lr=1e-2, stage=stage, module=model, bucket_size=1024)
        step = torch.compile(opt.step, backend="eager") if compile_step else opt.step
        for s in range(2):
            loss_fn(model, batch(s, rank)).backward()
            step()
            opt.zero_grad()
        with opt.gathered_params():
            results.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    return all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_compiled_optimizer_step_runs_the_same_step(stage):
    """``torch.compile(opt.step)``: the step is one fused kernel per bucket already and dynamo skips it
    (``torch.compiler.disable``): the same parameters, bitwise."""
    assert all(run_on_ranks(2, _step_compiled, stage))


def _train_ddp(rank, world, backend):
    """DDP + torch.optim.AdamW on the same model and batches: losses of STEPS steps."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    return _losses(torch.compile(ddp, backend=backend) if backend else ddp, opt, rank)


@pytest.mark.slow
def test_stage3_under_inductor_matches_eager_within_compiled_ddps_distance():
    """Inductor fuses differently from eager, so no run is bitwise eager's: compiled stage 3 must be as close to
    eager stage 3 as compiled DDP is to eager DDP (twice that, or 1e-6, as the margin)."""
    ddp_eager, ddp_compiled = (run_on_ranks(1, _train_ddp, backend)[0] for backend in (None, "inductor"))
    eager3, ind3 = (run_on_ranks(1, _train, 3, backend)[0] for backend in (None, "inductor"))
    spread = max(abs(a - b) for a, b in zip(ddp_compiled, ddp_eager))
    for a, b in zip(ind3["losses"], eager3["losses"]):
        assert abs(a - b) <= max(2 * spread, 1e-6)
    assert ind3["limit_hits"] == [] and ind3["graphs"][-1] == len(WIDTHS) + 3
