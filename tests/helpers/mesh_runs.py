"""What the HSDP tests share: a 2-D mesh over the gloo ranks of run_on_ranks, and a short training run of the tiny
GPT (tied weights, a frozen parameter, two param groups) on it, checked against the unsharded AdamW reference fed the
mean of every rank's gradients."""

from __future__ import annotations

import torch
from engine_reference import offload_kwargs, params_digest, rank_grads
from tiny_transformer import batch, build, loss_fn
from torch.distributed.device_mesh import init_device_mesh

from zero_ext import ZeroAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
WINDOW = 3 * 12 * 4096


_MESHES: dict = {}


def make_mesh(shape):
    """``shape`` (R, S): the ("replicate", "shard") mesh; None: the 1-D layout. One mesh per shape and worker
    process: every init_device_mesh makes new process groups, whose gloo threads (hundreds after a few dozen tests)
    stay alive for the pool's life and slow every later test."""
    if shape is None:
        return None
    key = tuple(shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def model_for(dtype):
    model = build(dtype)
    model.blocks[0].ln1.weight.requires_grad_(False)  # a frozen parameter
    return model


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


def tree_mean(grads, shape):
    """The mean a ``shape`` (R, S) mesh computes, in its order: each shard group's (row r of the mesh: global ranks
    r*S .. r*S+S-1) fp32 sum in rank order divided by S, then the replicas' sum in order divided by R. None (1-D):
    every rank's sum in rank order divided by N, the reference's own mean."""
    if shape is None:
        return sum(grads[1:], grads[0]) / len(grads)
    R, S = shape
    rows = [grads[r * S : (r + 1) * S] for r in range(R)]
    partial = [sum(row[1:], row[0]) / S for row in rows]
    return sum(partial[1:], partial[0]) / R


def optimizer(model, shape, stage, offload="none", root=None, rank=0, tag="", **kw):
    extra = offload_kwargs(offload, root, rank, tag, WINDOW) if offload != "none" else {}
    mesh = kw.pop("mesh", make_mesh(shape))
    return ZeroAdamW(param_groups(model), **HYPER, stage=stage, module=model, bucket_size=1500, mesh=mesh,
                     **extra, **kw)  # fmt: skip


class GroupedFusedReference:
    """The unsharded run with the engine's own kernel (``zero_ext.ops.fused_adamw_``), parameter by parameter in the
    optimizer's order, each with its param group's hyperparameters, fed :func:`tree_mean` gradients: the engine on a
    mesh must equal it bitwise (the kernel is element-wise; only the mean's summation tree can differ, and it is
    the mesh's)."""

    def __init__(self, model):
        self.params = []  # (name, shape, dtype, hyper) in the optimizer's order
        names = {id(p): n for n, p in model.named_parameters()}
        for g in param_groups(model):
            hyper = {**HYPER, **{k: v for k, v in g.items() if k != "params"}}
            for p in g["params"]:
                self.params.append((names[id(p)], p.shape, p.dtype, hyper))
        by_name = dict(model.named_parameters())
        self.master = [by_name[n].detach().float().clone().reshape(-1) for n, *_ in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.steps = 0

    def load_into(self, model) -> None:
        by_name = dict(model.named_parameters())
        with torch.no_grad():
            for (name, shape, dtype, _), m in zip(self.params, self.master):
                by_name[name].copy_(m.view(shape).to(dtype))

    def step(self, means: dict) -> None:
        from zero_ext import ops

        self.steps += 1
        for (name, _, _, h), m, a, v in zip(self.params, self.master, self.exp_avg, self.exp_avg_sq):
            g = means[name].reshape(-1).float().contiguous()
            ops.fused_adamw_(m, g, a, v, lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                             weight_decay=h["weight_decay"], step=self.steps)  # fmt: skip

    def check(self, opt, model, what: str, exact: bool = True) -> None:
        """Bitwise; or, with ``exact=False``, at 2 % of one update (lr 1e-2): where the mean's last summation is
        gloo's own all-reduce (``replicate_state`` with 3+ replicas), whose association is not rank order, so an
        element whose mean gradient is ~0 may move by a fraction of an update (Adam divides it by itself)."""

        def same(a, b, msg):
            if exact:
                assert torch.equal(a, b), f"{msg}: {int((a != b).sum())} elements differ"
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=2e-4, msg=msg)

        by_name = dict(model.named_parameters())
        for (name, shape, dtype, _), m in zip(self.params, self.master):
            same(by_name[name].detach().cpu(), m.view(shape).to(dtype), f"{what}: {name}")
        kinds = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        for ref in opt.sharded_state.pieces():
            for kind, full in kinds.items():
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                expected = full[ref.param_index][ref.piece.start : ref.piece.end]
                same(mine, expected, f"{what}: {ref.name} {kind}")


def flat_on_gloo(shape, dtype, replicate_state: bool = False) -> bool:
    """Whether ZeroAdamW's mesh on gloo reduce-scatters ``dtype`` gradients (summed in fp32) once over every rank:
    state over every rank, ``R, S > 1`` and ``itemsize x S <= 4`` (``MeshCommunicator.flat_reduce_scatter``)."""
    if shape is None or replicate_state:
        return False
    R, S = shape
    return R > 1 and S > 1 and dtype.itemsize * S <= 4


def tree_means(ref: GroupedFusedReference, step: int, world: int, shape, dtype, replicate_state=False) -> dict:
    """The mesh's mean gradients at ``step`` (every rank's batch) for a model holding the reference's parameters: its
    tree (:func:`tree_mean`), or the 1-D mean where the mesh reduce-scatters once over every rank."""
    model = model_for(dtype)
    ref.load_into(model)
    named = [(n, p) for n, p in model.named_parameters()]
    grads = rank_grads(model, [p for _, p in named], [batch(step, r) for r in range(world)], loss_fn)
    out = {}
    for i, (name, p) in enumerate(named):
        if p.requires_grad:
            flat = flat_on_gloo(shape, dtype, replicate_state)
            out[name] = tree_mean([g[i].float() for g in grads], None if flat else shape)
    return out


def train_against_reference(rank, world, shape, stage, offload="none", dtype_name="float32", root=None, steps=3,
                            **kw):  # fmt: skip
    """``steps`` steps on ``shape``'s mesh (None: 1-D), each checked bitwise against the kernel's unsharded run on
    the mesh's mean gradients; returns (params digest, this rank's comm_stats(), state digest)."""
    dtype = getattr(torch, dtype_name)
    model = model_for(dtype)
    opt = optimizer(model, shape, stage, offload, root, rank, f"m{stage}", **kw)
    ref = GroupedFusedReference(model_for(dtype))
    for step in range(steps):
        ref.step(tree_means(ref, step, world, shape, dtype, kw.get("replicate_state", False)))
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            exact = not (kw.get("replicate_state") and shape[0] > 2)  # gloo's all-reduce order (check())
            ref.check(opt, model, f"mesh {shape} stage {stage} offload {offload} step {step}", exact)
    with opt.gathered_params():
        digest = params_digest(model)
    stats = opt.comm_stats()
    opt.close()
    return digest, stats


__all__ = ["make_mesh", "model_for", "optimizer", "train_against_reference", "batch", "loss_fn"]


def train_steps(model, opt, rank: int, steps: int, start: int = 0) -> None:
    """``steps`` plain steps of this rank's batches (``start`` onwards): backward, step, zero_grad, nothing read."""
    for step in range(start, start + steps):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def full_copies(model, opt) -> list:
    """Copies of the model's full parameters (gathered at stage 3), then the optimizer closed."""
    with opt.gathered_params():
        out = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return out


def train_kw(rank, world, shape, stage, kw):
    """:func:`train_against_reference` with keyword options (run_on_ranks passes positional arguments only)."""
    return train_against_reference(rank, world, shape, stage, **kw)
