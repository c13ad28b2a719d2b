"""opt.add_param_group() after construction (issue 25): progressive unfreezing. A model with its first block frozen
trains, the block is unfrozen and added as a new group with its own lr, and training goes on like torch.optim.AdamW
given the same add_param_group (tolerance), and bitwise like an unsharded run of the engine's own kernel (per-group
lr, per-parameter step counts), on 1, 2 and 3 gloo ranks, stages 1-3, with and without offload; errors are agreed
on every rank and change nothing. Checkpoints: test_add_param_group_checkpoint.py."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, params_digest, rank_grads, reference, state_shards
from tiny_transformer import batch, build, loss_fn
from unfreezing import HYPER, KernelReference, block0, frozen_start, train, unfreeze, world_batches

from zero_ext import ZeroAdamW


# ---------------------------------------------------------------------------------------------------------- training
def _trains_like_torch(rank, world, stage, dtype_name, offload, root, defer=False):
    dtype = getattr(torch, dtype_name)
    model, opt = frozen_start(dtype, stage, rank, world, offload, root, defer=defer)
    kref = KernelReference(dtype)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    # torch's AdamW, given the same groups, on fp32 copies fed the mean gradients
    ref_model = build(dtype).float()  # fp32 copies of the rounded start
    ref_named = dict(ref_model.named_parameters())
    first = [n for n, p in model.named_parameters() if p.requires_grad]
    torch_opt = torch.optim.AdamW([ref_named[n] for n in first], **HYPER)
    ref_params = list(ref_model.parameters())

    def torch_step(step):
        # on the kernel reference's model: bitwise the engine's parameters (checked), and full at stage 3 too
        ref_grads = rank_grads(kref.model, list(kref.model.parameters()), world_batches(step, world), loss_fn)
        for i, p in enumerate(ref_params):
            gs = [g[i] for g in ref_grads]
            p.grad = None if gs[0] is None else sum(g.float() for g in gs) / len(gs)
        torch_opt.step()

    for step in range(2):
        torch_step(step)
        train(model, opt, kref, step, rank, world)
    before = opt.memory_report()

    unfreeze(model, opt)
    kref.add_group(block0(model), HYPER["lr"] / 10)
    torch_opt.add_param_group({"params": [ref_named[n] for n in block0(model)], "lr": HYPER["lr"] / 10})
    assert len(opt.param_groups) == len(torch_opt.param_groups) == 2
    for key in ("betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused"):
        assert opt.param_groups[1][key] == torch_opt.param_groups[1][key], key  # torch's defaults, filled as torch does
    assert opt.param_groups[1]["lr"] == HYPER["lr"] / 10
    assert opt.param_groups[1]["param_names"] == block0(model)
    assert any(g.group_index == 1 for g in opt.sharded_state.groups)
    after = opt.memory_report()  # the new group's parameters and state counted
    assert after.num_params == before.num_params + sum(p.numel() for p in model.blocks[0].parameters())
    assert after.total > before.total

    for step in range(2, 5):
        torch_step(step)
        train(model, opt, kref, step, rank, world)
    names = [n for n, _ in model.named_parameters()]
    in_opt_order = [ref_named[n] for n in first + block0(model)]
    with opt.gathered_params():  # (stage 3: the parameters full)
        kref.check(opt, model)  # bitwise: params, this rank's master and moments, every step count
        check_against_reference(opt, model, [ref_named[n] for n in names], rank, ref_in_opt_order=in_opt_order)
        digest = params_digest(model)
    assert opt.step_count == 5
    return digest


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_added_group_trains_like_torch(world, stage):
    digests = run_on_ranks(world, _trains_like_torch, stage, "bfloat16", None, None)
    assert len(set(digests)) == 1


@pytest.mark.parametrize(("stage", "offload"), [(1, "cpu"), (2, "cpu"), (3, "cpu"), (2, "nvme"), (3, "nvme")])
def test_an_added_group_trains_with_offload(tmp_path, stage, offload):
    digests = run_on_ranks(2, _trains_like_torch, stage, "bfloat16", offload, str(tmp_path))
    assert len(set(digests)) == 1


def test_an_added_fp32_group_trains_like_torch():
    digests = run_on_ranks(2, _trains_like_torch, 2, "float32", None, None)
    assert len(set(digests)) == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_an_added_group_trains_with_deferred_gathers(stage):
    digests = run_on_ranks(2, _trains_like_torch, stage, "bfloat16", None, None, True)
    assert len(set(digests)) == 1


# ------------------------------------------------------------------------------------------------------------- errors
def _refused_everywhere(opt, model, call, match):
    """``call`` raises ``match`` on this rank; nothing changed: param groups, shards, parameters."""
    groups, shards = [dict(g) for g in opt.param_groups], state_shards(opt)
    with opt.gathered_params():
        digest = params_digest(model)
    with pytest.raises(ValueError, match=match):
        call()
    assert [dict(g) for g in opt.param_groups] == groups
    assert all(torch.equal(a, b) for a, b in zip(shards, state_shards(opt)))
    with opt.gathered_params():
        assert params_digest(model) == digest


def _errors(rank, world, stage):
    model, opt = frozen_start(torch.bfloat16, stage, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    train(model, opt, kref, 0, rank, world)
    block = model.blocks[0]
    add = opt.add_param_group
    # block 0 still frozen: named
    _refused_everywhere(
        opt, model, lambda: add({"params": block.parameters()}), r"'blocks\.0\.ln1\.weight' has requires_grad=False"
    )
    block.requires_grad_(True)
    # a parameter already in a group, named with its group
    _refused_everywhere(
        opt, model, lambda: add({"params": [block.fc.weight, model.pos]}), r"'pos' is already in param group 0"
    )
    # (a parameter listed twice warns as torch does and is added once: tests/torch_compat/test_duplicate_params.py)
    _refused_everywhere(opt, model, lambda: add({"params": []}), "has no parameters")
    _refused_everywhere(opt, model, lambda: add({"params": {block.fc.weight}}), "is a set")
    _refused_everywhere(opt, model, lambda: add({"params": [block.fc.weight * 2]}), "not a leaf")
    stray = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    _refused_everywhere(opt, model, lambda: add({"params": [stray]}), "is not a parameter of `module`")
    double = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    _refused_everywhere(opt, model, lambda: add({"params": [double]}), "has dtype torch.float64")
    elsewhere = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="meta"))
    _refused_everywhere(
        opt, model, lambda: add({"params": [elsewhere]}), "is on meta, the optimizer's parameters on cpu"
    )
    # any bad hyperparameter (torch's defaults fill the others)
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "lr": -1.0}), r"param group 1.*lr")
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "betas": (0.9, 1.5)}), "betas")
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "eps": -1.0}), "eps")
    if world > 1:
        # a group that differs between ranks, or is invalid on one rank only: every rank raises
        lr = HYPER["lr"] / (10 if rank == 0 else 20)
        _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "lr": lr}), "differs between ranks")
        params = list(block.parameters()) if rank == 0 else [*block.parameters(), model.pos]
        _refused_everywhere(
            opt, model, lambda: add({"params": params}), r"failed on rank\(s\) \[1, 2\]|already in param group 0"
        )
    if stage == 3:
        with opt.gathered_params():
            with pytest.raises(ValueError, match="while parameters are gathered"):
                add({"params": block.parameters()})
    assert len(opt.param_groups) == 1
    # then the valid group is added and trains on (nothing half-done before)
    add({"params": block.parameters(), "lr": HYPER["lr"] / 10})
    kref.add_group(block0(model), HYPER["lr"] / 10)
    train(model, opt, kref, 1, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (3, 1), (3, 3)])
def test_errors_are_agreed_and_change_nothing(world, stage):
    run_on_ranks(world, _errors, stage)


# --------------------------------------------------------------------------------------------- when it is called
def _between_backward_and_step(rank, world, stage, grad_accum_dtype):
    """Added after backward, before step(): the gradients already reduced are applied by that step (the new
    parameters have none yet: they do not move, as with torch); stage 1's .grad stays what it was."""
    model, opt = frozen_start(torch.bfloat16, stage, rank, world, grad_accum_dtype=grad_accum_dtype)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    train(model, opt, kref, 0, rank, world)
    loss_fn(model, batch(1, rank)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # placeholders with a (no-op) scaling recorded
    unfreeze(model, opt)
    opt.step()
    opt.zero_grad()
    kref.step(world_batches(1, world))
    kref.add_group(block0(model), HYPER["lr"] / 10)
    train(model, opt, kref, 2, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)


@pytest.mark.parametrize(("stage", "grad_accum_dtype"), [(1, None), (1, torch.float32), (2, None), (3, None)])
def test_added_between_backward_and_step(stage, grad_accum_dtype):
    run_on_ranks(2, _between_backward_and_step, stage, grad_accum_dtype)


def test_the_added_group_launches_in_the_models_order():
    """Block 0's buckets launch after those of the parameters registered after it (block 1, ln_f: their gradients
    come first in backward); by their optimizer indices, the largest, they would launch first and hold back every
    other reduction until the end of backward."""
    model, opt = frozen_start(torch.bfloat16, 2, 0, 1)
    unfreeze(model, opt)
    order = opt.bucket_runtimes.in_launch_order()
    added = [k for k, rt in enumerate(order) if rt.group.group_index == 1]
    later = [k for k, rt in enumerate(order) if all(rt.group.names[i] not in ("embed.weight", "pos") for i in
             rt.bucket.slots) and rt.group.group_index == 0]  # fmt: skip
    assert added and later and max(later) < min(added)


def _clip_then_add(rank, world, stage, how):
    """A clipping recorded before the group is added (``opt.clip_grad_norm_``, or torch's function on the .grad
    placeholders) is applied by the step after it, as without the new group (which has no gradient yet)."""
    runs = []
    for adds in (True, False):
        model, opt = frozen_start(torch.bfloat16, stage, rank, world)
        for step in range(2):
            loss_fn(model, batch(step, rank)).backward()
            if step == 1:
                if adds and how == "torch after adding":  # the .grad placeholders stay across the adding
                    unfreeze(model, opt)
                if how == "opt":
                    norm = opt.clip_grad_norm_(0.05)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                assert norm > 0.1  # the clipping scales
                if adds and how != "torch after adding":
                    unfreeze(model, opt)
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (added, opt), (plain, opt_plain) = runs
    shards = state_shards(opt_plain)
    assert all(torch.equal(a, b) for a, b in zip(shards, state_shards(opt)[: len(shards)]))
    with opt.gathered_params(), opt_plain.gathered_params():
        assert params_digest(added) == params_digest(plain)  # block 0 unchanged: no gradient when it was added


@pytest.mark.parametrize(
    ("stage", "how"),
    [(1, "opt"), (2, "opt"), (1, "torch"), (3, "torch"), (1, "torch after adding"), (2, "torch after adding")],
)
def test_a_clipping_recorded_before_adding_applies(stage, how):
    run_on_ranks(2, _clip_then_add, stage, how)


def _no_sync_then_add(rank, world, stage):
    """Added inside ``no_sync()`` after a backward: the context stays on, and the accumulated gradients are applied by
    the next step as without the new group (which got none); the engine is the same object."""
    runs = []
    for adds in (True, False):
        model, opt = frozen_start(torch.bfloat16, stage, rank, world)
        engine = opt._engine
        with opt.no_sync():
            for step in range(2):
                loss_fn(model, batch(step, rank)).backward()
            if adds:
                unfreeze(model, opt)
                assert opt._engine is engine and not engine.grad_sync.sync_enabled
        assert engine.grad_sync.sync_enabled
        opt.step()
        opt.zero_grad()
        runs.append((model, opt))
    (added, opt), (plain, opt_plain) = runs
    shards = state_shards(opt_plain)
    assert all(torch.equal(a, b) for a, b in zip(shards, state_shards(opt)[: len(shards)]))
    with opt.gathered_params(), opt_plain.gathered_params():
        assert params_digest(added) == params_digest(plain)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_added_inside_no_sync(stage):
    run_on_ranks(2, _no_sync_then_add, stage)


def _stage3_window_carries_on(rank, world):
    """Stage 3: the gathered window's peak so far stays across the adding, and the added block's parameters are
    gathered by their unit from the next forward (hooked now: it had nothing to gather before)."""
    model, opt = frozen_start(torch.bfloat16, 3, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    for step in range(2):
        train(model, opt, kref, step, rank, world)
    peak = opt.memory_report().window_peak
    assert peak > 0
    unfreeze(model, opt)
    kref.add_group(block0(model), HYPER["lr"] / 10)
    assert opt.memory_report().window_peak == peak
    for step in range(2, 4):
        train(model, opt, kref, step, rank, world)
    assert opt.memory_report().window_peak >= peak
    with opt.gathered_params():
        kref.check(opt, model)


def test_stage3_window_carries_on():
    run_on_ranks(2, _stage3_window_carries_on)


# --------------------------------------------------------------------------------- rank 0's values, mixed dtypes
def _rank0_values(rank, world, stage):
    """The added parameters start from rank 0's values on every rank (sync_module_states, the default), as at
    construction: at stage 3 the shards are cut from them."""
    model, opt = frozen_start(torch.bfloat16, stage, rank, world)
    expected = [p.detach().clone() for p in model.blocks[0].parameters()]  # every rank's until now
    with torch.no_grad():
        for p in model.blocks[0].parameters():
            p.add_(rank)  # per-rank values (e.g. a re-initialisation seeded per rank)
    unfreeze(model, opt)
    with opt.gathered_params():
        assert all(torch.equal(p, e) for p, e in zip(model.blocks[0].parameters(), expected))
        return params_digest(model)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_added_parameters_start_from_rank0(stage):
    assert len(set(run_on_ranks(3, _rank0_values, stage))) == 1


class _ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.first = torch.nn.Linear(24, 40).to(torch.bfloat16)
        self.inner = torch.nn.Linear(40, 40)  # fp32
        self.outer = torch.nn.Linear(40, 8).to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.first(x.to(torch.bfloat16))).float()
        return self.outer(torch.tanh(self.inner(h)).to(torch.bfloat16)).float()


def _three_loss(model, b):
    return torch.nn.functional.mse_loss(model(b[0]), b[1])


def _three_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)


def _mixed_dtypes(rank, world, stage):
    """A group of fp32 and bf16 parameters becomes two flat groups, as at construction; both train like torch."""
    model = _ThreeLayers()
    model.inner.requires_grad_(False)
    model.outer.requires_grad_(False)
    opt = ZeroAdamW(model.first.parameters(), **HYPER, stage=stage, bucket_size=256, module=model)
    ref_params, ref_opt = reference(_ThreeLayers(), **HYPER)  # fp32 copies: first, inner, outer
    ref_opt.param_groups[0]["params"] = ref_params[:2]
    for step in range(4):
        if step == 2:
            model.inner.requires_grad_(True)
            model.outer.requires_grad_(True)
            opt.add_param_group({"params": [*model.inner.parameters(), *model.outer.parameters()], "lr": 1e-3})
            for p in ref_params[2:]:
                p.requires_grad_(True)
            ref_opt.add_param_group({"params": ref_params[2:], "lr": 1e-3})
            dtypes = [(g.group_index, str(g.dtype)) for g in opt.sharded_state.groups]
            assert dtypes == [(0, "torch.bfloat16"), (1, "torch.float32"), (1, "torch.bfloat16")]
        per_rank = rank_grads(
            model, list(model.parameters()), [_three_batch(step, r) for r in range(world)], _three_loss
        )
        for i, p in enumerate(ref_params):
            p.grad = None if per_rank[0][i] is None else sum(g[i].float() for g in per_rank) / world
        ref_opt.step()
        _three_loss(model, _three_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_group_of_two_dtypes_becomes_two_flat_groups(stage):
    assert len(set(run_on_ranks(2, _mixed_dtypes, stage))) == 1


# ----------------------------------------------------------------------------------------------------------- memory
def _engine_objects():
    """How many engine objects of each kind are alive in this process (after a collection)."""
    import collections
    import gc

    from zero_ext.engine.bucket_runtime import StagingPool
    from zero_ext.engine.engine import Engine
    from zero_ext.engine.reducer import GradSync
    from zero_ext.engine.runtime import BucketRuntimes
    from zero_ext.state.sharded_state import ShardedState

    gc.collect()
    kinds = (Engine, ShardedState, BucketRuntimes, StagingPool, GradSync)
    return collections.Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds))


def _memory_after_adding(rank, world, stage):
    """After adding, the report counts the new group byte for byte (the storages alive in the flat groups and the
    staging pool, the identity with the formula), and the engine grew in place: the same sharded state and staging
    pool, and no second engine, state, pool or runtime kept alive beside them."""
    model, opt = frozen_start(torch.bfloat16, stage, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    train(model, opt, kref, 0, rank, world)
    before = (opt.sharded_state, opt.bucket_runtimes.staging)
    alive = _engine_objects()
    unfreeze(model, opt)
    kref.add_group(block0(model), HYPER["lr"] / 10)
    train(model, opt, kref, 1, rank, world)
    assert opt.sharded_state is before[0] and opt.bucket_runtimes.staging is before[1]
    assert _engine_objects() == alive
    state, report = opt.sharded_state, opt.memory_report()
    alive = [t for g in state.groups for t in g.tensors().values()] + opt.bucket_runtimes.staging.tensors()
    assert report.total == sum(t.untyped_storage().nbytes() for t in alive)
    assert report.total == (
        report.formula + report.padding + report.staging + report.grad_shard_fp32 - report.param_shard_not_kept
    )
    assert report.num_params == sum(p.numel() for p in model.parameters())
    return report.owned_numel


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_counts_the_added_group(stage):
    owned = run_on_ranks(3, _memory_after_adding, stage)
    assert sum(owned) == sum(p.numel() for p in build().parameters())
