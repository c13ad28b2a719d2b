"""ZeroAdamW on a 2-D mesh against the unsharded run of the same kernel fed the mesh's mean gradients (each node's
mean, then the mean of the nodes': mesh_runs.tree_mean), bitwise, at stages 1, 2 and 3, offload None / cpu / nvme,
bf16 parameters and param_remainders, on 4 gloo ranks as 2 x 2 and 6 as 2 x 3 and 3 x 2, with the state sharded
over every rank (default) or replicated over the nodes (replicate_state=True); the stages equal each other
bitwise on one mesh. The mesh's mean differs from the 1-D mean only in its summation order; ``test_mesh_against_
torch_adamw`` checks the run against torch.optim.AdamW on the 1-D mean at fp32 tolerance."""

import pytest
import torch
from distributed import run_on_ranks
from mesh_runs import train_kw
from pairwise import pairwise_params

slow = pytest.mark.slow


@pytest.mark.parametrize("replicate_state", [False, True])
def test_stages_on_a_2x2_mesh_are_bitwise_the_reference_and_each_other(replicate_state):
    digests = set()
    for stage in (1, 2, 3):
        out = run_on_ranks(4, train_kw, (2, 2), stage, dict(replicate_state=replicate_state))
        digests |= {digest for digest, _ in out}
    assert len(digests) == 1, "stages (or ranks) disagree"


# Mesh shape, stage and replicate_state act independently: every pair of their values, 6 runs of the 12 combinations
# (tests/helpers/pairwise.py).
SIX_RANKS = {"shape": [(2, 3), (3, 2)], "stage": [1, 2, 3], "replicate_state": [False, True]}


@slow
@pytest.mark.parametrize("shape,stage,replicate_state", pairwise_params(SIX_RANKS, ids={"shape": ["2x3", "3x2"]}))
def test_six_ranks(shape, stage, replicate_state):
    out = run_on_ranks(6, train_kw, shape, stage, dict(replicate_state=replicate_state))
    assert len({digest for digest, _ in out}) == 1


@pytest.mark.parametrize("offload", ["cpu", pytest.param("nvme", marks=slow)])
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=slow)])
def test_offload_on_a_mesh(offload, stage, tmp_path):
    run_on_ranks(4, train_kw, (2, 2), stage, dict(offload=offload, root=str(tmp_path)))


@pytest.mark.parametrize(
    "precision",
    [dict(dtype_name="bfloat16"), pytest.param(dict(dtype_name="bfloat16", param_remainders=True), marks=slow)],
    ids=["bf16", "remainders"],
)
@pytest.mark.parametrize("stage", [pytest.param(1, marks=slow), 2, 3])
def test_precision_settings_on_a_mesh(precision, stage):
    run_on_ranks(4, train_kw, (2, 2), stage, precision)


def test_a_one_replica_mesh_and_a_one_dimensional_mesh_are_the_one_dimensional_layout():
    """(1, 4) and a 1-D DeviceMesh: today's layout, the reference's own mean, bitwise."""
    one_d = run_on_ranks(4, train_kw, None, 2, {})
    one_replica = run_on_ranks(4, train_kw, (1, 4), 2, {})
    assert {d for d, _ in one_d} == {d for d, _ in one_replica}
    assert all(stats.get("inter_node_bytes", 0) == 0 for _, stats in one_replica)


def test_mesh_against_torch_adamw():
    """The mesh's run against torch.optim.AdamW on the 1-D mean (its own summation order) at fp32 tolerance."""
    run_on_ranks(4, _against_torch, (2, 2))


def _against_torch(rank, world, shape):
    from engine_reference import rank_grads, set_mean_grads
    from mesh_runs import HYPER, batch, loss_fn, model_for, optimizer, param_groups

    model = optimizer_model = model_for(torch.float32)
    opt = optimizer(optimizer_model, shape, 2)
    ref_model = model_for(torch.float32)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": g["params"]} for g in param_groups(ref_model)]
    ref_opt = torch.optim.AdamW(groups, **{**HYPER, "lr": 1e-3})
    for g in opt.param_groups:
        g["lr"] = g["lr"] / 10  # both at a tenth of the mesh runs' lr: Adam's near-zero gradients amplify order
    for gr in ref_opt.param_groups:
        gr["lr"] = [g["lr"] for g in opt.param_groups][ref_opt.param_groups.index(gr)]
    for step in range(3):
        batches = [batch(step, r) for r in range(world)]
        set_mean_grads(
            list(ref_model.parameters()), rank_grads(ref_model, list(ref_model.parameters()), batches, loss_fn)
        )
        ref_opt.step()
        loss_fn(model, batches[rank]).backward()
        opt.step()
        opt.zero_grad()
    expected = {names[id(p)]: p.detach() for p in ref_model.parameters()}
    with opt.gathered_params():
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-5, msg=name)
    opt.close()


def _accumulate(rank, world, shape, stage, pattern):
    """Two steps of two micro-batches; ``pattern``: "sync-last" (the first under no_sync), "step-in-no-sync" (both
    under no_sync: step() sends the held sums), "dropped" (a no_sync micro-batch, then opt.zero_grad(), then one),
    "model-dropped" (the same with model.zero_grad())."""
    from mesh_runs import batch, full_copies, loss_fn, model_for, optimizer

    model = model_for(torch.float32)
    opt = optimizer(model, shape, stage)
    for step in range(2):
        if pattern in ("dropped", "model-dropped"):
            with opt.no_sync():
                loss_fn(model, batch(10 + step, rank)).backward()
            (opt if pattern == "dropped" else model).zero_grad()  # the held sums go with the gradients
            loss_fn(model, batch(step, rank)).backward()
        else:
            with opt.no_sync():
                loss_fn(model, batch(step, rank)).backward()
                if pattern == "step-in-no-sync":
                    loss_fn(model, batch(step + 5, rank)).backward()
            if pattern == "sync-last":
                loss_fn(model, batch(step + 5, rank)).backward()
        opt.step()
        opt.zero_grad()
    return full_copies(model, opt)


@pytest.mark.parametrize("pattern", ["sync-last", "step-in-no-sync", "dropped", "model-dropped"])
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=slow)])
def test_no_sync_accumulation_on_a_mesh(stage, pattern):
    """The node-held sums cross nodes once and give the 1-D run's result up to the summation order: Adam divides a
    near-zero gradient by its own magnitude, so an element whose mean is ~0 may move by a fraction of one update
    (lr = 1e-2): atol 2 % of an update. A held sum lost or sent twice moves every element by a whole update."""
    flat = run_on_ranks(4, _accumulate, None, stage, pattern)[0]
    mesh = run_on_ranks(4, _accumulate, (2, 2), stage, pattern)[0]
    for a, b in zip(flat, mesh):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=2e-4)


def _muon(rank, world, shape, stage, replicate_state):
    from mesh_runs import full_copies, make_mesh, train_steps
    from muon_reference import MUON, freeze, zero_muon_groups
    from tiny_transformer import build

    from zero_ext import ZeroMuon

    model = build(torch.float32)
    freeze(model)
    opt = ZeroMuon(zero_muon_groups(model), **MUON, stage=stage, module=model, bucket_size=1500,
                   mesh=make_mesh(shape), replicate_state=replicate_state)  # fmt: skip
    train_steps(model, opt, rank, 3)
    return full_copies(model, opt)


def test_zero_muon_on_a_mesh():
    """ZeroMuon's whole matrices on their owners, on a 2 x 2 mesh: stages 1-3 and both state layouts bitwise equal
    (each matrix's mean gradient is the same tree's), and the 1-D run's result up to the summation order."""
    runs = [run_on_ranks(4, _muon, (2, 2), stage, rep) for stage in (1, 2, 3) for rep in (False, True)]
    for run in runs:
        for rank in run[1:]:
            assert all(torch.equal(a, b) for a, b in zip(run[0], rank)), "ranks differ"
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], run[0])), "stages or layouts differ"
    flat = run_on_ranks(4, _muon, None, 2, False)[0]
    for a, b in zip(flat, runs[0][0]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


def _moments(rank, world, shape, stage, moment_dtype):
    from mesh_runs import full_copies, model_for, optimizer, train_steps

    model = model_for(torch.float32)
    kw = {} if moment_dtype is None else {"moment_dtype": getattr(torch, moment_dtype)}
    opt = optimizer(model, shape, stage, **kw)
    train_steps(model, opt, rank, 3)
    return full_copies(model, opt)


@pytest.mark.parametrize("moment_dtype", ["bfloat16", pytest.param("int8", marks=slow)])
def test_low_precision_moments_on_a_mesh(moment_dtype):
    """bf16 (stochastic rounding keyed on each element's canonical index) and int8 moments on a 2 x 2 mesh: the
    stages bitwise equal (the layout is the 1-D layout of 4 ranks, so the keys are those of any layout), and the run
    the 1-D run's with the same moments up to the mean's summation order (a fraction of one update, as above)."""
    runs = [run_on_ranks(4, _moments, (2, 2), stage, moment_dtype) for stage in (1, 2, 3)]
    for run in runs:
        assert all(torch.equal(a, b) for rank in run for a, b in zip(runs[0][0], rank))
    flat = run_on_ranks(4, _moments, None, 2, moment_dtype)[0]
    for a, b in zip(flat, runs[0][0]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=2e-4)


def _unread(rank, world, shape, stage, replicate_state):
    """Four steps with nothing read in between (step() returns with the replicas' gathers of stage 3's chunks in
    flight; the next forward's gathers must wait for them): the parameters' digest."""
    from engine_reference import params_digest
    from mesh_runs import model_for, optimizer, train_steps

    model = model_for(torch.float32)
    opt = optimizer(model, shape, stage, replicate_state=replicate_state)
    train_steps(model, opt, rank, 4)
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest


@pytest.mark.parametrize("replicate_state", [False, True])
def test_stage3_forward_waits_for_the_replicas_gathers(replicate_state):
    """Stage 3 equals stage 2 bitwise when nothing between the steps waits for the step's communication (a forward
    that gathered a chunk still being written trained on the other replicas' previous slices: off by a step)."""
    for _ in range(2):
        two = run_on_ranks(4, _unread, (2, 2), 2, replicate_state)
        three = run_on_ranks(4, _unread, (2, 2), 3, replicate_state)
        assert set(two) == set(three) and len(set(two)) == 1
