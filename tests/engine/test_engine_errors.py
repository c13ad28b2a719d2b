"""Bad input to ZeroAdamW: a clear error at construction (or at the first backward, for sparse gradients),
on every rank together, never a hang or a silent wrong result."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW


def _expect(exc_type, match, fn):
    with pytest.raises(exc_type, match=match):
        fn()
    return True


def _stage_and_hyperparameters(rank, world):
    model = build()
    p = list(model.parameters())
    for kw, match in [
        (dict(stage=4), "`stage` must be 1, 2 or 3"),
        (dict(stage=0), "`stage` must be 1, 2 or 3"),
        (dict(stage=3), "stage 3 needs the model"),
        (dict(lr=-1.0), "`lr` must be"),
        (dict(eps=-1e-8), "`eps` must be"),
        (dict(betas=(1.0, 0.999)), r"`betas\[0\]` must be in \[0, 1\)"),
        (dict(betas=(0.9, -0.1)), r"`betas\[1\]`"),
        (dict(weight_decay=-0.1), "`weight_decay` must be"),
        (dict(max_grad_norm=0.0), "`max_grad_norm`"),
        (dict(bucket_size=0), "`bucket_size`"),
        (dict(reduce_dtype=torch.int32), "`reduce_dtype`"),
    ]:
        _expect(ValueError, match, lambda: ZeroAdamW(p, **kw))
    groups = [{"params": p[:3], "lr": -5.0}, {"params": p[3:]}]
    _expect(ValueError, "param group 0: `lr`", lambda: ZeroAdamW(groups))
    return True


@pytest.mark.slow
def test_bad_stage_and_hyperparameters():
    run_on_ranks(2, _stage_and_hyperparameters)


def _param_listed_twice(rank, world):
    """torch warns (and tests/torch_compat/test_duplicate_params.py trains it once); the same parameter in two groups
    raises, as in torch."""
    model = build()
    p = list(model.parameters())
    return _expect(ValueError, "more than one parameter group", lambda: ZeroAdamW([{"params": p}, {"params": [p[2]]}]))


def _different_devices(rank, world):
    a = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(4, device="meta"))
    return _expect(ValueError, "different devices", lambda: ZeroAdamW([a, b]))


def _integer_param(rank, world):
    a = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    return _expect(ValueError, "dtype torch.float64", lambda: ZeroAdamW([("a", a), ("b", b)]))


def _only_one_rank_bad(rank, world):
    """Rank 1 gives a float64 parameter, rank 0 doesn't: both must fail (rank 0 learns of it), neither hangs."""
    p = list(build().parameters())
    params = p + [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))] if rank == 1 else p
    match = "dtype torch.float64" if rank == 1 else r"construction failed on rank\(s\) \[1\]"
    return _expect(ValueError, match, lambda: ZeroAdamW(params))


def _model_differs_between_ranks(rank, world):
    model = build() if rank == 0 else torch.nn.Linear(5, 7)
    return _expect(RuntimeError, "differ between ranks", lambda: ZeroAdamW(model.parameters()))


def _settings_differ_between_ranks(rank, world):
    model = build()
    return _expect(RuntimeError, "differ between ranks", lambda: ZeroAdamW(model.parameters(), stage=1 + rank % 2))


def _group_without_this_rank(rank, world):
    group = dist.new_group([0])  # every rank must call new_group; rank 1 is not a member
    if rank == 0:
        ZeroAdamW(build().parameters(), process_group=group)
        return True
    return _expect(
        ValueError, "does not include this process", lambda: ZeroAdamW(build().parameters(), process_group=group)
    )


def _sparse_gradient(rank, world):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    _opt = ZeroAdamW(emb.named_parameters())  # its hooks turn the sparse gradient into an error
    return _expect(
        RuntimeError,
        "'weight' received a torch.sparse_coo gradient",
        lambda: emb(torch.tensor([1, 2])).sum().backward(),
    )


def _add_param_group_later(rank, world):
    """(Valid groups: test_add_param_group.py.) A frozen parameter is refused on every rank, named."""
    opt = ZeroAdamW(build().parameters())
    return _expect(
        ValueError,
        r"param_groups\[1\]\.params\[0\]' has requires_grad=False",
        lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2), requires_grad=False)]}),
    )


def _bad_lr_at_step_changes_nothing(rank, world):
    model = build()
    opt = ZeroAdamW(model.parameters(), bucket_size=1000)
    loss_fn(model, batch(0, rank)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = -1.0
    _expect(ValueError, "param group 0: `lr`", opt.step)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.param_groups[0]["lr"] = 1e-3
    opt.step()  # and the optimizer still works
    return not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "case",
    [
        _param_listed_twice,
        _different_devices,
        _integer_param,
        _only_one_rank_bad,
        _model_differs_between_ranks,
        _settings_differ_between_ranks,
        _group_without_this_rank,
        _sparse_gradient,
        _add_param_group_later,
        _bad_lr_at_step_changes_nothing,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_bad_input_is_a_clear_error_on_every_rank(case):
    assert run_on_ranks(2, case, timeout=90) == [True, True]


def test_single_process_without_torch_distributed():
    assert not dist.is_initialized()
    model = build()
    opt = ZeroAdamW(model.named_parameters(), stage=2, bucket_size=1000)
    loss_fn(model, batch(0, 0)).backward()
    opt.step()
    assert opt.step_count == 1


def _failed_construction_leaves_model_untouched(rank, world):
    model = build()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    _expect(RuntimeError, "differ between ranks", lambda: ZeroAdamW(model.parameters(), stage=1 + rank % 2))
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    assert all(p.grad is None for p in model.parameters())
    return True


def test_failed_construction_leaves_model_untouched():
    assert run_on_ranks(2, _failed_construction_leaves_model_untouched) == [True, True]


def _one_bad_rank_of_three(rank, world):
    p = list(build().parameters())
    params = p + [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))] if rank == 1 else p
    match = "dtype torch.float64" if rank == 1 else r"construction failed on rank\(s\) \[1\]"
    return _expect(ValueError, match, lambda: ZeroAdamW(params))


def test_construction_failing_on_one_rank_of_three_fails_everywhere():
    assert run_on_ranks(3, _one_bad_rank_of_three, timeout=60) == [True] * 3
