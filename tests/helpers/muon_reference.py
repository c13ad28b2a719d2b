"""The unsharded run ZeroMuon must reproduce: one process, fp32 master copies of every parameter,
``torch.optim.Muon`` over the Muon groups' matrices and AdamW (the fused kernel, one parameter at a time, as
``engine_reference.FusedReference``) over the others, fed the mean of every rank's gradients.

The test model is tests/helpers/tiny_transformer.py's GPT: the blocks' 2-D weights are Muon's (blocks.0's at one lr,
blocks.1's at another: two Muon groups), everything else (embedding tied to the head, positions, norms, biases) is
an AdamW group; ``blocks.0.proj.weight`` (a matrix) and ``ln_f.bias`` are frozen."""

from __future__ import annotations

import torch

from zero_ext import ops

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
MUON_LR_1 = 0.01  # blocks.1's matrices
ADAM = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
FROZEN = ("blocks.0.proj.weight", "ln_f.bias")


def freeze(model) -> None:
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)


def group_names(model) -> tuple[list[str], list[str], list[str]]:
    """(blocks.0's matrices, blocks.1's matrices, the AdamW parameters), in registration order."""
    m0, m1, adam = [], [], []
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and p.ndim == 2:
            (m0 if name.startswith("blocks.0.") else m1).append(name)
        else:
            adam.append(name)
    return m0, m1, adam


def zero_muon_groups(model) -> list[dict]:
    """ZeroMuon's param groups for ``model`` (frozen parameters included: the optimizer leaves them alone)."""
    params = dict(model.named_parameters())
    m0, m1, adam = group_names(model)
    return [
        {"params": [params[n] for n in m0]},
        {"params": [params[n] for n in m1], "lr": MUON_LR_1},
        {"params": [params[n] for n in adam], "use_muon": False, **ADAM},
    ]


class MuonReference:
    """fp32 masters of every parameter; torch.optim.Muon and the fused AdamW kernel update them from mean grads."""

    def __init__(self, model, **muon):
        self.names = [n for n, _ in model.named_parameters()]
        self.dtypes = [p.dtype for _, p in model.named_parameters()]
        self.master = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        m0, m1, self.adam = group_names(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        hyper = {**MUON, **muon}
        groups = [{"params": [self.master[n] for n in m0 if n in trainable]},
                  {"params": [self.master[n] for n in m1 if n in trainable], "lr": MUON_LR_1}]  # fmt: skip
        self.muon = torch.optim.Muon(groups, **hyper)
        self.muon_names = [n for n in m0 + m1 if n in trainable]
        self.adam = [n for n in self.adam if n in trainable]
        self.exp_avg = {n: torch.zeros_like(self.master[n]) for n in self.adam}
        self.exp_avg_sq = {n: torch.zeros_like(self.master[n]) for n in self.adam}
        self.steps = 0

    def step(self, means: dict, clip: float | None = None) -> None:
        """One step from ``means`` (name -> mean gradient, fp32, or None); ``clip``: torch's clip_grad_norm_ first."""
        for n in self.muon_names:  # a matrix without a gradient: torch's Muon leaves it alone
            self.master[n].grad = None if means[n] is None else means[n].clone()
        grads = {n: means[n].clone() for n in self.adam}
        if clip is not None:
            every = [self.master[n].grad for n in self.muon_names if self.master[n].grad is not None]
            every += list(grads.values())
            norm = torch.nn.utils.get_total_norm(every, foreach=False)
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s coefficient
            for g in every:
                g.mul_(coef)
        self.muon.step()
        self.steps += 1
        beta1, beta2 = ADAM["betas"]
        for n in self.adam:
            ops.fused_adamw_(self.master[n].view(-1), grads[n].reshape(-1).float().contiguous(),
                             self.exp_avg[n].view(-1), self.exp_avg_sq[n].view(-1), lr=ADAM["lr"], beta1=beta1,
                             beta2=beta2, eps=ADAM["eps"], weight_decay=ADAM["weight_decay"], step=self.steps)  # fmt: skip

    def load_into(self, model) -> None:
        """Copy the masters (rounded to each parameter's dtype) into ``model``."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.master[name].to(p.dtype))

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """Every kind the engine keeps for parameter ``name``, as the reference holds it."""
        if name in self.adam:
            return {"master": self.master[name], "exp_avg": self.exp_avg[name], "exp_avg_sq": self.exp_avg_sq[name]}
        buf = self.muon.state[self.master[name]].get("momentum_buffer", torch.zeros_like(self.master[name]))
        return {"master": self.master[name], "momentum_buffer": buf}

    def check(self, opt, model, what: str, exact: bool = True, twin: MuonReference | None = None) -> None:
        """Inside ``gathered_params()``: every parameter is its master in the param dtype, and this rank's pieces of
        every kind of state equal the reference's (bitwise; with ``exact=False`` at fp32 tolerance or, for a tensor
        outside it, within 4x the distance of ``twin``: this reference run again on gradients one bf16 ulp off
        (:func:`nudged`). A sum in another order moves a mean or a clip coefficient by an fp32 ulp, which can flip a
        bf16 rounding of Newton-Schulz's input; its bf16 GEMMs amplify that by an amount that depends on the CPU:
        issue 46, where a fixed tolerance failed on the AVX-512-BF16 CPUs)."""
        for (name, p), dtype in zip(model.named_parameters(), self.dtypes):
            expected = self.master[name].to(dtype).cpu()
            if exact:
                assert torch.equal(p.detach().cpu(), expected), f"{what}: parameter {name}"
            else:
                other = None if twin is None else twin.master[name].to(dtype).cpu()
                _close(p.detach().cpu(), expected, other, f"{what}: {name}")
        for ref in opt.sharded_state.pieces():
            for kind, full in self.state(ref.name).items():
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                expected = full.reshape(-1)[ref.piece.start : ref.piece.end].cpu()
                if exact:
                    assert torch.equal(mine, expected), f"{what}: {kind} of {ref.name}"
                else:
                    other = None if twin is None else twin.state(ref.name)[kind].reshape(-1)
                    other = None if other is None else other[ref.piece.start : ref.piece.end].cpu()
                    _close(mine, expected, other, f"{what}: {kind} of {ref.name}")


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The 2-norm of ``a - b``, in float64."""
    return (a.double() - b.double()).norm().item()


def _close(actual: torch.Tensor, expected: torch.Tensor, twin: torch.Tensor | None, what: str) -> None:
    """fp32 tolerance, or within 4x the twin's distance to ``expected`` (see MuonReference.check)."""
    try:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        if twin is None:
            raise
        ours, theirs = (distance(x, expected) for x in (actual, twin))
        assert ours <= 4 * theirs, f"{what}: {ours:.3g} from the reference, 4x its twin's distance is {4 * theirs:.3g}"


def nudged(means: dict, seed: int) -> dict:
    """``means`` with every element moved by one bf16 ulp of its value, up or down at random: the twin reference's
    gradients. Newton-Schulz casts its input to bf16, so a mean or clip coefficient one fp32 ulp off reaches it only
    where that flips an element's bf16 rounding (by one bf16 ulp); moving every element so bounds that pattern."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, g in means.items():
        if g is None:
            out[name] = None
            continue
        up = torch.rand(g.shape, generator=gen) < 0.5
        rounded = g.bfloat16()
        step = (
            torch.nextafter(rounded, torch.where(up, float("inf"), float("-inf")).bfloat16()).float() - rounded.float()
        )
        out[name] = g + step
    return out
