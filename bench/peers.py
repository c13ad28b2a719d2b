"""PyTorch's own data-parallel contenders, and the naive ZeRO-3, as bench_engine_step.py runs them beside ZeroAdamW.

Every peer trains the benchmark GPT from the same weights as harness.build (fp32 init rounded to bf16), on the same
batches, under bf16 autocast, clips the global gradient norm at ``max_grad_norm`` and steps AdamW with the same
hyperparameters:

- ``fsdp2``: FSDP2 (ZeRO-3): ``fully_shard`` on every block, then on the root, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded params, bf16 all-gathers, fp32
  reduce-scatters); ``torch.optim.AdamW(fused=True)`` on the sharded DTensors; ``clip_grad_norm_``;
- ``fsdp2_keep``: the same with ``reshard_after_forward=False`` (ZeRO-2-like: params stay gathered until backward);
- ``fsdp2_fp32``: ``fsdp2`` with no mixed precision and no autocast (fp32 gathers, compute and reduce), the peer of
  the fp32 comparison (ZeroAdamW's fp32-parameter recipes; for CPUs without a fast bf16 matmul);
- ``zero_redundancy``: DDP (fp32 params, 25 MB buckets) + ``torch.distributed.optim.ZeroRedundancyOptimizer``
  wrapping ``torch.optim.AdamW(fused=True)`` (ZeRO-1: each rank steps the parameters it owns, then broadcasts them);
- ``naive_zero3``: bench/naive_zero3.py, per-parameter blocking collectives, for contrast.

``model_state()`` counts what persists between steps on one rank, the same way for every contender: parameters as
stored between steps (FSDP2: its fp32 shards; ZeroRedundancyOptimizer: full fp32 params), their gradients after the
step, optimizer state, and the communication buffers the recipe keeps (DDP's gradient buckets). The transient
full parameters of a ZeRO-3 (FSDP2's unsharded params and all-gather buffers, the naive gathers) are not persistent:
they are reported apart as ``window_peak``, the most bytes of them alive at once, sampled (FSDP2) at every module's
forward pre/post hook and backward pre/post hook during one step (not inside a collective's copy-out).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from gpt_model import GPT, GPTConfig
from naive_zero3 import NaiveZero3

PEERS = ("fsdp2", "fsdp2_keep", "fsdp2_fp32", "zero_redundancy", "naive_zero3")
LABELS = {
    "fsdp2": "FSDP2 fully_shard (per block + root), bf16 params / fp32 reduce, AdamW(fused)",
    "fsdp2_keep": "FSDP2 fully_shard, reshard_after_forward=False, bf16 params / fp32 reduce, AdamW(fused)",
    "fsdp2_fp32": "FSDP2 fully_shard (per block + root), fp32, AdamW(fused)",
    "zero_redundancy": "DDP + ZeroRedundancyOptimizer(AdamW fused), fp32 params, bf16 autocast",
    "naive_zero3": "naive per-parameter ZeRO-3 (blocking, no buckets/prefetch), bf16 gathers, AdamW(fused)",
}


def _nbytes(t) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _model(cfg, model_cfg: GPTConfig, device: torch.device) -> torch.nn.Module:
    """The same starting weights as harness.build: fp32 init from the seed, rounded to bf16, kept in fp32."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model.to(device)


class FSDPWindow:
    """Bytes of FSDP2's unsharded parameters and all-gather buffers alive, sampled at module hooks while attached."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.groups = [g for m in model.modules() if isinstance(m, FSDPModule)
                       for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]  # fmt: skip
        self.peak, self.handles = 0, []
        for m in model.modules():
            sample = lambda *_: self.sample()  # noqa: E731
            self.handles += [m.register_forward_pre_hook(sample), m.register_forward_hook(sample)]
            self.handles += [m.register_full_backward_pre_hook(sample), m.register_full_backward_hook(sample)]

    def sample(self) -> None:
        storages = {}
        for g in self.groups:
            tensors = [t for fp in g.fsdp_params for t in fp.all_gather_outputs]
            for res in (g._all_gather_result, getattr(getattr(g, "comm_ctx", None), "all_gather_state", None)):
                res = getattr(res, "all_gather_result", res)
                if res is not None:
                    tensors.append(res.all_gather_output)
            for t in tensors:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        self.peak = max(self.peak, sum(storages.values()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Peer:
    """One peer recipe, built once; ``step`` runs forward (bf16 autocast, but fsdp2_fp32), backward, clip and the
    optimizer step."""

    def __init__(self, name: str, cfg, model_cfg: GPTConfig, device: torch.device):
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; expected one of {PEERS}")
        self.name, self.cfg, self.device = name, cfg, device
        hyper = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.model = model = _model(cfg, model_cfg, device)
        self.net, self.naive, self.window = model, None, None
        self.call = None  # forward's callable instead of net (torch.compile(net))
        if name.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            fp32 = name == "fsdp2_fp32"
            mp = MixedPrecisionPolicy() if fp32 else MixedPrecisionPolicy(torch.bfloat16, torch.float32)
            keep = dict(reshard_after_forward=name != "fsdp2_keep")
            for block in model.blocks:
                fully_shard(block, mp_policy=mp, **keep)
            fully_shard(model, mp_policy=mp, **keep)
            self.opt = torch.optim.AdamW(model.parameters(), **hyper, fused=True)
        elif name == "zero_redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            ids = [device] if device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            self.opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hyper,
                                               fused=True)  # fmt: skip
        else:
            self.naive = self.opt = NaiveZero3(model, **hyper, max_grad_norm=cfg.max_grad_norm)

    def step(self, x, y, measure: bool = False) -> tuple[torch.Tensor, dict | None]:
        """One training step: its loss and, with ``measure``, this rank's model state after the optimizer step."""
        # Full backward hooks on modules whose inputs need no gradient (the embedding) warn: expected, said once here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        if measure and self.name.startswith("fsdp2"):
            self.window = FSDPWindow(self.model)  # attached for this step only (sampling costs time)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.name != "fsdp2_fp32"):
            loss = (self.net if self.call is None else self.call)(x, y)
        loss.backward()
        if self.naive is None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        led = self.model_state() if measure else None
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), led

    def model_state(self) -> dict[str, Any]:
        if self.naive is not None:
            return self.naive.model_state()
        params = list(self.model.parameters())
        if isinstance(self.opt, torch.optim.Optimizer) and not hasattr(self.opt, "optim"):
            states = [self.opt.state[p] for p in params if p in self.opt.state]
        else:  # ZeroRedundancyOptimizer: the local optimizer holds this rank's partition
            states = list(self.opt.optim.state.values())
        parts = {
            "params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params),
            "exp_avg": sum(_nbytes(s["exp_avg"]) for s in states),
            "exp_avg_sq": sum(_nbytes(s["exp_avg_sq"]) for s in states),
            "step": sum(_nbytes(s["step"]) for s in states if isinstance(s.get("step"), torch.Tensor)),
        }
        if self.net is not self.model:  # DDP's gradient buckets (gradient_as_bucket_view=False: a copy)
            sizes = str(self.net._get_ddp_logging_data().get("bucket_sizes", ""))
            parts["ddp_buckets"] = 0 if self.net.gradient_as_bucket_view else sum(int(b) for b in sizes.split(",") if b)
        out: dict[str, Any] = {"allocated": parts, "total": sum(parts.values())}
        if self.window is not None:
            out["window_peak"] = self.window.peak
            self.window.remove()
            self.window = None
        return out
