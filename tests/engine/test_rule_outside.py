"""An update rule written outside zero_ext (torch.optim.SGD with momentum and weight decay, in plain torch ops,
one state kind ``momentum_buffer``), registered from here and picked by a param group's ``"rule"``: it trains at
stages 1, 2 and 3 with every offload on 1, 2 and 3 gloo ranks, checkpoints, loads at another world size and
consolidates, bitwise against a plain loop over the parameters applying the same formula to the mean gradient."""

import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import mean_grads, offload_kwargs, params_digest, rank_grads
from pairwise import marked_slow, pairwise
from safetensors import safe_open
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint
from zero_ext.update.protocol import MASTER, ElementwiseRule, StateKind, UpdateRule
from zero_ext.update.registry import register, rule_named

NAME = "test_sgd_momentum"
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=False)
WINDOW = 3 * 10 * 1024 * 2  # nvme: several chunks per shard (10 bytes per element: master, buffer, bf16 param)


def sgd_formula(p, g, buf, lr, momentum, weight_decay, nesterov):
    """torch.optim.SGD's update (dampening 0) on fp32 tensors, one rounding per op: new (param, momentum buffer). A
    zero buffer is torch's first step (it starts the buffer as the gradient: 0 * momentum + d == d)."""
    d = torch.add(g, torch.mul(p, weight_decay))
    buf = torch.add(torch.mul(buf, momentum), d)
    step = torch.add(d, torch.mul(buf, momentum)) if nesterov else buf
    return torch.sub(p, torch.mul(step, lr)), buf


class SGDMomentum(ElementwiseRule):
    name = NAME

    def __init__(self, param_dtype, group, options):
        super().__init__(param_dtype)
        if options.param_remainders or options.moment_dtype is not torch.float32:
            raise ValueError(f"{NAME}: keeps an fp32 master and an fp32 momentum buffer only")
        self.kinds = (StateKind(MASTER), StateKind("momentum_buffer"))

    def check_group(self, where, group, device=None, read_device_values=True):
        for key in ("lr", "momentum", "weight_decay"):
            if not isinstance(group.get(key), (int, float)) or group[key] < 0:
                raise ValueError(f"{where}: `{key}` must be a number >= 0, got {group.get(key)!r}")
        if not isinstance(group.get("nesterov", False), bool):
            raise ValueError(f"{where}: `nesterov` must be True or False")

    def scalars(self, group):
        return (group["lr"], group["momentum"], group["weight_decay"], group.get("nesterov", False))

    def apply(self, state, grad, param_out, scalars, step, grad_scale, found_inf, element_offset=0):
        master, buf = state[MASTER], state["momentum_buffer"]
        new_p, new_buf = sgd_formula(master, torch.mul(grad, grad_scale), buf, *scalars)
        if found_inf is not None:  # a non-finite gradient somewhere: change nothing (no host sync)
            skip = found_inf > 0
            new_p, new_buf = torch.where(skip, master, new_p), torch.where(skip, buf, new_buf)
        master.copy_(new_p)
        buf.copy_(new_buf)
        if param_out is not None:
            param_out.copy_(master)  # round to nearest even


register(NAME, SGDMomentum, saved_kinds=(MASTER, "momentum_buffer"))


class Reference:
    """The unsharded run: every parameter's fp32 master and buffer, updated one parameter at a time."""

    def __init__(self, model):
        self.master = [p.detach().float().clone() for p in model.parameters()]
        self.buf = [torch.zeros_like(m) for m in self.master]

    def step(self, means):
        for i, g in enumerate(means):
            if g is not None:
                self.master[i], self.buf[i] = sgd_formula(self.master[i], g, self.buf[i], **SGD)

    def check(self, opt, model, dtype, what):
        for (name, p), m in zip(model.named_parameters(), self.master):
            assert torch.equal(p.detach(), m.to(dtype)), f"{what}: parameter {name}"
        full = {MASTER: self.master, "momentum_buffer": self.buf}
        for ref in opt.sharded_state.pieces():
            for kind, values in full.items():
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                expected = values[ref.param_index].reshape(-1)[ref.piece.start : ref.piece.end]
                assert torch.equal(mine, expected), f"{what}: {kind} of {ref.name}"


def _optimizer(model, stage, offload, root, rank, tag):
    kw = offload_kwargs(offload, root, rank, tag, WINDOW)
    groups = [{"params": list(model.parameters()), "rule": NAME, **SGD}]
    return ZeroAdamW(groups, stage=stage, module=model, bucket_size=1500, **kw)


def _train(model, opt, ref, rank, world, steps, first, dtype, what):
    for step in range(first, first + steps):
        if opt.stage < 3:  # the engine's own model, as the parity tests (a matmul's bits may follow its memory)
            params = list(model.parameters())
            ref.step(mean_grads(rank_grads(model, params, [batch(step, r) for r in range(world)], loss_fn), params))
        else:  # its parameters are sharded: a model holding the reference's
            ref.step(_means(ref, step, world))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            ref.check(opt, model, dtype, f"{what} step {step}")


def _trains(rank, world, stage, offload, dtype_name, root):
    dtype = getattr(torch, dtype_name)
    model = build(dtype)
    opt = _optimizer(model, stage, offload, root, rank, f"train-s{stage}")
    assert isinstance(opt.sharded_state.groups[0].rule, UpdateRule)
    assert [g.rule.name for g in opt.sharded_state.groups] == [NAME]
    assert opt.sharded_state.groups[0].rule.kind_names == (MASTER, "momentum_buffer")
    _train(model, opt, Reference(build(dtype)), rank, world, 4, 0, dtype, f"stage {stage} offload {offload}")
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest


WORLDS = [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]


# World size, offload and stage act independently: every one-rank combination (the quick loop's), then every pair of
# values with 2 and 3 ranks (tests/helpers/pairwise.py): 15 runs instead of 27.
AXES = {"world": [1, 2, 3], "offload": [None, "cpu", "nvme"], "stage": [1, 2, 3]}
ONE_RANK = [(1, o, s) for o in AXES["offload"] for s in AXES["stage"]]
CASES = ONE_RANK + pairwise(AXES, covered=ONE_RANK)


@pytest.mark.parametrize("world,offload,stage", marked_slow(CASES, lambda row: row[0] > 1))
def test_rule_from_outside_trains_bitwise(tmp_path, stage, offload, world):
    digests = run_on_ranks(world, _trains, stage, offload, "bfloat16", str(tmp_path))
    assert len(set(digests)) == 1, "params differ between ranks"


def test_fp32_params_are_their_own_master(tmp_path):
    run_on_ranks(1, _trains, 2, None, "float32", str(tmp_path))


def _save(rank, world, path, root):
    dtype = torch.bfloat16
    model = build(dtype)
    opt = _optimizer(model, 2, "cpu", root, rank, "save")
    _train(model, opt, Reference(build(dtype)), rank, world, 3, 0, dtype, "before save")
    checkpoint.save(path, opt)
    opt.close()


def _load(rank, world, saved_world, path, stage, offload, root):
    dtype = torch.bfloat16
    model = build(dtype, seed=1)  # other weights: the load must bring the saved ones
    opt = _optimizer(model, stage, offload, root, rank, f"load-s{stage}")
    checkpoint.load(path, opt)
    ref = Reference(build(dtype))
    for step in range(3):  # the saved run, replayed at its own world size
        ref.step(_means(ref, step, saved_world))
    with opt.gathered_params():
        ref.check(opt, model, dtype, "after load")
    _train(model, opt, ref, rank, world, 2, 3, dtype, f"loaded at {world} ranks")
    opt.close()


def _means(ref, step, world):
    """The mean gradients of ``world`` ranks at ``step``, for a model holding the reference's params."""
    dtype = torch.bfloat16
    model = build(dtype)
    with torch.no_grad():
        for p, m in zip(model.parameters(), ref.master):
            p.copy_(m.to(dtype))
    return mean_grads(rank_grads(model, list(model.parameters()), [batch(step, r) for r in range(world)], loss_fn),
                      list(model.parameters()))  # fmt: skip


def _replay(rank, world, saved_world):
    ref = Reference(build(torch.bfloat16))
    for step in range(3):
        ref.step(_means(ref, step, saved_world))
    return ref


@pytest.mark.slow
def test_rule_from_outside_checkpoints_at_any_world_size(tmp_path):
    path, root = str(tmp_path / "ck"), str(tmp_path / "offload")
    run_on_ranks(2, _save, path, root)
    run_on_ranks(1, _load, 2, path, 3, "nvme", root)
    run_on_ranks(3, _load, 2, path, 1, None, root)
    run_on_ranks(2, _load, 2, path, 3, "cpu", root)

    # consolidated offline: the fp32 master as param/<name>, the buffer under its kind's name, bitwise the reference
    out = tmp_path / "out"
    checkpoint.consolidate(path, out)
    ref = run_on_ranks(1, _replay, 2)[0]  # in a worker: its gradients' bits, whatever threads this process has
    names = [n for n, _ in build(torch.bfloat16).named_parameters()]
    with safe_open(os.path.join(out, "optimizer.safetensors"), framework="pt") as f:
        for name, m, b in zip(names, ref.master, ref.buf):
            assert torch.equal(f.get_tensor(f"param/{name}"), m), name
            assert torch.equal(f.get_tensor(f"momentum_buffer/{name}"), b), name
            assert "exp_avg/" + name not in f.keys()
    sd = checkpoint.adamw_state_dict(out)  # torch.optim's state dict shape: the rule's kinds per parameter
    assert set(sd["state"][0]) == {"step", "momentum_buffer"}
    assert rule_named(NAME).saved_kind_names == (MASTER, "momentum_buffer")
