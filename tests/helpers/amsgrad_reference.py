"""The references for ZeroAdamW's ``amsgrad`` and ``maximize``: torch.optim.AdamW(amsgrad=..., maximize=...) and the
unsharded fused kernel with the same flags, both fed the mean of the ranks' gradients, and a ZeroAdamW compared
with them through public API only (its state dict and ``gathered_params``).

The references compute the ranks' gradients on a model of their own whose parameters are the fused reference's
master rounded to the param dtype: the engine's parameters are those bits (that is checked), so its gradients are
the same, at any stage, world size or offload, and a run can be replayed from a checkpoint at another world size.

What "bitwise torch" means here: torch.optim.AdamW's moments (exp_avg, exp_avg_sq, max_exp_avg_sq) depend only on
the gradients, and the kernel follows torch's roundings, so they equal torch's bit for bit. The master does not
always: torch's fp32 sqrt is not correctly rounded on a few elements (tests/kernels/test_fused_adamw.py; about 0.6% of
elements after 5 steps of the tiny GPT, measured: 64 to 116 of 15306), so the master equals the unsharded fused
kernel bitwise (sharding, offload and checkpoints change no bit) and torch's within its default fp32 tolerance on
all but a few elements.
"""

from __future__ import annotations

import contextlib

import torch
from engine_reference import mean_grads, rank_grads
from tiny_transformer import batch, build, loss_fn
from torch_sqrt import torch_sqrt_inexact_share

from zero_ext import ops

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# (amsgrad, maximize) given to the constructor; the second param group overrides both with the other value, so every
# case has an amsgrad group and a plain one, and a maximizing group and a minimizing one.
FLAGS = [(True, False), (False, True), (True, True)]
FLAG_IDS = ["amsgrad", "maximize", "amsgrad_maximize"]
# The loss is scaled by these per step: after two full-size gradients, g^2 falls by 2^-8 (< 1 - beta2 = 0.05), so
# exp_avg_sq falls below amsgrad's running max, which then divides the update instead (powers of two: exact).
SCALES = (1.0, 1.0, 2.0**-4, 2.0**-4, 2.0**-2, 2.0**-4, 1.0, 2.0**-4)


# The share of master elements that may differ from torch's by torch's sqrt rounding: 2 % where torch's sqrt is
# nearly exact (measured: below 0.8 % with AVX-512), else as often as its sqrt is inexact (measured: 9.3 % of the
# masters with AVX2, where 19.7 % of its square roots are).
TORCH_MASTER_SLACK = max(0.02, torch_sqrt_inexact_share())


@contextlib.contextmanager
def one_thread():
    """The references' many small ops on one intra-op thread, as the ranks run: with two threads on two loaded cores
    (other processes running) they took 7 s instead of 0.3 s (measured, load average 10)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def scaled_loss(model, tokens, scale=1.0):
    return loss_fn(model, tokens) * scale


def param_groups(named, amsgrad: bool, maximize: bool) -> list[dict]:
    """Matrices with the constructor's flags and weight decay; vectors with both flags overridden and no decay."""
    return [
        {"params": [(n, p) for n, p in named if p.dim() > 1]},
        {"params": [(n, p) for n, p in named if p.dim() <= 1], "amsgrad": not amsgrad, "maximize": not maximize,
         "weight_decay": 0.0},
    ]  # fmt: skip


def build_optimizer(model, amsgrad: bool, maximize: bool, stage: int, bucket_size: int, **kw):
    from zero_ext import ZeroAdamW

    module = model if stage == 3 else None
    groups = param_groups(list(model.named_parameters()), amsgrad, maximize)
    return ZeroAdamW(groups, **HYPER, amsgrad=amsgrad, maximize=maximize, stage=stage, bucket_size=bucket_size,
                     module=module, **kw)  # fmt: skip


def full_params(opt, model) -> dict[str, torch.Tensor]:
    """Copies of the full parameters by name (gathered at stage 3). Collective."""
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def local_state(opt) -> dict:
    """This rank's state dict entries (deep copies): {param index: {key: value}}."""
    return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in e.items()}
            for i, e in opt.state_dict()["state"].items()}  # fmt: skip


def assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different parameters owned"
    for i, entry in a.items():
        assert entry.keys() == b[i].keys(), f"{what}: parameter {i}: keys {sorted(entry)} vs {sorted(b[i])}"
        for k, v in entry.items():
            w = b[i][k]
            same = v.dtype == w.dtype and torch.equal(v, w) if torch.is_tensor(v) else v == w
            assert same, f"{what}: parameter {i}: {k} differs"


def assert_same_params(a: dict, b: dict, what: str) -> None:
    for name, x in a.items():
        assert x.dtype == b[name].dtype and torch.equal(x, b[name]), f"{what}: parameter {name} differs"


class Reference:
    """torch.optim.AdamW and the fused kernel, unsharded, with the groups of :func:`param_groups`, fed the mean of
    ``world`` ranks' gradients of ``scaled_loss`` on ``batch(step, rank)``."""

    def __init__(self, dtype: torch.dtype, amsgrad: bool, maximize: bool):
        self.dtype = dtype
        self.model = build(dtype)  # the gradients' model: its parameters follow the fused master
        named = list(self.model.named_parameters())
        groups = param_groups(named, amsgrad, maximize)
        self.names = [n for g in groups for n, _ in g["params"]]  # the optimizer's order (state dict indices)
        self.by_name = dict(named)
        self.model_order = [n for n, _ in named]
        self.torch_params = {n: self.by_name[n].detach().float().clone().requires_grad_() for n in self.names}
        self.torch = torch.optim.AdamW(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [self.torch_params[n] for n, _ in g["params"]]}
             for g in groups], **HYPER, amsgrad=amsgrad, maximize=maximize)  # fmt: skip
        self.group_of = {n: gi for gi, g in enumerate(groups) for n, _ in g["params"]}
        self.master = {n: self.by_name[n].detach().float().clone().reshape(-1) for n in self.names}
        self.exp_avg = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.max_exp_avg_sq = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.steps = 0

    def amsgrad(self, name: str) -> bool:
        return self.torch.param_groups[self.group_of[name]]["amsgrad"]

    def set_flag(self, group: int, key: str, value: bool) -> None:
        """Change a group's flag in the references, as a trainer changes ``opt.param_groups[group][key]``."""
        self.torch.param_groups[group][key] = value

    def mean_grads(self, step: int, world: int) -> dict[str, torch.Tensor]:
        """The mean over ``world`` ranks of the gradients at the current parameters, by name."""
        params = [self.by_name[n] for n in self.model_order]
        batches = [batch(step, r) for r in range(world)]
        per_rank = rank_grads(self.model, params, batches, scaled_loss, scale=SCALES[step])
        return dict(zip(self.model_order, mean_grads(per_rank, params)))

    def step(self, means: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        for n, p in self.torch_params.items():
            p.grad = means[n].clone()
        self.torch.step()
        beta1, beta2 = HYPER["betas"]
        for n in self.names:
            group = self.torch.param_groups[self.group_of[n]]
            ops.fused_adamw_(self.master[n], means[n].reshape(-1).float().contiguous(), self.exp_avg[n],
                             self.exp_avg_sq[n], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], step=self.steps,
                             max_exp_avg_sq=self.max_exp_avg_sq[n] if group["amsgrad"] else None,
                             maximize=group["maximize"])  # fmt: skip
        with torch.no_grad():
            for n, m in self.master.items():
                self.by_name[n].copy_(m.view(self.by_name[n].shape))  # rounded to nearest even, as the engine does

    def train(self, steps, world: int) -> None:
        """Steps ``steps`` (an iterable of step numbers) on ``world`` ranks' mean gradient."""
        for s in steps:
            self.step(self.mean_grads(s, world))

    def fused_kinds(self, name: str) -> dict[str, torch.Tensor]:
        out = {"exp_avg": self.exp_avg[name], "exp_avg_sq": self.exp_avg_sq[name]}
        if self.amsgrad(name):
            out["max_exp_avg_sq"] = self.max_exp_avg_sq[name]
        return out

    def assert_max_is_exercised(self) -> None:
        """amsgrad's running max holds an older, larger value than exp_avg_sq on most elements (else amsgrad would
        not be tested at all)."""
        above = total = 0
        for n, p in self.torch_params.items():
            if self.amsgrad(n):
                state = self.torch.state[p]
                above += int((state["max_exp_avg_sq"] > state["exp_avg_sq"]).sum())
                total += p.numel()
        assert total > 0 and above > total // 2, f"max_exp_avg_sq > exp_avg_sq on only {above} of {total} elements"

    def check_torch_against_fused(self) -> None:
        """The two references agree as the module docstring says (what :meth:`check` relies on)."""
        differs = total = 0
        for n, p in self.torch_params.items():
            state = self.torch.state[p]
            assert state.keys() == {"step", *self.fused_kinds(n)}, (n, sorted(state))
            for kind, full in self.fused_kinds(n).items():
                assert torch.equal(state[kind].reshape(-1), full), f"{n}: {kind}"
            torch.testing.assert_close(p.detach().reshape(-1), self.master[n])
            differs += int((p.detach().reshape(-1) != self.master[n]).sum())
            total += p.numel()
        assert differs <= TORCH_MASTER_SLACK * total, f"{differs} of {total} masters differ"

    def check(self, opt, model, what: str) -> int:
        """``opt`` (this rank) against both references: the full parameters bitwise the fused master rounded; this
        rank's state dict entries bitwise the fused moments and master, and the moments bitwise torch's, with
        ``max_exp_avg_sq`` (1-D fp32) exactly for the parameters of amsgrad groups; the master within torch's fp32
        tolerance, and bitwise torch's on all but a few elements. Returns the elements this rank owns."""
        params = full_params(opt, model)
        for n, p in params.items():
            expected = self.master[n].view(p.shape).to(self.dtype)
            assert torch.equal(p, expected), f"{what}: {n}: {int((p != expected).sum())} elements differ"
        sd = opt.state_dict()
        owned = differs = 0
        for index, entry in sd["state"].items():
            n = self.names[index]
            # a parameter split across buckets: several runs of it on one rank ("shard_ranges"), one after the other
            ranges = "shard_ranges" if "shard_ranges" in entry else "shard_range"
            runs = entry[ranges] if ranges == "shard_ranges" else [entry[ranges]]
            mine_of = lambda t: torch.cat([t.reshape(-1)[s:e] for s, e in runs])  # noqa: E731
            owned += sum(e - s for s, e in runs)
            kinds = self.fused_kinds(n)
            expected_keys = {"step", ranges, *kinds} | ({"master"} if self.dtype != torch.float32 else set())
            assert set(entry) == expected_keys, f"{what}: {n}: state dict keys {sorted(entry)}, not {expected_keys}"
            assert float(entry["step"]) == self.steps, f"{what}: {n}: step {entry['step']}"
            torch_state = self.torch.state[self.torch_params[n]]
            for kind, full in kinds.items():
                mine = entry[kind]
                assert mine.dtype == torch.float32 and mine.shape == mine_of(full).shape, f"{what}: {n}: {kind}"
                assert torch.equal(mine, mine_of(full)), f"{what}: {n}: {kind} differs from the fused kernel's"
                theirs = mine_of(torch_state[kind])
                assert torch.equal(mine, theirs), f"{what}: {n}: {kind} differs from torch.optim.AdamW's"
            master = entry["master"] if "master" in entry else mine_of(params[n])
            assert torch.equal(master, mine_of(self.master[n])), f"{what}: {n}: master differs from the fused one"
            theirs = mine_of(self.torch_params[n].detach())
            torch.testing.assert_close(master, theirs, msg=lambda m, n=n: f"{what}: {n}: master vs torch: {m}")
            differs += int((master != theirs).sum())
        assert differs <= TORCH_MASTER_SLACK * max(owned, 1), f"{what}: {differs} of {owned} masters differ from torch"
        return owned
