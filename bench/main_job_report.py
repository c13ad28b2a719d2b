"""The main job's checks, table and chart, computed from what the runs measured."""

from __future__ import annotations

import statistics
from pathlib import Path

from common import markdown_table, text_table

MIB = 2**20


def step_stats(run: dict) -> dict:
    """Median step time over the steps after warm-up, its spread, and tokens/s at the median."""
    warm = run["config"]["warmup"]
    times = run["step_times_s"][warm:] or run["step_times_s"]
    med = statistics.median(times)
    tokens = run["config"]["global_batch"] * run["config"]["model"]["seq_len"]
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "tokens_per_s": tokens / med}


def agreement(runs: dict, tol: float) -> dict:
    """Stage 1 vs stage 2 must be bitwise equal (losses and final params); ZeRO vs DDP within ``tol`` nats."""
    checks = {}
    if "zero1" in runs and "zero2" in runs:
        a, b = runs["zero1"], runs["zero2"]
        same_loss = a["losses"] == b["losses"]
        same_params = a["param_digest"] == b["param_digest"]
        checks["zero1_vs_zero2_bitwise"] = {
            "ok": same_loss and same_params,
            "losses_bitwise_equal": same_loss,
            "final_params_bitwise_equal": same_params,
            "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
        }
    if "ddp" in runs:
        ref = runs["ddp"]["losses"]
        for r in ("zero1", "zero2"):
            if r in runs:
                d = [abs(x - y) for x, y in zip(runs[r]["losses"], ref)]
                checks[f"{r}_vs_ddp"] = {
                    "ok": max(d) <= tol,
                    "tolerance_nats": tol,
                    "max_abs_loss_diff": max(d),
                    "final_abs_loss_diff": d[-1],
                    "mean_abs_loss_diff": sum(d) / len(d),
                }
    return checks


def _rows(runs: dict) -> list[list]:
    rows = []
    for name, run in runs.items():
        s = step_stats(run)
        psi = run["num_params"]
        rows.append(
            [
                run["label"],
                f"{run['model_state_total'] / MIB:.2f}",
                f"{run['estimate'] / MIB:.2f}",
                f"{run['model_state_total'] / psi:.2f}",
                f"{run['peak_memory_bytes'] / MIB:.1f}",
                f"{s['median_s'] * 1e3:.0f} ({s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f})",
                f"{s['tokens_per_s']:.0f}",
                f"{run['losses'][-1]:.4f}",
            ]
        )
    return rows


HEADERS = [
    "recipe",
    "model state MiB/rank (measured)",
    "estimate MiB/rank",
    "bytes/param",
    "peak MiB/rank",
    "step ms median (min-max)",
    "tokens/s",
    "final loss",
]


def _breakdown(runs: dict) -> list[str]:
    lines = []
    for name, run in runs.items():
        parts = ", ".join(f"{k} {v / MIB:.2f}" for k, v in run["model_state"].items())
        extra = ""
        if "formula_this_rank" in run:
            extra = (
                f"; = formula {run['formula_this_rank'] / MIB:.2f} + padding {run['padding'] / MIB:.2f}"
                f" + staging {run['staging'] / MIB:.2f} + fp32 grad shard {run['grad_shard_fp32'] / MIB:.2f}"
            )
        lines.append(f"{name}: {parts} MiB{extra}")
    return lines


def _check_lines(checks: dict) -> list[str]:
    out = []
    for name, c in checks.items():
        verdict = "PASS" if c["ok"] else "FAIL"
        if name.endswith("bitwise"):
            out.append(
                f"{verdict} stage 1 vs stage 2 bitwise: losses equal={c['losses_bitwise_equal']}, "
                f"final params equal={c['final_params_bitwise_equal']}"
            )
        else:
            out.append(
                f"{verdict} {name.split('_')[0]} vs DDP: max |dloss| {c['max_abs_loss_diff']:.4f} nats "
                f"(final {c['final_abs_loss_diff']:.4f}, mean {c['mean_abs_loss_diff']:.4f}) <= tolerance "
                f"{c['tolerance_nats']}"
            )
    return out


def render(runs: dict, checks: dict, meta: dict, entropy: float, args) -> tuple[str, str]:
    """The console text and the markdown body of the report."""
    first = next(iter(runs.values()))
    psi, world = first["num_params"], first["world_size"]
    peak_label = first["peak_memory_measure"]
    head = (
        f"{psi:,} params (Psi), {world} ranks, {args.steps} steps, global batch {args.batch} x {args.seq_len} "
        f"tokens; step time = slowest rank, median after {first['config']['warmup']} warm-up steps"
    )
    notes = [
        "model state = persistent params + grads + optimizer state per rank, measured after the first step "
        "(DDP: param/grad/AdamW-state tensors plus DDP's gradient buckets; ZeroAdamW: memory_report()).",
        "estimate = zero_ext.memory.estimate(Psi, N, stage): DDP row with fp32 widths (4+4+8 bytes), "
        "ZeRO rows with bf16 params/grads + 12 bytes fp32 master/exp_avg/exp_avg_sq.",
        f"peak = {peak_label} (max over ranks).",
        f"loss: mean over ranks of the global batch; best possible {entropy:.3f} nats (Markov chain entropy rate), "
        f"ln(vocab) = {__import__('math').log(args.vocab):.3f}.",
    ]
    rows = _rows(runs)
    text = "\n".join(
        [head, "", text_table(HEADERS, rows), "", *_breakdown(runs), "", *_check_lines(checks), "", *notes]
    )
    md = "\n".join(
        [
            head,
            "",
            markdown_table(HEADERS, rows),
            "",
            "Model state by kind (MiB per rank, rank 0):",
            "",
            *[f"- {line}" for line in _breakdown(runs)],
            "",
            "Checks:",
            "",
            *[f"- {line}" for line in _check_lines(checks)],
            "",
            *[f"- {n}" for n in notes],
            f"- wall time of the whole job: {meta.get('wall_time_s', '?')} s",
        ]
    )
    return text, md


def save_chart(runs: dict, path: Path, meta: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    kinds = sorted({k for r in runs.values() for k in r["model_state"]}, key=lambda k: k)
    bottom = [0.0] * len(names)
    for kind in kinds:
        vals = [runs[n]["model_state"].get(kind, 0) / MIB for n in names]
        if any(vals):
            ax1.bar(names, vals, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.scatter(names, [runs[n]["estimate"] / MIB for n in names], color="black", marker="_", s=900, label="estimate")
    ax1.set_ylabel("MiB per rank")
    ax1.set_title("persistent model state per rank")
    ax1.legend(fontsize=7)
    ax2.bar(names, [runs[n]["peak_memory_bytes"] / MIB for n in names], color="tab:gray")
    ax2.set_title("peak memory per rank", fontsize=10)
    ax2.set_ylabel("MiB")
    stats = [step_stats(runs[n]) for n in names]
    med = [s["median_s"] * 1e3 for s in stats]
    err = [[m - s["min_s"] * 1e3 for m, s in zip(med, stats)], [s["max_s"] * 1e3 - m for m, s in zip(med, stats)]]
    ax3.bar(names, med, yerr=err, capsize=4, color="tab:blue")
    ax3.set_title("step time (median, min-max)")
    ax3.set_ylabel("ms")
    fig.suptitle(f"zero_ext main job: {meta['device']}, commit {meta['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
