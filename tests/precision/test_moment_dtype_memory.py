"""``moment_dtype=torch.bfloat16`` keeps 2 bytes per moment and element instead of 4: measured on what is alive (the
garbage collector's CPU storages) and on the state files' real sizes, and ``memory_report()`` agrees with both."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import live_storage_bytes, offload_kwargs
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

BUCKET = 1500
WINDOW = 3 * 14 * 2048


def _memory(rank, world, stage, offload, root):
    grown, reports, moments, files = {}, {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(torch.bfloat16)
        named = list(model.named_parameters())
        groups = [{"params": [(n, p) for n, p in named if p.dim() > 1]},
                  {"params": [(n, p) for n, p in named if p.dim() <= 1], "amsgrad": True}]  # fmt: skip
        base = live_storage_bytes()
        kw = offload_kwargs(offload, root, rank, f"mem-{dtype}", WINDOW)
        opt = ZeroAdamW(groups, stage=stage, bucket_size=BUCKET, module=model, moment_dtype=dtype, **kw)
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        grown[dtype], reports[dtype] = live_storage_bytes() - base, opt.memory_report()
        # moment elements of this rank's shards: two kinds per element, three with amsgrad
        moments[dtype] = sum(g.layout.shard_numel * (len(g.rule.kinds) - 1) for g in opt.sharded_state.groups)
        if offload == "nvme":
            directory = kw["offload_dir"]
            files[dtype] = {f: os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs}
        opt.close()
        del opt
    r = reports[torch.bfloat16]
    identity = r.formula + r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers - r.param_shard_not_kept
    assert r.total + sum(r.on_disk.values()) == identity, str(r)
    assert r.widths["optimizer_state_bytes"] == 4 + 3 * 2, r.widths  # the last group's: master + 3 bf16 moments
    ledger = reports[torch.float32].total - reports[torch.bfloat16].total
    disk = [sum(reports[d].on_disk.values()) for d in (torch.float32, torch.bfloat16)]
    return grown[torch.float32] - grown[torch.bfloat16], ledger, moments[torch.bfloat16], disk, files


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu")])
def test_memory_saved(tmp_path, stage, offload):
    """2 bytes per moment element of the shard, in memory or in offload's host memory; live storages and ledger
    agree to the byte."""
    live, ledger, moments, _, _ = run_on_ranks(2, _memory, stage, offload, str(tmp_path))[0]
    assert live == ledger == 2 * moments, (live, ledger, moments)


def test_nvme_files_shrink(tmp_path):
    """offload="nvme": the moments' files are bf16 (half the bytes; on disk, not only in the ledger), the master's
    fp32; the live host memory changes as the ledger says (the window is a byte budget: its chunks grow instead)."""
    live, ledger, moments, disk, files = run_on_ranks(2, _memory, 2, "nvme", str(tmp_path))[0]
    on_disk = {d: sum(f.values()) for d, f in files.items()}
    assert on_disk[torch.float32] == disk[0] and on_disk[torch.bfloat16] == disk[1], (on_disk, disk)
    assert any(f.endswith(".exp_avg.bf16") for f in files[torch.bfloat16]), files
    assert any(f.endswith(".master.f32") for f in files[torch.bfloat16]), files
    # every moment file halves; the files are whole 4 KiB blocks (2048 bf16 elements), hence the slack
    assert disk[0] - disk[1] >= 2 * moments - 6 * 4096 > 0, (disk, moments)
    assert live == ledger, (live, ledger)
