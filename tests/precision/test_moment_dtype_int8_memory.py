"""``moment_dtype=torch.int8`` keeps 1 byte per moment and element plus one fp32 scale per 64 elements (1.0625 bytes
instead of 4): measured on what is alive (the garbage collector's CPU storages) and on the state files' real sizes,
and ``memory_report()`` agrees with both to the byte."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import live_storage_bytes, offload_kwargs
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

BUCKET = 1500
WINDOW = 3 * 8 * 4096
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _memory(rank, world, stage, offload, root):
    grown, reports, files = {}, {}, {}
    for dtype in (torch.float32, torch.int8):
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
        if dtype == torch.int8:  # elements of this rank's shards that keep each moment
            kept = {m: [g.layout.shard_numel for g in opt.sharded_state.groups if m in g.rule.kind_names]
                    for m in MOMENTS}  # fmt: skip
        if offload == "nvme":
            directory = kw["offload_dir"]
            files[dtype] = {f: os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs}
        opt.close()
        del opt
    r = reports[torch.int8]
    identity = r.formula + r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers - r.param_shard_not_kept
    assert r.total + sum(r.on_disk.values()) == identity, str(r)
    assert r.widths["optimizer_state_bytes"] == 4 + 3 * 1.0625, r.widths  # the last group's: master + 3 moments
    held = {**r.allocated, **r.on_disk}
    for m, ns in kept.items():  # one byte per element, and an fp32 scale per 64 (shards are whole blocks)
        codes = sum(ns) if offload != "nvme" else sum(-(-n // 4096) * 4096 for n in ns)  # files: whole 4 KiB blocks
        assert held[m] == codes, (m, held[m], ns)
        assert held[m + "_scale"] == sum(ns) // 64 * 4, (m, held[m + "_scale"], ns)
        assert r.where[m + "_scale"] == ("host" if offload else "device"), m
    ledger = reports[torch.float32].total - reports[torch.int8].total
    on_disk = {d: sum(reports[d].on_disk.values()) for d in reports}
    return grown[torch.float32] - grown[torch.int8], ledger, kept, files, on_disk


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu")])
def test_memory_saved(tmp_path, stage, offload):
    """Live storages shrink by what the ledger says, to the byte, and the ledger's moments are int8 codes and fp32
    block scales (in ``_memory``). The layouts differ (int8 groups align parameters to 64 elements, so this tiny
    model's shards hold more padding, in every kind): the totals are compared, not the moments alone."""
    live, ledger, kept, _, _ = run_on_ranks(2, _memory, stage, offload, str(tmp_path))[0]
    assert live == ledger > 0, (live, ledger)


def test_nvme_files_shrink(tmp_path):
    """offload="nvme": the moments' files are int8 codes (a quarter of the bytes, on disk), the master's fp32; the
    scales stay in host memory; the live host memory changes as the ledger says."""
    live, ledger, kept, files, on_disk = run_on_ranks(2, _memory, 2, "nvme", str(tmp_path))[0]
    assert any(f.endswith(".exp_avg.i8") for f in files[torch.int8]), files
    assert any(f.endswith(".master.f32") for f in files[torch.int8]), files
    assert not any("scale" in f for f in files[torch.int8]), files
    for d in files:  # the files' real sizes are the ledger's (each moment file: whole 4 KiB blocks of 1-byte codes)
        assert sum(files[d].values()) == on_disk[d], (d, files[d], on_disk[d])
    codes = {f: v for f, v in files[torch.int8].items() if f.endswith(".i8")}
    assert sum(codes.values()) == sum(-(-n // 4096) * 4096 for ns in kept.values() for n in ns), (codes, kept)
    assert live == ledger, (live, ledger)
