"""ZeroAdamW features against the unsharded reference: accumulation, clipping, non-finite skip, param groups
and lr schedules, unused and frozen params, deferred all-gather, local state dict. Each on 1 rank (no
communication, no staging: gradients go straight into the grad shard), 2 and 3 ranks (uneven padding)."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, mean_grads, params_digest, rank_grads, reference, set_mean_grads
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.engine.grad_placeholders import GradPlaceholder
from zero_ext.layout import Range

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WORLDS = [1, 2, 3]


def _step_reference(model, ref_params, ref_opt, batches, **kw):
    per_rank = rank_grads(model, list(model.parameters()), batches, loss_fn, **kw)
    set_mean_grads(ref_params, per_rank)
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
        set_mean_grads(ref_params, per_rank)
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
        set_mean_grads(ref_params, per_rank)
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
    state = opt.sharded_state
    tensors = [p.detach().clone() for p in model.parameters()]
    for group in state.groups:
        tensors += [t.clone() for kind, t in group.tensors().items() if kind not in ("grad_shard", "grads")]
    return tensors + [state.step_count.clone()]


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
        set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        ref_sched.step()
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert [id(p) for p in model.parameters()] == order
        check_against_reference(opt, model, ref_params, rank, [p for g in ref_groups for p in g["params"]])
    assert len(opt.sharded_state.groups) == 2
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
        set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        loss_fn(model, batch(step, rank), use_extra=uses[rank]).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    assert torch.equal(model.pos, frozen_before)
    assert all(model.pos is not p for _, _, p in opt.sharded_state.members())
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_unused_params_are_left_alone_like_torch_and_frozen_params_untouched(world, stage):
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
    for a, b in zip(opt.sharded_state.groups, fresh_opt.sharded_state.groups):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            everything = Range(0, a.layout.shard_numel)
            assert torch.equal(a.state.read(kind, everything), b.state.read(kind, everything)), kind
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_local_state_dict_round_trip(world, stage):
    run_on_ranks(world, _local_state_dict_round_trip, stage)


def _zero_grad_semantics(rank, world, zero_with):
    """Stage 1 after a zero_grad that sets .grad to None (the optimizer's default, or the model's own): the next
    gradient lands in the param's slot, and a param that then gets no gradient is left alone like torch leaves it,
    although its slot still holds an old gradient (the extra branch is used at step 0 only). After a zero_grad that
    zeroes in place, every .grad is a zero gradient, which torch applies (weight decay moves the param)."""
    model = build(torch.float32, unused_branch=True)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=1, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32, unused_branch=True), **HYPER)
    buffers = [g.grad_buffer for g in opt.sharded_state.groups]
    for step in range(4):
        uses = [step == 0] * world
        per_rank = rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn,
                              use_extra=uses[rank])  # fmt: skip
        for p, g in zip(ref_params, mean_grads(per_rank, ref_params)):
            # Zeroed in place, a .grad is a zero gradient, not None: torch then updates (decays) the parameter.
            p.grad = torch.zeros_like(p) if g is None and zero_with == "optimizer_zeros" and step > 0 else g
        ref_opt.step()
        loss_fn(model, batch(step, rank), use_extra=uses[rank]).backward()
        # after a synchronised backward .grad is the sharded mean gradient's placeholder (grad_placeholders.py)
        assert all(isinstance(p.grad, GradPlaceholder) for p in model.parameters())
        opt.step()
        for p in model.parameters():
            if p.grad is not None:  # a gradient is always a view of the flat buffer
                assert any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
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


def _step_consumes_sharded_grads(rank, world, zero_with):
    """Stage 2: the gradients live only in the shard, so step() consumes them. Whatever the loop calls to zero
    them (the model's zero_grad, which cannot reach the shard; the optimizer's; both; nothing), each step uses
    only the backward passes since the previous step, silently (no warning)."""
    import warnings

    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(4):
            _step_reference(model, ref_params, ref_opt, [batch(step, r) for r in range(world)])
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            if zero_with in ("model", "both"):
                model.zero_grad()
            if zero_with in ("optimizer", "both"):
                opt.zero_grad()
            check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("zero_with", ["model", "optimizer", "both", "nothing"])
def test_stage2_step_consumes_gradients(world, zero_with):
    assert len(set(run_on_ranks(world, _step_consumes_sharded_grads, zero_with))) == 1


def _comm_volume(rank, world, stage):
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    padded = sum(g.layout.numel for g in opt.sharded_state.groups)
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
    # Once per step, one all-reduce: the norm and non-finite flag, an error flag, a parameters-changed flag and a
    # got-a-gradient flag per trainable parameter (one rank has nothing to reduce).
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert c["all_reduce_elements"] == (0 if world == 1 else 2 * (2 + 2 + trainable)), c
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_communication_volume_per_step(world, stage):
    assert all(run_on_ranks(world, _comm_volume, stage))


def _accumulate_in_fp32(rank, world, stage, grad_accum_dtype_name):
    """bf16 params, three micro-batches per step: stage 1 with grad_accum_dtype=float32 and stage 2 both add the
    bf16 gradients in fp32, so both match an fp32-accumulated reference (one bf16 ulp on params). Stage 1 adds a
    rank's micro-batches and reduces once; stage 2 reduces every micro-batch and adds the means, so its reference
    does the same: at 3 ranks the division by 3 rounds, and the two orders differ by an fp32 ulp of the gradient,
    which AdamW turns into a visible difference wherever a gradient is near zero."""
    grad_accum_dtype = getattr(torch, grad_accum_dtype_name) if grad_accum_dtype_name else None
    model = build(torch.bfloat16)
    opt = ZeroAdamW(
        model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, grad_accum_dtype=grad_accum_dtype
    )
    ref_params, ref_opt = reference(build(torch.bfloat16), **HYPER)
    for step in range(4):
        micro = [[batch(step, 10 * r + k) for k in range(3)] for r in range(world)]
        params = list(model.parameters())
        grads = [rank_grads(model, params, micro[r], loss_fn) for r in range(world)]  # [rank][micro][param]
        if stage == 1:
            per_rank = [[sum(g.float() for g in gs) for gs in zip(*grads[r])] for r in range(world)]
            mean = mean_grads(per_rank, ref_params)
        else:
            per_micro = [mean_grads([grads[r][k] for r in range(world)], ref_params) for k in range(3)]
            mean = [sum(ms) for ms in zip(*per_micro)]
        for p, g in zip(ref_params, mean):
            p.grad = g
        ref_opt.step()
        with opt.no_sync():
            for k in range(2):
                loss_fn(model, micro[rank][k]).backward()
        loss_fn(model, micro[rank][2]).backward()
        if grad_accum_dtype is not None:  # (after backward each .grad is a storage-less placeholder)
            assert all(isinstance(p.grad, GradPlaceholder) for p in model.parameters()), "fp32 accumulation frees .grad"
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage,accum", [(1, "float32"), (2, None), (2, "float32")])
def test_bf16_micro_batches_accumulate_in_fp32(world, stage, accum):
    assert len(set(run_on_ranks(world, _accumulate_in_fp32, stage, accum))) == 1
