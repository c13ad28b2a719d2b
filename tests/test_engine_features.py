"""ZeroAdamW features against the unsharded reference: accumulation, clipping, non-finite skip, param groups
and lr schedules, unused and frozen params, deferred all-gather, local state dict. Each on 1 rank (no
communication, no staging: gradients go straight into the grad shard), 2 and 3 ranks (uneven padding)."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, mean_grads, params_digest, rank_grads, reference
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WORLDS = [1, 2, 3]


def _step_reference(model, ref_params, ref_opt, batches, **kw):
    per_rank = rank_grads(model, list(model.parameters()), batches, loss_fn, **kw)
    for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
        if p.requires_grad:
            p.grad = g
    ref_opt.step()


def _accumulation(rank, world, stage, use_no_sync):
    """Two micro-batches per step == one step on the summed gradients."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    for step in range(4):
        micro = [[batch(step, 10 * r + k) for k in range(2)] for r in range(world)]
        params = list(model.parameters())
        per_rank = [
            [sum(gs) for gs in zip(*rank_grads(model, params, micro[r], loss_fn))] for r in range(world)
        ]  # each rank's sum over its micro-batches
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            p.grad = g
        ref_opt.step()
        if use_no_sync:
            with opt.no_sync():
                loss_fn(model, micro[rank][0]).backward()
        else:
            loss_fn(model, micro[rank][0]).backward()
        loss_fn(model, micro[rank][1]).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("use_no_sync", [True, False])
def test_gradient_accumulation(world, stage, use_no_sync):
    assert len(set(run_on_ranks(world, _accumulation, stage, use_no_sync))) == 1


def _no_sync_then_step(rank, world, stage):
    """Backward only under no_sync(), then step(): the accumulated gradients are still reduced."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    _step_reference(model, ref_params, ref_opt, [batch(0, r) for r in range(world)])
    with opt.no_sync():
        loss_fn(model, batch(0, rank)).backward()
    opt.step()
    check_against_reference(opt, model, ref_params, rank)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_step_after_no_sync_only(world, stage):
    run_on_ranks(world, _no_sync_then_step, stage)


def _clipping(rank, world, stage, max_norm):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, max_grad_norm=max_norm)
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    norms = []
    for step in range(5):
        per_rank = rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn)
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            p.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        ref_opt.step()
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(opt.grad_norm, ref_norm)
        assert ref_norm > max_norm, "the test wants clipping to be active"
        check_against_reference(opt, model, ref_params, rank)
        norms.append(opt.grad_norm.item())
    return norms


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_matches_clip_grad_norm(world, stage):
    norms = run_on_ranks(world, _clipping, stage, 0.05)
    assert all(n == norms[0] for n in norms)


def _snapshot(model, opt):
    """Params, every optimizer state buffer (the grad shard aside: zero_grad() zeroes it) and the step."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for fg in opt._flat_groups:
        tensors += [t.clone() for kind, t in fg.persistent_tensors().items() if kind != "grad_shard"]
    return tensors + [opt._step_count.clone()]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _nonfinite_skip(rank, world, stage, bad_value):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    for step in range(4):
        if step == 2:
            # Only the last rank sees a non-finite loss: every rank must skip, state bitwise unchanged.
            before = _snapshot(model, opt)
            scale = bad_value if rank == world - 1 else 1.0
            (loss_fn(model, batch(step, rank)) * scale).backward()
            opt.step()
            opt.zero_grad()
            for a, b in zip(before, _snapshot(model, opt)):
                assert torch.equal(_bits(a), _bits(b)), "state changed on a skipped step"
            assert opt.skipped_steps == 1
            assert not torch.isfinite(opt.grad_norm)
            continue
        _step_reference(model, ref_params, ref_opt, [batch(step, r) for r in range(world)])
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    assert opt.step_count == 3
    return opt.skipped_steps


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_gradient_skips_step_everywhere(world, stage, bad_value):
    assert run_on_ranks(world, _nonfinite_skip, stage, bad_value) == [1] * world


def _groups_for(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * 3, "betas": (0.8, 0.99), "eps": 1e-6},
    ]


def _param_groups_and_schedule(rank, world, stage, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    opt = ZeroAdamW(_groups_for(model, 2e-3), lr=2e-3, stage=stage, bucket_size=BUCKET)
    ref_model = build(dtype)
    ref_params = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()]
    by_id = {id(p): r for p, r in zip(ref_model.parameters(), ref_params)}
    ref_groups = _groups_for(ref_model, 2e-3)
    for g in ref_groups:
        g["params"] = [by_id[id(p)] for p in g["params"]]
    ref_opt = torch.optim.AdamW(ref_groups, lr=2e-3)
    # A schedule: lr changes every step and must take effect.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    order = [id(p) for p in model.parameters()]
    for step in range(5):
        params = list(model.parameters())
        per_rank = rank_grads(model, params, [batch(step, r) for r in range(world)], loss_fn)
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            p.grad = g
        ref_opt.step()
        ref_sched.step()
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert [id(p) for p in model.parameters()] == order
        check_against_reference(opt, model, ref_params, rank, [p for g in ref_groups for p in g["params"]])
    assert len(opt._flat_groups) == 2
    return opt.param_groups[1]["lr"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_param_groups_and_lr_schedule(world, stage, dtype):
    lrs = run_on_ranks(world, _param_groups_and_schedule, stage, dtype)
    assert lrs[0] == pytest.approx(6e-3 / 6)


def _unused_and_frozen(rank, world, stage):
    model = build(torch.float32, unused_branch=True)
    ref_model = build(torch.float32, unused_branch=True)
    model.pos.requires_grad_(False)  # frozen: never touched
    ref_model.pos.requires_grad_(False)
    frozen_before = model.pos.detach().clone()
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(ref_model, **HYPER)
    for step in range(5):
        # The extra branch is used on rank 0 at odd steps only, and by nobody at even steps.
        uses = [step % 2 == 1 and r == 0 for r in range(world)]
        per_rank = [
            rank_grads(model, list(model.parameters()), [batch(step, r)], loss_fn, use_extra=uses[r])[0]
            for r in range(world)
        ]
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            if p.requires_grad:
                p.grad = g
        ref_opt.step()
        loss_fn(model, batch(step, rank), use_extra=uses[rank]).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    assert torch.equal(model.pos, frozen_before)
    assert all(model.pos is not p for fg in opt._flat_groups for p in fg.params)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_unused_params_count_as_zero_and_frozen_params_are_left_alone(world, stage):
    assert len(set(run_on_ranks(world, _unused_and_frozen, stage))) == 1


def _deferred_all_gather(rank, world, stage):
    runs = []
    for defer in (False, True):
        model = build(torch.bfloat16)
        opt = ZeroAdamW(
            model.named_parameters(),
            **HYPER,
            stage=stage,
            bucket_size=BUCKET,
            defer_all_gather_to=model if defer else None,
        )
        losses = []
        for step in range(4):
            loss = loss_fn(model, batch(step, rank))
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_params()
        runs.append((losses, params_digest(model)))
    assert runs[0] == runs[1], "deferring the all-gather wait changed the result"
    return runs[1][1]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_deferred_all_gather_waits_in_forward(world, stage):
    assert len(set(run_on_ranks(world, _deferred_all_gather, stage))) == 1


def _local_state_dict_round_trip(rank, world, stage):
    def train(model, opt, steps):
        for step in steps:
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()

    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    train(model, opt, range(3))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    train(model, opt, range(3, 6))

    fresh = build(torch.bfloat16, seed=123)
    fresh_opt = ZeroAdamW(fresh.named_parameters(), lr=1.0, stage=stage, bucket_size=BUCKET)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    assert fresh_opt.param_groups[0]["lr"] == HYPER["lr"]
    train(fresh, fresh_opt, range(3, 6))
    assert params_digest(fresh) == params_digest(model)
    for a, b in zip(opt._flat_groups, fresh_opt._flat_groups):
        assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_local_state_dict_round_trip(world, stage):
    run_on_ranks(world, _local_state_dict_round_trip, stage)


def _zero_grad_semantics(rank, world, zero_with):
    """Stage 1 after a zero_grad that sets .grad to None (the optimizer's default, or the model's own): the next
    gradient lands in the param's slot, and a param that then gets no gradient counts as zero even though its
    slot still holds an old gradient (the extra branch is used at step 0 only)."""
    model = build(torch.float32, unused_branch=True)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=1, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32, unused_branch=True), **HYPER)
    buffers = opt._reducer.grad_buffers
    for step in range(4):
        uses = [step == 0] * world
        _step_reference(model, ref_params, ref_opt, [batch(step, r) for r in range(world)], use_extra=uses[rank])
        loss_fn(model, batch(step, rank), use_extra=uses[rank]).backward()
        for p in model.parameters():
            if p.grad is not None:  # a gradient is always a view of the flat buffer
                assert any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
        opt.step()
        if zero_with == "model":
            model.zero_grad(set_to_none=True)
        elif zero_with == "optimizer":
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        else:  # zeros in place
            opt.zero_grad(set_to_none=False)
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("zero_with", ["optimizer", "model", "optimizer_zeros"])
def test_stage1_zero_grad_semantics_and_stale_slots(world, zero_with):
    assert len(set(run_on_ranks(world, _zero_grad_semantics, zero_with))) == 1


def _stage2_backward_without_zero_grad_warns(rank, world):
    import warnings

    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=BUCKET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(model, batch(1, rank)).backward()
        opt.step()
        assert not caught, [str(w.message) for w in caught]
        model.zero_grad()  # cannot clear stage 2's sharded gradients
        for _ in range(2):
            loss_fn(model, batch(2, rank)).backward()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "without opt.zero_grad()" in messages[0], messages
    return True


def test_stage2_backward_after_step_without_zero_grad_warns():
    assert run_on_ranks(2, _stage2_backward_without_zero_grad_warns) == [True, True]


def _comm_volume(rank, world, stage):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    padded = sum(fg.layout.numel for fg in opt._flat_groups)
    for step in range(2):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    c = opt.comm_stats()
    if world == 1:  # nothing to communicate: gradients go straight to the shard, the all-gather is in place
        assert c["reduce_scatter_elements"] == c["all_gather_elements"] == 0, c
    else:  # ZeRO-1/2's promise: Psi (padded) reduce-scattered + Psi all-gathered per step
        assert c["reduce_scatter_elements"] == c["all_gather_elements"] == 2 * padded, c
        # bf16 gradients travel as bf16 on gloo (summed in fp32 after the transfer); params are gathered in bf16
        assert c["reduce_scatter_bytes"] == c["all_gather_bytes"] == 2 * padded * 2, c
    assert c["all_reduce_elements"] == 2 * 2, c  # the norm and non-finite flag, once per step
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_communication_volume_per_step(world, stage):
    assert all(run_on_ranks(world, _comm_volume, stage))
