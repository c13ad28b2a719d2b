"""What the DCP round-trip tests share: the tiny GPT (tied weights, a frozen parameter, two param groups) trained by
ZeroAdamW or by FSDP2 (``fully_shard`` on a CPU mesh) + torch.optim.AdamW with the same gradients, and the three ways
of loading a DCP checkpoint into each.

Gradients are assigned by hand, the same on every rank: ``sign * 2**k`` per element. Their mean over 1, 2 or 3 ranks is
exact whatever the order of the sum and the place of the 1/N (2**k * 3 * fl(1/3) rounds back to 2**k), so a run that
moves between world sizes, stages and meshes meets exactly the gradients of the uninterrupted run and must end bitwise
equal to it; FSDP2 needs no reduction at all (each rank is given its shard of the same tensor)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mesh_runs import make_mesh, model_for, param_groups
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import zero_ext.checkpoint as zc
from zero_ext import ZeroAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 700  # several buckets, parameters split across them, uneven shards


def grad_for(name: str, shape, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * step + sum(map(ord, name)) * 31 + len(name))
    exponent = torch.randint(-6, 3, shape, generator=gen).float()
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return sign * torch.pow(2.0, exponent)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def zero_optimizer(model, stage: int, mesh_shape=None, **kw):
    return ZeroAdamW(param_groups(model), **HYPER, stage=stage, module=model, bucket_size=BUCKET,
                     mesh=make_mesh(mesh_shape), **kw)  # fmt: skip


def zero_steps(model, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        for name, p in trainable(model):
            p.grad = grad_for(name, p.shape, step).to(p.dtype)
        opt.step()
        opt.zero_grad()


def zero_full(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its first name (as model.named_parameters() gives them)."""
    names = {n for n, _ in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in opt.named_full_params(model) if n in names}


_MESH: dict = {}


def fsdp_mesh():
    world = dist.get_world_size()
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


def fsdp_model():
    """The same model under FSDP2 (each block, then the root: the tied embedding/head in the root's group) and
    torch.optim.AdamW with the same param groups."""
    model = model_for(torch.float32)
    mesh = fsdp_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(param_groups(model), **HYPER)


def fsdp_steps(model, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        for name, p in trainable(model):
            p.grad = distribute_tensor(grad_for(name, p.shape, step), p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()


def fsdp_full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def reference_run(steps: int) -> dict[str, torch.Tensor]:
    """The unsharded torch.optim.AdamW run with the same gradients: every parameter after ``steps`` steps."""
    model = model_for(torch.float32)
    opt = torch.optim.AdamW(param_groups(model), **HYPER)
    for step in range(steps):
        for name, p in trainable(model):
            p.grad = grad_for(name, p.shape, step)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_GROUP: dict = {}


def checkpoint_group():
    """A gloo group for dcp.async_save's own collectives (torchtitan's habit): its thread must not share a group with
    the training collectives running meanwhile, whose order it would interleave. Made once per worker."""
    world = dist.get_world_size()
    if world not in _GROUP:
        _GROUP[world] = dist.new_group(backend="gloo")
    return _GROUP[world]


# ---------------------------------------------------------------- saving and loading, each side's way
def zero_save(model, opt, path: str, use_async: bool = False) -> None:
    msd, osd = zc.get_state_dict(model, opt)
    if use_async:
        dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=checkpoint_group()).result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def zero_load(model, opt, path: str) -> None:
    msd, osd = zc.get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    zc.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def save_or_resave(model, opt, root: str, name: str, source, saved_at: int) -> None:
    """The precision round trip's two halves: ``source`` None, train ``saved_at`` steps and save as ``name``; else
    load ``source`` and save again at once as ``<source>-into-<name>`` (what the setting ``name`` holds of it)."""
    if source is None:
        zero_steps(model, opt, 0, saved_at)
        zero_save(model, opt, f"{root}/{name}")
    else:
        zero_load(model, opt, f"{root}/{source}")
        zero_save(model, opt, f"{root}/{source}-into-{name}")


def fsdp_save(model, opt, path: str) -> None:
    msd, osd = torch_get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def fsdp_load(model, opt, path: str) -> None:
    msd, osd = torch_get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    torch_set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def read_whole(path: str) -> dict:
    """A DCP checkpoint read whole in this process by torch's own converter (dcp_to_torch_save), flattened to DCP's
    keys (``model.<fqn>``, ``optim.state.<fqn>.<kind>``, ...)."""
    import os
    import tempfile

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "whole.pt"))
        whole = torch.load(os.path.join(tmp, "whole.pt"), weights_only=False)
    flat, _ = flatten_state_dict(whole)
    assert any(k.startswith("model.") for k in flat), f"{path}: nothing read"
    return flat


# ---------------------------------------------------------------- one run per setting, saved on 2 ranks, resumed on 3
def setting_kwargs(setting, root: str, rank: int, tag: str) -> dict:
    """The optimizer keywords of ``setting`` = (offload, mesh shape or None, stage, replicate_state) other than the
    stage and the mesh: nvme state in a directory of its own per rank and run ``tag``."""
    from engine_reference import offload_kwargs

    offload, shape, _, replicated = setting
    extra = offload_kwargs(offload, root, rank, tag, 3 * 12 * 4096) if offload != "none" else {}
    if shape is not None:
        extra["replicate_state"] = replicated
    return extra


def _save_each(rank, world, root, settings, build, saved_at, stop):
    finals = {}
    for i, setting in enumerate(settings):
        model, opt = build(setting, root, rank, f"save-w{world}-{i}")
        zero_steps(model, opt, 0, saved_at)
        zero_save(model, opt, f"{root}/w{world}-{i}")
        zero_steps(model, opt, saved_at, stop)
        finals[f"w{world}-{i}"] = zero_full(model, opt)
        opt.close()
    return finals


def _resume_each(rank, world, root, settings, sources, build, saved_at, stop):
    out = {}
    for i, setting in enumerate(settings):
        for source in sources:
            model, opt = build(setting, root, rank, f"load-w{world}-{i}-{source}")
            zero_load(model, opt, f"{root}/{source}")
            zero_steps(model, opt, saved_at, stop)
            out[(source, i)] = zero_full(model, opt)
            opt.close()
    return out


def check_settings_across_world_sizes(root: str, at_2: list, at_3: list, build, saved_at: int, stop: int) -> None:
    """Each setting of ``at_2`` (on 2 ranks) and ``at_3`` (on 3) trains ``stop`` steps saving at ``saved_at``; every
    uninterrupted run ends bitwise the same, and every checkpoint of one world size resumed under every setting of
    the other ends bitwise the same too. ``build(setting, root, rank, tag) -> (model, optimizer)``, module-level."""
    from distributed import run_on_ranks

    args = (build, saved_at, stop)
    finals = {**run_on_ranks(2, _save_each, root, at_2, *args)[0], **run_on_ranks(3, _save_each, root, at_3, *args)[0]}
    first = next(iter(finals.values()))
    for name, params in finals.items():  # the uninterrupted runs: one result whatever the setting
        for key, value in params.items():
            assert torch.equal(value, first[key]), f"uninterrupted {name}: {key}"
    for world, settings, sources in (
        (3, at_3, [f"w2-{i}" for i in range(len(at_2))]),
        (2, at_2, [f"w3-{i}" for i in range(len(at_3))]),
    ):
        for (source, i), params in run_on_ranks(world, _resume_each, root, settings, sources, *args)[0].items():
            for key, value in params.items():
                assert torch.equal(value, first[key]), f"{source} -> {settings[i]} on {world} ranks: {key}"
