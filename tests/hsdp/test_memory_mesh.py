"""memory.estimate / MemoryReport on an HSDP mesh (R replicas x S shard ranks): the formulas by hand, the 1-D layout
as the mesh (1, N), the sharded-everywhere default below FSDP2's HSDP, and the report's mesh fields."""

from fractions import Fraction

import pytest
import torch

from zero_ext import ZeroAdamW, memory
from zero_ext.memory import estimate, estimate_breakdown, mesh_divisors

PSI = 6400


@pytest.mark.parametrize("replicate_state", [False, True])
@pytest.mark.parametrize("mesh", [(8, 8), (2, 4), (3, 2), (4, 1)])
def test_mesh_formulas_by_hand(mesh, replicate_state):
    r, s = mesh
    d = s if replicate_state else r * s  # the ranks one copy of the optimizer state is spread over
    kw = dict(mesh=mesh, replicate_state=replicate_state)
    assert estimate(PSI, r * s, 1, **kw) == 2 * PSI + 2 * PSI + 12 * PSI / d
    assert estimate(PSI, r * s, 2, **kw) == 2 * PSI + 2 * PSI / s + 12 * PSI / d
    assert estimate(PSI, None, 3, **kw) == 4 * PSI / s + 12 * PSI / d
    assert estimate(PSI, r * s, 0, **kw) == 16 * PSI  # DDP: nothing sharded


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("engine", [False, True])
def test_the_1d_layout_is_the_mesh_1_by_n(stage, engine):
    if engine and stage == 0:
        return
    for n in (1, 2, 8):
        kw = dict(engine=engine, param_remainders=True, moment_dtype=torch.int8)
        assert estimate_breakdown(PSI, n, stage, mesh=(1, n), **kw) == estimate_breakdown(PSI, n, stage, **kw)
        # one replica: the replicated state is the sharded one
        assert estimate(PSI, n, stage, mesh=(1, n), replicate_state=True) == estimate(PSI, n, stage)


def test_replicated_state_is_fsdp2_hsdp_and_the_default_is_below_it():
    r, s = 8, 8
    fsdp2_hsdp = (4 + 4 + 8) * PSI / s  # fp32 sharded params (the master), fp32 grads, AdamW's two moments, over S
    assert estimate(PSI, 64, 3, mesh=(r, s), replicate_state=True) == fsdp2_hsdp
    assert estimate(PSI, 64, 3, mesh=(r, s)) == (2 + 2) * PSI / s + 12 * PSI / (r * s) < fsdp2_hsdp
    assert estimate(PSI, 64, 3, mesh=(r, s), engine=True) < fsdp2_hsdp
    assert estimate(PSI, 64, 3) < estimate(PSI, 64, 3, mesh=(r, s))  # 1-D over 64 still leanest, at its traffic


def test_engine_mesh_stage3_keeps_the_shard_groups_param_shard_unless_the_state_is_the_shard_groups():
    sharded = estimate_breakdown(PSI, 8, 3, mesh=(2, 4), engine=True)
    assert sharded["params"] == 2 * PSI / 4  # the gather's input: the master is half of it
    assert sharded["grads"] == 4 * PSI / 4  # the fp32 gradient shard of the shard group
    assert sharded["optimizer_states"] == 12 * PSI / 8
    replicated = estimate_breakdown(PSI, 8, 3, mesh=(2, 4), replicate_state=True, engine=True)
    assert replicated["params"] == 0 and replicated["optimizer_states"] == 12 * PSI / 4


def test_mesh_errors():
    for args, kw, match in [
        ((PSI, 8, 2), dict(mesh=(2, 2)), "world_size 8"),
        ((PSI, 8, 2), dict(replicate_state=True), "mesh"),
        ((PSI, None, 2), dict(mesh=(2,)), "two ints"),
        ((PSI, None, 2), dict(mesh=(0, 4)), "two ints"),
        ((PSI, None, 2), {}, "world_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            estimate(*args, **kw)
    assert mesh_divisors(None, (3, 2)) == (2, 6) and mesh_divisors(6, (3, 2), True) == (2, 2)


def _one_process_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    opt = ZeroAdamW(model.parameters(), stage=2)
    model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return opt


def test_report_mesh_fields_and_formula():
    opt = _one_process_opt()
    try:
        state = opt.sharded_state
        plain = memory.report(state)
        assert plain.mesh is None and plain.layout_line() == "1 ranks"
        as_mesh = memory.report(state, mesh=(1, 1))
        assert as_mesh.formula == plain.formula and as_mesh.estimate == plain.estimate
        # two replicas of this one-rank shard group, the state sharded over both: this rank holds half of it
        two = memory.report(state, mesh=(2, 1))
        psi = plain.num_params
        assert two.world_size == 2 and two.mesh == (2, 1) and not two.replicate_state
        assert Fraction(plain.formula - two.formula) == Fraction(12 * psi, 2)
        assert two.estimate == estimate(psi, 2, 2, mesh=(2, 1))
        text = two.table()
        assert "mesh 2 x 1 (replicate x shard)" in text and "12/(R x S)" in text
        rep = memory.report(state, mesh=(2, 1), replicate_state=True)
        assert rep.formula == plain.formula and "replicated 2x" in rep.table()
        with pytest.raises(ValueError, match="shard ranks"):
            memory.report(state, mesh=(1, 2))
    finally:
        opt.close()
