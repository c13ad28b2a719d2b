"""Bad DCP checkpoints into a ZeroAdamW: another model (keys missing, extra, another shape), another optimizer's
state (FSDP2 + torch.optim.SGD), a half-written directory (no .metadata) and a damaged data file. Through the plain
torchtitan path (get_state_dict, dcp.load, set_state_dict) and the strict zero_ext.checkpoint.load_dcp: an error on
every rank naming the key, the model and optimizer bitwise as they were, never a hang; on 2 and 3 gloo ranks."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_runs import fsdp_mesh, model_for, zero_full, zero_load, zero_optimizer, zero_save, zero_steps
from distributed import run_on_ranks
from gpt_model import GPT, GPTConfig
from tiny_transformer import DIM, HEADS, SEQ, VOCAB, build
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.fsdp import fully_shard

import zero_ext.checkpoint as zc
from zero_ext.checkpoint.dcp_chunks import FlatPieces


def _snapshot(model, opt):
    """Everything the optimizer and model hold, whole and per rank: full parameters and every state piece."""
    msd, osd = zc.get_state_dict(model, opt)
    pieces = {k: v.flat_values.clone() for k, v in msd.items() if isinstance(v, FlatPieces)}
    for fqn, entry in osd["state"].items():
        pieces.update({f"{fqn}.{k}": getattr(v, "flat_values", v).clone() for k, v in entry.items()})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return zero_full(model, opt), pieces, groups


def _same(a, b) -> bool:
    full_a, pieces_a, groups_a = a
    full_b, pieces_b, groups_b = b
    return (all(torch.equal(full_a[k], full_b[k]) for k in full_a) and groups_a == groups_b
            and all(torch.equal(pieces_a[k], pieces_b[k]) for k in pieces_a))  # fmt: skip


def _save_other(model, root: str, name: str) -> None:
    model.blocks[0].ln1.weight.requires_grad_(False)  # as model_for freezes it: only what the case changes differs
    opt = zero_optimizer(model, 2)
    zero_steps(model, opt, 0, 1)
    zero_save(model, opt, f"{root}/{name}")


def _write_checkpoints(root: str, rank: int) -> None:
    _save_other(model_for(torch.float32), root, "good")
    _save_other(build(torch.float32, blocks=1), root, "smaller")  # blocks.1.* missing from it
    _save_other(build(torch.float32, blocks=3), root, "larger")  # blocks.2.* extra
    torch.manual_seed(0)
    _save_other(GPT(GPTConfig(VOCAB, SEQ, DIM, 2, HEADS, mlp_hidden=4 * DIM - 5)), root, "reshaped")
    model = build(torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh())
    fully_shard(model, mesh=fsdp_mesh())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    msd, osd = torch_get_state_dict(model, sgd)  # torch initialises SGD's momentum_buffer
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/sgd")
    if rank == 0:
        shutil.copytree(f"{root}/good", f"{root}/half")
        os.remove(f"{root}/half/.metadata")  # a save that died before its metadata
        shutil.copytree(f"{root}/good", f"{root}/damaged")
        data = sorted(f for f in os.listdir(f"{root}/damaged") if f.endswith(".distcp"))[0]
        with open(f"{root}/damaged/{data}", "r+b") as f:
            f.truncate(os.path.getsize(f"{root}/damaged/{data}") // 2)
    dist.barrier()


# checkpoint -> (what the plain path's error says, what load_dcp's says). The plain path: DCP reads only the keys it is
# given and ignores the checkpoint's others, and set_state_dict sees the extra parameters in the saved param groups.
CASES = {
    "smaller": ("blocks.1.", "blocks.1."),
    "larger": ("blocks.2.", "blocks.2."),
    "reshaped": ("Size mismatch", "has shape"),
    "sgd": ("Missing key in checkpoint state_dict: optim.state.", "momentum_buffer"),
    "half": (".metadata", "no .metadata"),
    "damaged": ("", ""),
}


def _bad_inputs(rank, world, root):
    _write_checkpoints(root, rank)
    model = model_for(torch.float32)
    opt = zero_optimizer(model, 3)
    zero_steps(model, opt, 0, 2)
    before = _snapshot(model, opt)
    seen = {}
    for name in CASES:
        for way, load in (("plain", zero_load), ("strict", lambda m, o, p: zc.load_dcp(p, m, o))):
            try:
                load(model, opt, f"{root}/{name}")
                seen[(name, way)] = None
            except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
                seen[(name, way)] = f"{type(e).__name__}: {e}"
            assert _same(before, _snapshot(model, opt)), (name, way)
    # the dict torch gives for SGD, straight into set_state_dict: another optimizer, named
    model2 = model_for(torch.float32)
    sgd = torch.optim.SGD([p for p in model2.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    msd, osd = torch_get_state_dict(model2, sgd)
    try:
        zc.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        seen["sgd dict"] = None
    except Exception as e:  # noqa: BLE001
        seen["sgd dict"] = str(e)
    assert _same(before, _snapshot(model, opt))
    zero_load(model, opt, f"{root}/good")  # and a good one still loads afterwards
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_bad_checkpoints_fail_on_every_rank_and_change_nothing(tmp_path, world):
    results = run_on_ranks(world, _bad_inputs, str(tmp_path))
    for rank, seen in enumerate(results):
        for name, (plain, strict) in CASES.items():
            for way, want in (("plain", plain), ("strict", strict)):
                got = seen[(name, way)]
                assert got is not None and want in got, f"rank {rank}, {name} ({way}): {got}"
        assert "momentum_buffer" in seen["sgd dict"] and "exp_avg" in seen["sgd dict"], seen["sgd dict"]
