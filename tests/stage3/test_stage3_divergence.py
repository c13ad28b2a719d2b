"""Stage 3 never hangs on rank-dependent control flow (issue 25): when ranks stop running the same modules, every
rank waiting in a collective raises ``RanksDiverged`` within about ``collective_timeout`` seconds, naming each rank's
phase, module, bucket and step and what to do; a rank that is merely slow is waited for and trains bitwise as the
plain run. Each scenario runs on its own pool of gloo ranks: a diverged group has collectives left unmatched in
gloo's threads, so the pool is discarded after it (``discard_pool``)."""

import time

import pytest
import torch
from distributed import discard_pool, run_on_ranks
from engine_reference import params_digest
from tiny_transformer import SEQ, batch, build, loss_fn

from zero_ext import ZeroAdamW
from zero_ext.comm.divergence import RanksDiverged

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500  # several buckets
TIMEOUT = 1.0  # collective_timeout of these tests: a divergence raises after ~1-2 s


def _engine(timeout=TIMEOUT, **kw):
    model = build(torch.float32, unused_branch=True)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=3, module=model, bucket_size=BUCKET,
                    collective_timeout=timeout, **kw)  # fmt: skip
    return model, opt


def _train_step(model, opt, rank, step):
    loss_fn(model, batch(step, rank)).backward()
    opt.step()
    opt.zero_grad()


def _estimate_loss(model, grad: bool):
    """The reported case: a trainer's evaluation, on rank 0 only, outside gathered_params()."""
    with torch.set_grad_enabled(grad):
        return loss_fn(model, batch(90, 0)).detach()


def _generate(model, length: int):
    tokens = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        while tokens.shape[1] < length:
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


SCENARIOS = {
    # rank 0 evaluates between steps outside the context (no_grad, then with grad enabled)
    "rank0_eval_no_grad": lambda model, opt, rank, world: rank == 0 and _estimate_loss(model, False),
    "rank0_eval_grad": lambda model, opt, rank, world: rank == 0 and _estimate_loss(model, True),
    # every rank generates, each to a different length
    "generation_lengths": lambda model, opt, rank, world: _generate(model, 3 + 2 * rank),
    # a module run on one rank only inside the forward: the branch training never takes
    "module_on_one_rank": lambda model, opt, rank, world: loss_fn(
        model, batch(91, rank), use_extra=(rank == world - 1)
    ).backward(),
    # one rank enters gathered_params() alone
    "gathered_params_alone": lambda model, opt, rank, world: rank == 0 and opt.gathered_params().__enter__(),
}


def _diverge(rank, world, scenario, skip):
    model, opt = _engine()
    started = time.monotonic()
    try:
        for step in range(4):
            if step == 2:
                SCENARIOS[scenario](model, opt, rank, world)
            if skip == "backward" and step == 2 and rank == 0:
                continue  # this rank skips a whole iteration's backward and step
            if skip == "step" and step == 2 and rank == 0:
                loss_fn(model, batch(step, rank)).backward()
                opt.zero_grad()
                continue
            _train_step(model, opt, rank, step)
    except RanksDiverged as e:
        return "raised", str(e), time.monotonic() - started
    return "finished", "", time.monotonic() - started


def _nothing(model, opt, rank, world):
    return None


SCENARIOS["nothing"] = _nothing


@pytest.mark.slow  # a fresh pool of ranks per test (a diverged group cannot be reused): ~10 s each
@pytest.mark.parametrize(
    "scenario,skip",
    [
        ("rank0_eval_no_grad", None),
        ("rank0_eval_grad", None),
        ("generation_lengths", None),
        ("module_on_one_rank", None),
        ("gathered_params_alone", None),
        ("nothing", "step"),
    ],
)
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_naming_where_each_rank_is(world, scenario, skip):
    try:
        results = run_on_ranks(world, _diverge, scenario, skip, timeout=60)
    finally:
        discard_pool(world)
    raised = [r for r, (outcome, _, _) in enumerate(results) if outcome == "raised"]
    assert raised == list(range(world)), f"ranks {raised} raised; every rank must: {results}"
    for outcome, message, seconds in results:
        for r in range(world):
            assert f"rank {r}: " in message, message
        assert "collectives issued" in message and "step 2" in message, message
        assert "inside `with opt.gathered_params():`" in message and "collective_timeout" in message
        assert seconds < 10 * TIMEOUT, f"raised after {seconds:.1f} s"
    if scenario == "module_on_one_rank":  # found by the out-of-band comparison: module and bucket
        assert "of module 'blocks." in message and "(bucket (0, " in message, message
    if skip == "step":  # one rank waits in step()'s collective, the other in the next forward's phase check
        assert "all_reduce of 34 elements (no bucket), step, step 2" in message, message
        assert "phase_check of 3 elements (no bucket), forward, step 2" in message, message


@pytest.mark.slow  # a fresh pool of ranks per test (a diverged group cannot be reused): ~10 s each
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_still_training_after_one_rank_stopped_raise(world):
    """Rank 0 skips an iteration (its backward and step), so the others run one more at the end: they wait in a
    collective rank 0 never issues, and raise within two timeouts naming it as issuing none; rank 0 itself finishes
    (it is not waiting)."""
    try:
        results = run_on_ranks(world, _diverge, "nothing", "backward", timeout=60)
    finally:
        discard_pool(world)
    assert results[0][0] == "finished"
    for outcome, message, seconds in results[1:]:
        assert outcome == "raised"
        assert "rank(s) [0] issued no zero_ext collective" in message and "rank 0: not waiting" in message, message
        assert seconds < 10 * TIMEOUT


SLOW = 3.0  # seconds a slow rank sleeps: past SLOW_TIMEOUT, within the 2 * SLOW_TIMEOUT a rank may be absent
SLOW_TIMEOUT = 2.0


def _slow_rank(rank, world, timeout, slow=SLOW):
    """Rank ``world - 1`` sleeps ``slow`` seconds (longer than the timeout) before some forwards, a backward and a
    step."""
    model, opt = _engine(timeout)
    for step in range(4):
        if rank == world - 1 and step in (1, 3):
            time.sleep(slow)  # before the forward: the others wait in its first gather past the timeout
        loss = loss_fn(model, batch(step, rank))
        if rank == world - 1 and step == 2:
            time.sleep(slow)  # before the backward
        loss.backward()
        if rank == world - 1 and step == 2:
            time.sleep(slow)  # before the step
        opt.step()
        opt.zero_grad()
        if step == 3:
            with opt.gathered_params():  # entered late by the slow rank
                if rank == 0:
                    time.sleep(slow)  # a long evaluation on rank 0: the others wait at the next forward
                    model(batch(9, 0)[:, :SEQ])
    _train_step(model, opt, rank, 4)
    stats = opt.comm_stats()
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest, stats


@pytest.mark.slow  # the slow rank sleeps 3 s five times in the checked run: ~25 s each
@pytest.mark.parametrize("world", [2, 3])
def test_a_slow_rank_is_waited_for_and_trains_as_the_plain_run(world):
    """Slow is not wrong: a rank sleeping past the timeout (less than twice it) before a forward, a backward, a step
    and inside gathered_params() makes the others compare positions and wait on; the run is bitwise the one without
    checks (collective_timeout=None), and so are its collectives. The plain run does not sleep: with no timeout no
    rank compares positions, and a sleep changes no number it computes."""
    checked = run_on_ranks(world, _slow_rank, SLOW_TIMEOUT, timeout=120)
    plain = run_on_ranks(world, _slow_rank, None, 0.0, timeout=120)
    assert checked == plain
    assert len({digest for digest, _ in checked}) == 1


def _bad_timeout(rank, world, value):
    model = build(torch.float32)
    with pytest.raises(ValueError, match=r"`collective_timeout` must be a number of seconds > 0 .* or None"):
        ZeroAdamW(model.named_parameters(), stage=3, module=model, collective_timeout=value)
    return "raised"


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_collective_timeout_is_checked_on_every_rank(value):
    assert run_on_ranks(2, _bad_timeout, value, timeout=60) == ["raised", "raised"]
