"""The plain-torch reference of ``ZeroAdamW(moment_dtype=torch.bfloat16)``: one process, no sharding, no zero_ext
kernel. Per parameter an fp32 master and bf16 moments; each step is the kernel's fp32 arithmetic (adamw_math.h,
written out in torch ops) on the mean of the ranks' gradients, then the moments are stored with
tests/helpers/stochastic_rounding.py keyed on (the flat group's seed, the parameter's step, the element's canonical
index), the canonical index computed here from its definition (one rank, one unbounded bucket: parameters in
reverse order, 16-aligned), not by zero_ext.

Why it can be bitwise: every op below is one IEEE fp32 operation as the kernel does it (a tensor divided by a
tensor, not by a Python scalar, which ATen may turn into a multiplication by the reciprocal; the square root taken
in fp64 and rounded once, which is the correctly rounded fp32 sqrt that the kernel's ``sqrtf`` is). The moments'
lerp and fused multiply-add are torch.optim.AdamW's own ops, which csrc/adamw_math.h follows bitwise.

Like tests/helpers/amsgrad_reference.py, the gradients come from a model of the reference's own whose parameters are its
master rounded to bf16: the engine's parameters are those bits (checked at every step), so its gradients are too.
Beside it runs torch.optim.AdamW with fp32 moments on the same gradients, to say how far bf16 moments move the
master from fp32 ones.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
from engine_reference import mean_grads, rank_grads
from stochastic_rounding import random_bits, sr_bf16

PARAM_ALIGN = 16  # the layout's parameter alignment (zero_ext.layout.PARAM_ALIGN), part of the canonical index


def canonical_offsets(numels) -> list[int]:
    out, fill = [0] * len(numels), 0
    for i in reversed(range(len(numels))):
        out[i] = -(-fill // PARAM_ALIGN) * PARAM_ALIGN
        fill = out[i] + numels[i]
    return out


def rounding_seed(group_index: int, dtype: torch.dtype) -> int:
    """The engine's documented seed of a flat group (zero_ext.update.adamw: crc32 of 'param group/param dtype')."""
    return zlib.crc32(f"{group_index}/{dtype}".encode())


class Param:
    def __init__(self, name: str, p: torch.Tensor, amsgrad: bool, seed: int, canonical: int):
        self.name, self.seed, self.canonical, self.amsgrad = name, seed, canonical, amsgrad
        self.master = p.detach().float().clone().reshape(-1)
        self.exp_avg = torch.zeros_like(self.master, dtype=torch.bfloat16)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.max_exp_avg_sq = torch.zeros_like(self.exp_avg) if amsgrad else None
        self.step = 0
        # torch.optim.AdamW with fp32 moments on the same gradients (the "how close to fp32" comparison)
        self.torch_param = self.master.clone().requires_grad_()

    def moments(self) -> dict[str, torch.Tensor]:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.amsgrad:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        return out

    def update(self, g: torch.Tensor, group: dict, grad_scale: Optional[torch.Tensor]) -> None:
        """One step of the kernel's arithmetic (csrc/adamw_math.h, adamw_update) and the stochastic rounding."""
        self.step += 1
        t = self.step
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        g = g.reshape(-1).float()
        if grad_scale is not None:
            g = g * grad_scale
        if group.get("maximize", False):
            g = -g
        full = lambda x: torch.full_like(self.master, x)  # noqa: E731  (an fp32 tensor operand: no scalar shortcuts)
        p = self.master * full(1.0 - lr * wd)
        m = torch.lerp(self.exp_avg.float(), g, 1.0 - beta1)
        v = self.exp_avg_sq.float().mul(beta2).addcmul_(g, g, value=1.0 - beta2)
        v_hat = v
        if self.amsgrad:
            v_hat = torch.maximum(self.max_exp_avg_sq.float(), v)
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        denom = torch.sqrt(v_hat.double()).float() / full(math.sqrt(bc2)) + full(eps)
        self.master = p + (full(-(lr / bc1)) * m) / denom
        r = random_bits(self.seed, t, self.canonical, m.numel())
        self.exp_avg = sr_bf16(m, r & 0xFFFF)
        self.exp_avg_sq = sr_bf16(v, r >> 16)
        if self.amsgrad:
            self.max_exp_avg_sq = sr_bf16(v_hat, r >> 16)


class SRReference:
    """The reference for a ZeroAdamW over ``model``'s bf16 parameters in ``groups`` (param-group dicts whose
    ``params`` are names, all of one dtype), fed the mean of ``world`` ranks' gradients of ``loss(model, batch)``."""

    def __init__(self, model: torch.nn.Module, groups: list[dict], loss, hyper: dict):
        self.model, self.loss, self.hyper = model, loss, dict(hyper)
        self.by_name = dict(model.named_parameters())
        self.groups: list[dict] = []
        self.params: dict[str, Param] = {}
        self.torch = None
        for g in groups:
            self.add_group(g)

    def add_group(self, group: dict) -> None:
        """A param group (names) as the engine's add_param_group adds one: a new flat group, steps from 0."""
        group = {**self.hyper, "amsgrad": False, "maximize": False, **group}
        names = list(group["params"])
        self.params.update(self.make_params(names, group, len(self.groups)))
        self.groups.append(group)
        torch_group = {k: v for k, v in group.items() if k != "params"}
        torch_group["params"] = [self.params[n].torch_param for n in names]
        if self.torch is None:
            self.torch = torch.optim.AdamW([torch_group])
        else:
            self.torch.add_param_group(torch_group)

    def make_params(self, names: list[str], group: dict, gi: int) -> dict[str, Param]:
        """The per-parameter state of param group ``gi`` (bf16 moments: seeded by the group, at canonical offsets)."""
        dtype = self.by_name[names[0]].dtype
        offsets = canonical_offsets([self.by_name[n].numel() for n in names])
        return {
            n: Param(n, self.by_name[n], group["amsgrad"], rounding_seed(gi, dtype), c) for n, c in zip(names, offsets)
        }

    def mean_grads(self, batches, **kw) -> dict[str, Optional[torch.Tensor]]:
        """The mean over ranks of the gradients of ``loss`` on ``batches`` (one per rank) at the current params."""
        named = list(self.model.named_parameters())
        per_rank = rank_grads(self.model, [p for _, p in named], batches, self.loss, **kw)
        return dict(zip([n for n, _ in named], mean_grads(per_rank, [p for _, p in named])))

    def step(self, means: dict, grad_scale: Optional[torch.Tensor] = None) -> bool:
        """One step; False (nothing changed) when a gradient is not finite, as the engine skips it."""
        got = {n: g for n, g in means.items() if n in self.params and g is not None}
        if not all(bool(torch.isfinite(g).all()) for g in got.values()):
            return False
        for group in self.groups:
            for n in group["params"]:
                if n in got:
                    self.params[n].update(got[n], group, grad_scale)
        for n, p in self.params.items():
            p.torch_param.grad = got[n].reshape(-1).float() * (grad_scale if grad_scale is not None else 1.0) \
                if n in got else None  # fmt: skip
        self.torch.step()
        with torch.no_grad():
            for n, p in self.params.items():
                self.by_name[n].copy_(p.master.view(self.by_name[n].shape))  # rounded to nearest even
        return True

    # ---------------------------------------------------------------- checks
    def check(self, opt, model, what: str) -> None:
        """``opt`` (this rank) against the reference: full parameters (gathered at stage 3) bitwise the master
        rounded; this rank's state dict: master and moments bitwise (the moments widened from bf16), own steps."""
        names = self.names(opt, model)
        with opt.gathered_params():
            for n, p in model.named_parameters():
                if n in self.params:
                    expected = self.params[n].master.view(p.shape).to(p.dtype)
                    assert torch.equal(p.detach(), expected), f"{what}: {n}: {int((p != expected).sum())} differ"
        for index, entry in opt.state_dict()["state"].items():
            ref = self.params[names[index]]
            runs = entry["shard_ranges"] if "shard_ranges" in entry else [entry["shard_range"]]
            mine = lambda t: torch.cat([t.reshape(-1)[s:e] for s, e in runs])  # noqa: E731
            assert float(entry["step"]) == ref.step, f"{what}: {ref.name}: step {entry['step']} != {ref.step}"
            for kind, full in ref.moments().items():
                assert entry[kind].dtype == torch.float32, f"{what}: {ref.name}: {kind} saved as {entry[kind].dtype}"
                same = torch.equal(entry[kind], mine(full).float())
                assert same, f"{what}: {ref.name}: {kind}: {int((entry[kind] != mine(full).float()).sum())} differ"
            assert torch.equal(entry["master"], mine(ref.master)), f"{what}: {ref.name}: master"

    @staticmethod
    def names(opt, model) -> list[str]:
        """The optimizer's global parameter order (state dict indices) as ``model``'s names."""
        by_id = {id(p): n for n, p in model.named_parameters()}
        return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]

    def distance_to_fp32(self) -> tuple[float, float]:
        """(max |master - torch.optim.AdamW fp32 master|, max |an update of this run|) over every element."""
        diff = max(float((p.master - p.torch_param.detach()).abs().max()) for p in self.params.values())
        return diff, max(g["lr"] for g in self.groups)
