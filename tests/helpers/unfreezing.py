"""The documented path of unfreezing, for the add_param_group tests: a model with its first block frozen, the
optimizer built from the trainable parameters, the block unfrozen and added with lr/10; and an unsharded reference
of the engine's own kernel that the engine must equal bitwise."""

import torch
from engine_reference import offload_kwargs, rank_grads
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, ops

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WINDOW = 3 * 14 * 1024 * 2  # test_offload's smallest nvme window


def frozen_start(dtype, stage, rank, world, offload=None, root=None, tag="run", defer=False, **kw):
    """The documented path's start: block 0 frozen, the optimizer built from the trainable parameters only."""
    model = build(dtype)
    model.blocks[0].requires_grad_(False)
    if defer:
        kw["defer_all_gather_to"] = model
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    extra = offload_kwargs(offload, root, rank, tag, WINDOW) if offload else {}
    opt = ZeroAdamW(trainable, **HYPER, stage=stage, bucket_size=BUCKET, module=model, **extra, **kw)
    return model, opt


def unfreeze(model, opt):
    model.blocks[0].requires_grad_(True)
    opt.add_param_group({"params": model.blocks[0].parameters(), "lr": HYPER["lr"] / 10})


class KernelReference:
    """Unsharded, bitwise: every trainable parameter's fp32 master and moments and its own step count, updated one
    parameter at a time by the engine's kernel (``zero_ext.ops.fused_adamw_``) from the fp32 mean of the ranks'
    gradients (sum in rank order / N: exact on gloo), each with its param group's lr; ``model`` holds the masters
    rounded to the parameter dtype (its gradients are the ones the engine's ranks compute)."""

    def __init__(self, dtype):
        self.model = build(dtype)
        self.model.requires_grad_(False)
        self.named = dict(self.model.named_parameters())
        self.state: dict[str, list] = {}
        self.lr: dict[str, float] = {}

    def add_group(self, names, lr):
        for n in names:
            self.named[n].requires_grad_(True)
            self.state[n] = [self.named[n].detach().float().reshape(-1).clone(), None, None, 0]
            self.state[n][1:3] = [torch.zeros_like(self.state[n][0]), torch.zeros_like(self.state[n][0])]
            self.lr[n] = lr

    def step(self, batches):
        names = list(self.state)
        params = [self.named[n] for n in names]
        per_rank = rank_grads(self.model, params, batches, loss_fn)
        for i, n in enumerate(names):
            mean = sum(g[i].float() for g in per_rank) / len(per_rank)
            s = self.state[n]
            s[3] += 1
            beta1, beta2 = HYPER["betas"]
            ops.fused_adamw_(s[0], mean.reshape(-1).contiguous(), s[1], s[2], lr=self.lr[n], beta1=beta1, beta2=beta2,
                             eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], step=s[3])  # fmt: skip
            with torch.no_grad():
                self.named[n].copy_(s[0].view(self.named[n].shape))

    def check(self, opt, model):
        for (name, p), (_, ref) in zip(model.named_parameters(), self.model.named_parameters()):
            assert torch.equal(p.detach(), ref.detach()), f"{name}: {int((p.detach() != ref.detach()).sum())} differ"
        kinds = ("master", "exp_avg", "exp_avg_sq")
        steps = {e["name"]: e["step"] for e in param_steps(opt)}
        for ref in opt.sharded_state.pieces():
            full = self.state[ref.name]
            for i, kind in enumerate(kinds):
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                assert torch.equal(mine, full[i][ref.piece.start : ref.piece.end]), f"{ref.name} {kind}"
            assert steps[ref.name] == full[3], f"{ref.name} step {steps[ref.name]} != {full[3]}"


def param_steps(opt):
    state = opt.sharded_state
    counts = state.step_counts.values()
    return [{"name": state.names[gidx], "step": counts[gidx]} for _, gidx, _ in state.members()]


def block0(model):
    return [n for n, _ in model.named_parameters() if n.startswith("blocks.0.")]


def world_batches(step, world):
    return [batch(step, r) for r in range(world)]


def train(model, opt, kref, step, rank, world):
    kref.step(world_batches(step, world))
    loss_fn(model, batch(step, rank)).backward()
    opt.step()
    opt.zero_grad()
