"""Stage 3: evaluation and generation on rank 0 only, inside ``opt.gathered_params()`` (which every rank enters).

A forward inside the context is local to its rank: it issues no collective and leaves the gather schedule (the
module order learned from training forwards, which drives prefetching) alone, so the next training step's gathers
still pair up across ranks (when rank 0's evaluation before the first step, or through a branch training never
takes, fed that order, gloo aborted the next step: "op.preamble.length <= op.nbytes"). Checked against the same
training without the evaluation (entering the context as often): parameters bitwise equal and every collective the
same (``comm_stats()``, per rank), at every ``reshard_after_forward`` and ``prefetch``; the evaluation's outputs are
those of a plain copy of the gathered model. A backward through a forward run inside the context is refused on the
rank that tries it (its gradients could not be reduced with the other ranks'), and changes nothing."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks
from engine_reference import params_digest
from pairwise import pairwise_params
from tiny_transformer import SEQ, batch, build, loss_fn

from zero_ext import ZeroAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500  # several buckets, so that prefetching has an order to follow


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def _evaluate(model) -> list[torch.Tensor]:
    """What a trainer's rank 0 does: losses at several lengths under no_grad, a forward with grad enabled (an eval
    loop without no_grad: no backward follows), one through a branch training never takes, then sampling token by
    token; returns everything it computed."""
    out = []
    model.eval()
    with torch.no_grad():
        for length in (SEQ, 3, 1, SEQ - 2):
            out.append(loss_fn(model, batch(50 + length, 0)[:, : length + 1]).detach())
    out.append(model(batch(60, 0)[:, :5]).detach())  # grad enabled
    with torch.no_grad():
        out.append(model(batch(61, 0), use_extra=True))  # a module training never runs
    g = torch.Generator().manual_seed(7)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        while tokens.shape[1] < SEQ:
            probs = F.softmax(model(tokens)[:, -1].float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    out.append(tokens)
    model.train()
    return out


def _run(rank, world, reshard, prefetch, evaluate):
    model = build(torch.float32, unused_branch=True)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=3, module=model, bucket_size=BUCKET,
                    reshard_after_forward=reshard, prefetch=prefetch)  # fmt: skip
    for steps in (range(0, 2), range(2, 4), range(4, 6)):
        # Before the first step (as trainers evaluate at iteration 0: no order learned yet on any rank), then
        # between steps; twice in a row before the last ones.
        for _ in range(1 if steps.start < 4 else 2):
            with opt.gathered_params():  # every rank enters, in both runs
                if rank == 0 and evaluate:  # only rank 0 runs forwards inside
                    evaluated = _evaluate(model)
                    plain = build(torch.float32, unused_branch=True)
                    plain.load_state_dict(model.state_dict())
                    for a, b in zip(evaluated, _evaluate(plain)):
                        assert torch.equal(a, b), "a forward inside gathered_params() used other values"
        _train(model, opt, rank, steps)
    stats = opt.comm_stats()
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest, stats


def _with_and_without(rank, world, reshard, prefetch):
    return _run(rank, world, reshard, prefetch, True), _run(rank, world, reshard, prefetch, False)


# World size, reshard and prefetch act independently: every pair of their values, 6 runs of the 12 combinations
# (tests/helpers/pairwise.py).
AXES = {"world": [2, 3], "reshard": [True, False], "prefetch": [0, 1, 2]}


@pytest.mark.parametrize("world,reshard,prefetch", pairwise_params(AXES))
def test_rank0_evaluation_inside_gathered_params_changes_nothing(world, reshard, prefetch):
    results = run_on_ranks(world, _with_and_without, reshard, prefetch, timeout=90)
    for rank, (evaluated, plain) in enumerate(results):
        assert evaluated[0] == plain[0], f"rank {rank}: parameters differ from the run without the evaluation"
        assert evaluated[1] == plain[1], f"rank {rank}: collectives differ from the run without the evaluation"
    assert len({digest for (digest, _), _ in results}) == 1


def _backward_inside_is_refused(rank, world, reshard):
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=3, module=model, bucket_size=BUCKET,
                    reshard_after_forward=reshard)  # fmt: skip
    _train(model, opt, rank, range(2))
    with opt.gathered_params():
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"backward through a forward that ran inside `opt\.gathered_params"):
                loss_fn(model, batch(40, 0)).backward()
            kept = loss_fn(model, batch(41, 0))  # its backward is tried after the context
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"inside `opt\.gathered_params\(\)`"):
            kept.backward()
        assert all(p.grad is None for p in model.parameters())
    _train(model, opt, rank, range(2, 4))
    stats = opt.comm_stats()
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest, stats


def _undisturbed(rank, world, reshard):
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=3, module=model, bucket_size=BUCKET,
                    reshard_after_forward=reshard)  # fmt: skip
    _train(model, opt, rank, range(2))
    with opt.gathered_params():  # entered as often as the refused run does
        pass
    _train(model, opt, rank, range(2, 4))
    stats = opt.comm_stats()
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest, stats


@pytest.mark.parametrize("reshard", [True, False])
def test_backward_through_a_forward_inside_gathered_params_is_refused(reshard):
    """An enable_grad forward inside the context may run (an eval loop without no_grad); a backward through it,
    inside the context or after, raises on the rank that runs it, and training goes on as if it never happened."""
    refused = run_on_ranks(2, _backward_inside_is_refused, reshard, timeout=90)
    assert refused == run_on_ranks(2, _undisturbed, reshard, timeout=90)
