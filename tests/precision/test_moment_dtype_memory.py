"""Low-precision moments keep fewer bytes per moment and element than fp32's 4: ``moment_dtype=torch.bfloat16`` 2,
``moment_dtype=torch.int8`` 1.0625 (1 byte plus one fp32 scale per 64 elements). Measured on what is alive (the
garbage collector's CPU storages) and on the state files' real sizes, and ``memory_report()`` agrees with both to the
byte."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import LiveStorages, offload_kwargs
from moment_dtypes import MOMENT_DTYPES
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW

BUCKET = 1500
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
DTYPES = list(MOMENT_DTYPES)


def _int8_ledger(r, kept, offload) -> None:
    """int8 moments in the ledger: one byte per element, and an fp32 scale per 64 (shards are whole blocks)."""
    held = {**r.allocated, **r.on_disk}
    for m, ns in kept.items():
        codes = sum(ns) if offload != "nvme" else sum(-(-n // 4096) * 4096 for n in ns)  # files: whole 4 KiB blocks
        assert held[m] == codes, (m, held[m], ns)
        assert held[m + "_scale"] == sum(ns) // 64 * 4, (m, held[m + "_scale"], ns)
        assert r.where[m + "_scale"] == ("host" if offload else "device"), m


def _memory(rank, world, name, stage, offload, root):
    md = MOMENT_DTYPES[name]
    grown, reports, files = {}, {}, {}
    for dtype in (torch.float32, md.dtype):
        model = build(torch.bfloat16)
        named = list(model.named_parameters())
        groups = [{"params": [(n, p) for n, p in named if p.dim() > 1]},
                  {"params": [(n, p) for n, p in named if p.dim() <= 1], "amsgrad": True}]  # fmt: skip
        before = LiveStorages()
        kw = offload_kwargs(offload, root, rank, f"mem-{dtype}", md.window)
        opt = ZeroAdamW(groups, stage=stage, bucket_size=BUCKET, module=model, moment_dtype=dtype, **kw)
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        grown[dtype], reports[dtype] = before.born_bytes(), opt.memory_report()
        if dtype == md.dtype:  # elements of this rank's shards that keep each moment
            kept = {m: [g.layout.shard_numel for g in opt.sharded_state.groups if m in g.rule.kind_names]
                    for m in MOMENTS}  # fmt: skip
        if offload == "nvme":
            directory = kw["offload_dir"]
            files[dtype] = {f: os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs}
        opt.close()
        del opt
    r = reports[md.dtype]
    identity = r.formula + r.padding + r.staging + r.grad_shard_fp32 + r.offload_buffers - r.param_shard_not_kept
    assert r.total + sum(r.on_disk.values()) == identity, str(r)
    # the last group's: master + 3 moments
    assert r.widths["optimizer_state_bytes"] == 4 + 3 * md.moment_bytes, r.widths
    if md.dtype == torch.int8:
        _int8_ledger(r, kept, offload)
    ledger = reports[torch.float32].total - reports[md.dtype].total
    on_disk = {d: sum(reports[d].on_disk.values()) for d in reports}
    return grown[torch.float32] - grown[md.dtype], ledger, kept, files, on_disk


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu")])
@pytest.mark.parametrize("name", DTYPES)
def test_memory_saved(tmp_path, name, stage, offload):
    """Live storages shrink by what the ledger says, to the byte, in memory or in offload's host memory. bf16: by 2
    bytes per moment element of the shard. int8: the ledger's moments are int8 codes and fp32 block scales (in
    ``_memory``); the layouts differ (int8 groups align parameters to 64 elements, so this tiny model's shards hold
    more padding, in every kind): the totals are compared, not the moments alone."""
    live, ledger, kept, _, _ = run_on_ranks(2, _memory, name, stage, offload, str(tmp_path))[0]
    moments = sum(sum(ns) for ns in kept.values())
    if name == "bf16":
        assert live == ledger == 2 * moments, (live, ledger, moments)
    else:
        assert live == ledger > 0, (live, ledger)


@pytest.mark.parametrize("name", DTYPES)
def test_nvme_files_shrink(tmp_path, name):
    """offload="nvme": the moments' files are bf16 or int8 codes (half or a quarter of the bytes, on disk, not only
    in the ledger), the master's fp32; int8's scales stay in host memory; the live host memory changes as the ledger
    says (the window is a byte budget: its chunks grow instead)."""
    md = MOMENT_DTYPES[name]
    live, ledger, kept, files, on_disk = run_on_ranks(2, _memory, name, 2, "nvme", str(tmp_path))[0]
    for d in files:  # the files' real sizes are the ledger's
        assert sum(files[d].values()) == on_disk[d], (d, files[d], on_disk[d])
    assert any(f.endswith(f".exp_avg.{md.file_suffix}") for f in files[md.dtype]), files
    assert any(f.endswith(".master.f32") for f in files[md.dtype]), files
    if name == "bf16":
        # every moment file halves; the files are whole 4 KiB blocks (2048 bf16 elements), hence the slack
        moments = sum(sum(ns) for ns in kept.values())
        assert on_disk[torch.float32] - on_disk[torch.bfloat16] >= 2 * moments - 6 * 4096 > 0, (on_disk, moments)
    else:
        assert not any("scale" in f for f in files[torch.int8]), files
        # each moment file: whole 4 KiB blocks of 1-byte codes
        codes = {f: v for f, v in files[torch.int8].items() if f.endswith(".i8")}
        assert sum(codes.values()) == sum(-(-n // 4096) * 4096 for ns in kept.values() for n in ns), (codes, kept)
    assert live == ledger, (live, ledger)
