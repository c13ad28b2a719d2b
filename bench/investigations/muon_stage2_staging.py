"""ZeroMuon's stage 2 held more model state than its stage 1 in the main job (bench/results/main_job_epyc.md: 45.19
against 37.03 MiB/rank): its staging pool grew to 7 entries. This measures the two ZeroMuon rows' memory the way
bench/main_job.py does (harness.build at the main job's size and defaults, bf16 params, bf16 autocast, 2 gloo
ranks, ``memory_report()`` after the first steps), plus the pool's entry count and what its buffers really hold
(the bytes of the storages of the pool's tensors, distinct storages counted once), and the peak resident anonymous
memory over the run (main_job's own measure, noisy at this size). The "before" file ran the same script on
505fa10's zero_ext (``PYTHONPATH=<a checkout of 505fa10, with the built ops/_C*.so copied in>``).

    python bench/investigations/muon_stage2_staging.py --name muon_stage2_staging_after
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import zero_ext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpt_model import GPTConfig  # noqa: E402
from harness import MIB, RunConfig, build, forward_backward, launch  # noqa: E402
from main_job import PeakMemory, warm_up  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _run(rank, world, device, recipe, steps):
    import torch.distributed as dist

    torch.manual_seed(0)
    cfg = RunConfig(recipe=recipe, steps=steps)
    model_cfg = GPTConfig()
    warm_up(cfg, device)
    peak = PeakMemory(device)
    model, net, opt = build(cfg, model_cfg, device)
    per_rank = cfg.global_batch // world
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randint(0, model_cfg.vocab, (per_rank, model_cfg.seq_len + 1), generator=g)
        forward_backward(cfg, model, net, x[:, :-1], x[:, 1:], device)
        opt.step()
        opt.zero_grad()
    peak_bytes = peak.stop()
    report = opt.memory_report()
    pool = opt._engine.runtimes.staging  # (an investigation: the pool itself, to count its entries)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pool.tensors()}
    out = dict(
        recipe=recipe,
        total_mib=report.total / MIB,
        staging_mib=report.staging / MIB,
        entries=len(pool.entries),
        entry_mib=pool.entries[0].nbytes / MIB if pool.entries else 0.0,
        staging_storages_mib=sum(storages.values()) / MIB,
        buckets=[len(g.layout.buckets) for g in opt.sharded_state.groups],
        peak_mib=peak_bytes / MIB,
        peak_measure=peak.label,
        allocated={k: v / MIB for k, v in report.allocated.items()},
    )
    opt.close()
    dist.barrier()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--name", default="muon_stage2_staging")
    args = p.parse_args()
    rows = [launch(_run, 2, "cpu", recipe, args.steps) for recipe in ("muon1", "muon2")]
    lines = [f"# {args.name}", "", f"command: `python bench/investigations/muon_stage2_staging.py --name {args.name}`",
             f"zero_ext from {Path(zero_ext.__file__).parent} at commit "
             f"{os.popen(f'git -C {Path(zero_ext.__file__).parent} rev-parse --short HEAD').read().strip()}, torch {torch.__version__}, 2 gloo ranks,"
             f" main job GPT (GPTConfig()), {args.steps} steps, rank 0", "",
             "| recipe | model state MiB/rank (memory_report().total) | staging MiB | entries x MiB | staging storages MiB "
             "| buckets per flat group | peak MiB/rank |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['total_mib']:.2f} | {r['staging_mib']:.2f} | {r['entries']} x "
                     f"{r['entry_mib']:.2f} | {r['staging_storages_mib']:.2f} | {r['buckets']} | {r['peak_mib']:.1f} |")  # fmt: skip
    lines += [
        "",
        f"peak = {rows[0]['peak_measure']} (main_job's measure; activations dominate it at this size, and a "
        "peak shorter than the sampling interval can be missed)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
