"""``opt.state[p]`` reads this rank's piece of each state kind as fp32 tensors (torch.optim.AdamW's names, ``step``
a tensor), with the element range of the flattened parameter it covers; writing raises; a parameter this rank holds
nothing of reads as empty and is not ``in`` the state. Stages 1-3 on 2 gloo ranks, every moment encoding and
offload; torch.optim internals that touch ``self.state`` keep working."""

import pickle

import pytest
import torch
import torch.distributed as dist
from compat_training import build, make, reference, train
from distributed import run_on_ranks

STAGES = [1, 2, 3]
KINDS = ("exp_avg", "exp_avg_sq")


def _ranges(entry):
    return [tuple(entry["shard_range"])] if "shard_range" in entry else [tuple(r) for r in entry["shard_ranges"]]


def _pieces_match_torch(rank, world, stage, options):
    model = build()
    opt = make(model, stage, **options)
    params = list(model.parameters())
    assert len(opt.state) == 0 and list(opt.state) == [], "before the first step torch's state is empty"
    assert all(p not in opt.state and len(opt.state[p]) == 0 for p in params)
    train(model, opt, rank, 3)
    _, ref = reference(world, 3, amsgrad=options.get("amsgrad", False))
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    held = [p for p in params if p in opt.state]
    assert list(opt.state) == held and len(opt.state) == len(held) and dict(opt.state.items()).keys() == set(held)
    covered = {}
    kinds = (*KINDS, "max_exp_avg_sq") if options.get("amsgrad") else KINDS
    exact = options.get("moment_dtype", torch.float32) == torch.float32
    for i, (p, q) in enumerate(zip(params, ref_params)):
        piece = opt.state[p]
        if p not in opt.state:
            assert len(piece) == 0 and dict(piece) == {} and p not in opt.state
            continue
        step = piece["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.dim() == 0
        assert torch.equal(step, ref.state[q]["step"])
        ranges = _ranges(piece)
        covered[i] = ranges
        for kind in kinds:
            got = piece[kind]
            assert got.dtype == torch.float32 and got.dim() == 1, (kind, got.dtype)
            want = torch.cat([ref.state[q][kind].reshape(-1)[a:b] for a, b in ranges])
            if exact:
                torch.testing.assert_close(got, want)
            else:  # 16- or 8-bit moments, read back decoded (equal to the state dict's, below): near torch's
                torch.testing.assert_close(got, want, rtol=0.1, atol=0.02 * want.abs().max().item())
        assert set(piece) >= {"step", *kinds}
    # the pieces of all ranks cover every element of every parameter exactly once
    every = [None] * world
    dist.all_gather_object(every, covered)
    for i, p in enumerate(params):
        elements = sorted(e for c in every for a, b in c.get(i, []) for e in range(a, b))
        assert elements == list(range(p.numel())), (i, elements)
    # the same pieces as the state dict (same names, same values)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        if p in opt.state:
            for key, value in sd["state"][i].items():
                got = opt.state[p][key]
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


def _writes_raise(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    p = next(p for p in model.parameters() if p in opt.state)
    before = opt.state[p]["exp_avg"].clone()
    attempts = [
        lambda: opt.state[p].__setitem__("exp_avg", torch.zeros_like(before)),
        lambda: opt.state.__setitem__(p, {}),
        lambda: opt.state.__delitem__(p),
        lambda: opt.state[p].__delitem__("exp_avg"),
        lambda: opt.state[p].update(exp_avg=before),
        lambda: opt.state.clear(),
        lambda: opt.state.pop(p),
        lambda: setattr(opt, "state", {}),
    ]
    for attempt in attempts:
        with pytest.raises(TypeError, match="read-only.*load_state_dict"):
            attempt()
    opt.state[p]["exp_avg"].zero_()  # a copy: the optimizer's moments are unchanged
    assert torch.equal(opt.state[p]["exp_avg"], before)


def _torch_internals_keep_working(rank, world, stage):
    model = build()
    opt = make(model, stage)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, rank, 1)
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    assert "ZeroAdamW (" in repr(opt)
    opt.zero_grad(set_to_none=False)
    opt.zero_grad()
    train(model, opt, rank, 1, start=1)
    assert all(float(opt.state[p]["step"]) == 2.0 for p in opt.state)
    with pytest.raises(TypeError, match="zero_ext.checkpoint"):
        pickle.dumps(opt)


@pytest.mark.parametrize("stage", STAGES)
def test_state_reads_this_ranks_pieces(stage):
    run_on_ranks(2, _pieces_match_torch, stage, {})


@pytest.mark.parametrize(
    "options",
    [
        dict(amsgrad=True),
        dict(moment_dtype=torch.bfloat16),
        dict(moment_dtype=torch.int8),
        dict(offload="cpu"),
        dict(offload="nvme", moment_dtype=torch.bfloat16),
    ],
    ids=["amsgrad", "bf16-moments", "int8-moments", "offload-cpu", "offload-nvme-bf16"],
)
def test_state_decodes_every_encoding_and_placement(options, tmp_path):
    if options.get("offload") == "nvme":
        options = {**options, "offload_dir": str(tmp_path)}
    run_on_ranks(2, _pieces_match_torch, 2, options)


@pytest.mark.parametrize("stage", STAGES)
def test_state_writes_raise(stage):
    run_on_ranks(2, _writes_raise, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_torch_internals_that_touch_state_keep_working(stage):
    run_on_ranks(2, _torch_internals_keep_working, stage)
