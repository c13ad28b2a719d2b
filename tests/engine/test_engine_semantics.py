"""torch's semantics exactly, and every rank failing together: parameters without a gradient, steps without a
backward, and checks that fail on one rank only. Each on 1, 2 and 3 gloo ranks, against torch.optim.AdamW."""

import time

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, params_digest, rank_grads, reference, set_mean_grads
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WORLDS = [1, 2, 3]


def _own_state(opt, name):
    """This rank's pieces of parameter ``name``: (exp_avg, exp_avg_sq) copies, and the parameter's step count."""
    state = opt.sharded_state
    pieces = [r for r in state.pieces() if r.name == name]
    moments = [(r.group.state.read("exp_avg", r.piece.shard_range).clone(),
                r.group.state.read("exp_avg_sq", r.piece.shard_range).clone()) for r in pieces]  # fmt: skip
    gidx = next(i for i, n in state.names.items() if n == name)
    return moments, state.step_counts.values([gidx])[gidx]


def _resting_parameter(rank, world, stage, accumulate):
    """The `extra` branch gets a gradient on no rank at steps 1-3 (on rank 0 only at step 0 and 4): at the resting
    steps it stays bitwise where it was, with its moments and own step count, as torch leaves it; at step 4 its
    update uses its own bias correction (step 2 for it, step 5 for the rest)."""
    model = build(torch.float32, unused_branch=True)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32, unused_branch=True), **HYPER)
    names = [n for n, _ in model.named_parameters()]
    for step in range(5):
        uses = [step in (0, 4) and r == 0 for r in range(world)]
        micro = 2 if accumulate else 1
        per_rank = [
            [sum(gs) if all(g is not None for g in gs) else None for gs in zip(*(
                rank_grads(model, list(model.parameters()), [batch(step, 10 * r + k)], loss_fn, use_extra=uses[r])[0]
                for k in range(micro)))]
            for r in range(world)
        ]  # fmt: skip
        set_mean_grads(ref_params, per_rank)
        ref_opt.step()
        before = (model.extra.weight.detach().clone(), _own_state(opt, "extra.weight"))
        if accumulate:
            with opt.no_sync():
                loss_fn(model, batch(step, 10 * rank), use_extra=uses[rank]).backward()
            loss_fn(model, batch(step, 10 * rank + 1), use_extra=uses[rank]).backward()
        else:
            loss_fn(model, batch(step, 10 * rank), use_extra=uses[rank]).backward()
        opt.step()
        opt.zero_grad()
        check_against_reference(opt, model, ref_params, rank)
        if not any(uses):
            moments, own_step = _own_state(opt, "extra.weight")
            assert torch.equal(model.extra.weight, before[0]), f"step {step}: a parameter without gradient moved"
            for (a, b), (c, d) in zip(moments, before[1][0]):
                assert torch.equal(a, c) and torch.equal(b, d), f"step {step}: its moments moved"
            assert own_step == before[1][1], f"step {step}: its step count advanced"
        # Every parameter's own step count is torch's.
        counts = opt.sharded_state.step_counts.values()
        for i, (name, p) in enumerate(zip(names, ref_params)):
            expected = float(ref_opt.state[p]["step"]) if p in ref_opt.state else 0.0
            assert counts[i] == expected, f"step {step}: {name} has step {counts[i]}, torch {expected}"
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "no_sync"])
def test_parameter_without_gradient_is_left_alone(world, stage, accumulate):
    assert len(set(run_on_ranks(world, _resting_parameter, stage, accumulate))) == 1


def _everything(model, opt):
    state = opt.sharded_state
    out = [p.detach().clone() for p in model.parameters()]
    for group in state.groups:
        out += [t.clone() for kind, t in group.tensors().items() if kind not in ("grads", "grad_shard")]
    return out + [state.step_count.clone(), state.skipped.clone(), state.step_counts.steps.clone()]


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(a, b))


def _step_without_backward(rank, world, stage):
    """torch does nothing in a step with no gradient anywhere; neither may ZeroAdamW (plain, with a closure that
    computes a loss without backward, and right after construction)."""
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    before = _everything(model, opt)
    opt.step()
    assert _bitwise_equal(before, _everything(model, opt)), "step() before any backward changed something"
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    before = _everything(model, opt)
    opt.step()
    assert opt.step() is None
    loss = opt.step(closure=lambda: loss_fn(model, batch(1, rank)))
    assert loss is not None and _bitwise_equal(before, _everything(model, opt)), "an empty step changed something"
    assert opt.step_count == 1 and opt.skipped_steps == 0
    return params_digest(model)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_step_without_backward_is_a_no_op(world, stage):
    assert len(set(run_on_ranks(world, _step_without_backward, stage))) == 1


def _failing_step_on_one_rank(rank, world, stage):
    """The last rank sets a bad lr: every rank raises at once, nothing changes anywhere, and after the fix the
    same gradients give the step torch gives."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET)
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    per_rank = rank_grads(model, list(model.parameters()), [batch(0, r) for r in range(world)], loss_fn)
    set_mean_grads(ref_params, per_rank)
    ref_opt.step()
    loss_fn(model, batch(0, rank)).backward()
    before = _everything(model, opt)
    bad = rank == world - 1
    if bad:
        opt.param_groups[0]["lr"] = float("nan")
    t0 = time.monotonic()
    match = r"param group 0: `lr` must be a finite number >= 0, got nan" if bad else r"failed on 1 other rank\(s\)"
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert time.monotonic() - t0 < 10, "the failure took too long to reach every rank"
    assert _bitwise_equal(before, _everything(model, opt)), "a failed step changed the optimizer or the model"
    opt.param_groups[0]["lr"] = HYPER["lr"]
    opt.step()  # the gradients are still there: the fixed step is the one torch takes
    check_against_reference(opt, model, ref_params, rank)
    return params_digest(model)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_that_fails_on_one_rank_fails_everywhere_and_changes_nothing(world, stage):
    assert len(set(run_on_ranks(world, _failing_step_on_one_rank, stage, timeout=60))) == 1


def _wrong_state_dict_on_one_rank(rank, world):
    """Each rank loads the dict of the rank before it (rank 0 its own): the others fail their checks; every rank
    raises, nothing changes on any rank, and the group is still usable."""
    import torch.distributed as dist

    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=BUCKET)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    mine = opt.state_dict()
    dicts = [None] * world
    dist.all_gather_object(dicts, mine)
    loss_fn(model, batch(1, rank)).backward()
    opt.step()
    before = _everything(model, opt)
    t0 = time.monotonic()
    match = "saved by rank" if rank > 0 else r"failed to load on rank\(s\)"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(dicts[max(rank - 1, 0)])
    assert time.monotonic() - t0 < 10
    assert _bitwise_equal(before, _everything(model, opt))
    opt.load_state_dict(mine)  # the right dict still loads
    return params_digest(model)


@pytest.mark.parametrize("world", [2, 3])
def test_load_state_dict_failing_on_one_rank_fails_everywhere(world):
    assert len(set(run_on_ranks(world, _wrong_state_dict_on_one_rank, timeout=60))) == 1


def _bad_tensor_hyperparameters(rank, world):
    model = build()
    for kw, match in [
        (dict(lr=torch.tensor(-1.0)), "`lr` must be a finite number >= 0, got -1.0"),
        (dict(lr=torch.tensor(float("nan"))), "`lr` must be a finite number >= 0, got nan"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "`lr` must be a number or a one-element tensor"),
        (dict(lr=torch.tensor(1)), "`lr` tensor must have a floating dtype"),
        (dict(betas=(torch.tensor(1.0), 0.99)), r"`betas\[0\]` must be in \[0, 1\)"),
        (dict(weight_decay=torch.tensor(float("inf"))), "`weight_decay` must be a finite number >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            ZeroAdamW(model.parameters(), **kw)
    opt = ZeroAdamW(model.parameters(), lr=torch.tensor(1e-3))  # a valid tensor lr works
    loss_fn(model, batch(0, rank)).backward()
    opt.step()
    assert opt.step_count == 1
    return True


def test_tensor_hyperparameters_are_checked_at_construction():
    assert all(run_on_ranks(2, _bad_tensor_hyperparameters))


def _inf_on_the_first_step(rank, world, stage, clip):
    """The very first step sees an inf on one rank (with clipping: its coefficient is nan; every parameter's step
    count is still 0): skipped on every rank, nothing changes; the next step is torch's first."""
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=BUCKET, module=model)
    ref_params, ref_opt = reference(build(torch.float32), **HYPER)
    with opt.gathered_params():  # stage 3: parameters are read inside it
        before = _everything(model, opt)
    loss = loss_fn(model, batch(0, rank))
    (loss * float("inf") if rank == world - 1 else loss).backward()
    if clip:
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and opt.step_count == 0
    with opt.gathered_params():
        after = _everything(model, opt)
    del before[-2], after[-2]  # the skip counter, which counted it
    assert _bitwise_equal(before, after), "a skipped first step changed something"
    unchanged = build(torch.float32)  # the model as it was, and still is (stage 3's own cannot be read here)
    per_rank = rank_grads(unchanged, list(unchanged.parameters()), [batch(1, r) for r in range(world)], loss_fn)
    set_mean_grads(ref_params, per_rank)
    ref_opt.step()
    loss_fn(model, batch(1, rank)).backward()
    opt.step()
    with opt.gathered_params():
        check_against_reference(opt, model, ref_params, rank)
    return opt.step_count


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
def test_an_inf_on_the_first_step_skips_it(world, stage, clip):
    assert run_on_ranks(world, _inf_on_the_first_step, stage, clip) == [1] * world
