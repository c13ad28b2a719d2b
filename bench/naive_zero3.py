"""A deliberately NAIVE per-parameter ZeRO-3, for contrast only (bench_engine_step.py's ``naive_zero3``).

This is the textbook scheme the seed blog measured (97 % communication overhead), written as plainly as possible so
that its cost can be set beside zero_ext's bucketed, prefetching stage 3 in the same interleaved run:

- every rank keeps a 1/N fp32 shard of every parameter (each parameter padded to a multiple of N on its own);
- just before a module runs, each of its own parameters is all-gathered (bf16, blocking) from the shards, one
  collective per parameter, and freed right after the module's forward;
- in backward, when the module's output gradient arrives, its parameters are all-gathered again (blocking);
- each gradient is reduce-scattered on its own (fp32, blocking) as soon as it is accumulated, averaged into the
  fp32 grad shard, and the full parameter freed;
- plain ``torch.optim.AdamW(fused=True)`` (the DDP baseline's optimizer) on the fp32 shards, after the global
  gradient norm is clipped (one all-reduce).

No buckets, no prefetch, no overlap: every collective blocks the step. Nothing here is used by zero_ext.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten


class NaiveZero3:
    """Shards ``model``'s parameters (built in fp32) and trains it with per-parameter collectives."""

    def __init__(self, model: torch.nn.Module, lr: float, betas, weight_decay: float, max_grad_norm: float,
                 param_dtype: torch.dtype = torch.bfloat16):  # fmt: skip
        self.model, self.max_grad_norm, self.param_dtype = model, max_grad_norm, param_dtype
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = list(dict.fromkeys(model.parameters()))  # a tied parameter once
        self.shards: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 shard (the optimizer's param)
        self.shapes: dict[int, torch.Size] = {}  # id(param) -> its full shape (.data is empty between uses)
        self.empty = torch.empty(0, dtype=param_dtype)
        for p in self.params:
            padded = -(-p.numel() // self.world) * self.world
            flat = torch.zeros(padded, dtype=torch.float32)
            flat[: p.numel()] = p.detach().reshape(-1).float()
            per = padded // self.world
            self.shards[id(p)] = flat[self.rank * per : (self.rank + 1) * per].clone()
            self.shapes[id(p)] = p.shape
            p.data = self.empty  # free: the full parameter exists only while gathered
            p.register_post_accumulate_grad_hook(self._reduce_grad)
        self.opt = torch.optim.AdamW(list(self.shards.values()), lr=lr, betas=betas, weight_decay=weight_decay,
                                     fused=True)  # fmt: skip
        self.live_bytes = self.peak_bytes = 0  # gathered full parameters now / at most (the window)
        self.comm_s = 0.0  # time spent blocked in collectives
        self.collectives = 0
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward)

    # ---------------------------------------------------------------- gather / free, one parameter at a time
    def _gather(self, p: torch.Tensor) -> None:
        if p.data.numel():
            return
        shard = self.shards[id(p)]
        full = torch.empty(shard.numel() * self.world, dtype=self.param_dtype)
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(full, shard.to(self.param_dtype))
        self.comm_s += time.perf_counter() - t0
        self.collectives += 1
        shape = self.shapes[id(p)]
        p.data = full[: shape.numel()].view(shape)
        self.live_bytes += full.numel() * full.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, p: torch.Tensor) -> None:
        if p.data.numel():
            self.live_bytes -= self.shards[id(p)].numel() * self.world * p.data.element_size()
            p.data = self.empty

    def _pre_forward(self, module, _args) -> None:
        for p in module.parameters(recurse=False):
            self._gather(p)

    def _post_forward(self, module, _args, output) -> None:
        own = list(module.parameters(recurse=False))
        for p in own:
            self._free(p)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:  # gather again when the output's gradient arrives (the module's backward is next)
                t.register_hook(lambda grad, own=own: [self._gather(p) for p in own] and None)

    def _reduce_grad(self, p: torch.Tensor) -> None:
        shard = self.shards[id(p)]
        full = torch.zeros(shard.numel() * self.world, dtype=torch.float32)
        full[: p.grad.numel()] = p.grad.reshape(-1)
        out = torch.empty_like(shard)
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(out, full)
        self.comm_s += time.perf_counter() - t0
        self.collectives += 1
        out /= self.world
        shard.grad = out if shard.grad is None else shard.grad.add_(out)
        p.grad = None
        self._free(p)

    # ---------------------------------------------------------------- the optimizer side
    @torch.no_grad()
    def step(self) -> None:
        grads = [s.grad for s in self.shards.values() if s.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1)
        t0 = time.perf_counter()
        dist.all_reduce(sq)
        self.comm_s += time.perf_counter() - t0
        self.collectives += 1
        coef = (self.max_grad_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0).reshape(())
        torch._foreach_mul_(grads, coef)
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def model_state(self) -> dict:
        """Persistent bytes on this rank (fp32 shards, their grads, AdamW state) and the gathered window's peak."""
        shards = list(self.shards.values())
        states = [self.opt.state[s] for s in shards if s in self.opt.state]
        parts = {
            "params": sum(s.numel() * 4 for s in shards),
            "grads": sum(s.grad.numel() * 4 for s in shards if s.grad is not None),
            "exp_avg": sum(st["exp_avg"].numel() * 4 for st in states),
            "exp_avg_sq": sum(st["exp_avg_sq"].numel() * 4 for st in states),
            "step": sum(st["step"].numel() * st["step"].element_size() for st in states),
        }
        return {"allocated": parts, "total": sum(parts.values()), "window_peak": self.peak_bytes}
