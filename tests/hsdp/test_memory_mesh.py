"""memory.estimate / MemoryReport on an HSDP mesh (R replicas x S shard ranks): the formulas by hand, the 1-D layout
as the mesh (1, N), the sharded-everywhere default below FSDP2's HSDP, and the report's mesh fields."""

from fractions import Fraction

import pytest
import torch

from zero_ext.memory import estimate, estimate_breakdown, mesh_divisors

PSI = 6400


@pytest.mark.parametrize("replicate_state", [False, True])
@pytest.mark.parametrize("mesh", [(8, 8), (2, 4), (3, 2), (4, 1)])
def test_mesh_formulas_by_hand(mesh, replicate_state):
    r, s = mesh
    d = s if replicate_state else r * s  # the ranks one copy of the optimizer state is spread over
    kw = dict(mesh=mesh, replicate_state=replicate_state)
    assert estimate(PSI, r * s, 1, **kw) == pytest.approx(2 * PSI + 2 * PSI + 12 * PSI / d, rel=1e-12)
    assert estimate(PSI, r * s, 2, **kw) == pytest.approx(2 * PSI + 14 * PSI / d, rel=1e-12)
    assert estimate(PSI, None, 3, **kw) == pytest.approx(2 * PSI / s + 14 * PSI / d, rel=1e-12)
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
    assert estimate(PSI, 64, 3, mesh=(r, s)) == 2 * PSI / s + 14 * PSI / (r * s) < fsdp2_hsdp
    assert estimate(PSI, 64, 3, mesh=(r, s), engine=True) < fsdp2_hsdp
    assert estimate(PSI, 64, 3) < estimate(PSI, 64, 3, mesh=(r, s))  # 1-D over 64 still leanest, at its traffic


def test_engine_mesh_stage3_keeps_the_shard_groups_param_shard_unless_the_state_is_the_shard_groups():
    sharded = estimate_breakdown(PSI, 8, 3, mesh=(2, 4), engine=True)
    assert sharded["params"] == 2 * PSI / 4  # the chunk the shard group gathers from: the master is half of it
    assert sharded["grads"] == 4 * PSI / 8  # the fp32 gradient shard: the state's slice
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


def _report_on_mesh(rank, world, stage, replicate_state):
    import torch.distributed as dist
    from mesh_runs import make_mesh, model_for, optimizer
    from tiny_transformer import batch, loss_fn

    torch.manual_seed(0)
    model = model_for(torch.bfloat16)
    opt = optimizer(model, (2, 2), stage, replicate_state=replicate_state)
    try:
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        r = opt.memory_report()  # the mesh and the state layout passed by the optimizer
        extras = r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers - r.param_shard_not_kept
        out = dict(identity=r.total + sum(r.on_disk.values()) == r.formula + extras, formula=r.formula,
                   psi=r.num_params, widths=r.widths, world=r.world_size, text=r.table(), estimate=r.estimate,
                   params=r.allocated.get("params", 0))  # fmt: skip
        dist.barrier()
        return out
    finally:
        opt.close()
        del make_mesh


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("replicate_state", [False, True])
def test_report_on_a_2x2_mesh_accounts_every_byte(stage, replicate_state):
    from distributed import run_on_ranks

    reports = run_on_ranks(4, _report_on_mesh, stage, replicate_state)
    for r in reports:
        assert r["identity"] and r["world"] == 4, r["text"]
        assert ("replicated 2x" in r["text"]) == replicate_state and "mesh 2 x 2 (replicate x shard)" in r["text"]
    psi, widths = reports[0]["psi"], reports[0]["widths"]
    # the formula's shares of the real parameters average to the estimate (the mesh's split of them)
    kw = dict(mesh=(2, 2), replicate_state=replicate_state, **widths)
    assert Fraction(sum(Fraction(r["formula"]) for r in reports), 4) == sum(
        estimate_breakdown(psi, 4, stage, **kw).values()
    )
    if stage == 3 and not replicate_state:  # each rank keeps its chunk of the parameters: 1/S, not 1/N
        assert sum(r["params"] for r in reports) >= 2 * psi * 2
