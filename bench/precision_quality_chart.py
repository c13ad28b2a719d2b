"""The chart of bench/bench_precision_quality.py (precision_quality.png), drawn from the runs' losses.

Left: every run's loss curve, raw (thin, faint) and smoothed (a trailing moving average, solid), on a log scale
from the start; middle: the same from the middle of the run, where the curves separate, if they do; right: each run's
smoothed loss minus fp32's, in percent of fp32's, scaled to the gaps (the issue's +-1 % bar drawn when it fits).
Skipped runs are named in the title. ``python bench/precision_quality_chart.py bench/results/precision_quality.json``
redraws a result's chart from its JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {
    "fp32": "black",
    "remainders": "tab:orange",
    "bf16_moments": "tab:green",
    "int8_moments": "tab:red",
    "ddp": "tab:blue",
    "torchao_adamw8bit": "tab:purple",
}
# fp32 wide underneath, remainders thin and dashed over it (bitwise equal: the two must coincide).
WIDTH = {"fp32": 3.0, "remainders": 1.2, "ddp": 2.0}
DASH = {"remainders": "--", "torchao_adamw8bit": "-."}
ZORDER = {"remainders": 4}  # on top of fp32


def moving_average(xs: list, window: int) -> list:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def save_chart(runs: dict, entropy: float, args, path, checks: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = {n: r for n, r in runs.items() if "losses" in r}
    skipped = [n for n, r in runs.items() if "losses" not in r]
    fig, (ax_all, ax_late, ax_gap) = plt.subplots(1, 3, figsize=(17, 5.8), layout="constrained")
    smooth = {n: moving_average(r["losses"], args.smooth) for n, r in trained.items()}
    half = len(next(iter(trained.values()))["losses"]) // 2 if trained else 0
    for name, r in trained.items():
        steps = range(1, len(r["losses"]) + 1)
        style = dict(color=COLORS.get(name, "gray"), ls=DASH.get(name, "-"), zorder=ZORDER.get(name, 2))
        final = f"{r['final_loss']:.4f}"
        gap = f", {r['gap_to_fp32_pct']:+.2f} % vs fp32" if "gap_to_fp32_pct" in r and name != "fp32" else ""
        if name == "remainders" and (checks or {}).get("remainders_bitwise_fp32", {}).get("ok"):
            gap = ", bitwise = fp32 (losses and params)"
        for ax, start in ((ax_all, 0), (ax_late, half)):
            ax.plot(steps[start:], r["losses"][start:], lw=0.6, alpha=0.3, **style)
            ax.plot(steps[start:], smooth[name][start:], lw=WIDTH.get(name, 1.6), alpha=0.9,
                    label=f"{r['label']}: {final}{gap}" if ax is ax_all else None, **style)  # fmt: skip
    for ax in (ax_all, ax_late):
        ax.axhline(entropy, color="gray", ls=":", lw=1)
        ax.set(xlabel="step", ylabel="cross-entropy, nats")
    ax_all.set_yscale("log")
    ax_all.set_title(f"loss: raw (faint) and moving average over {args.smooth} steps (solid)")
    ax_late.set_title(f"the second half (best possible {entropy:.3f}, dotted)")
    late = [v for n in trained for v in smooth[n][half:]]
    if late:
        lo, hi = min(late), max(late)  # the best possible loss may lie below: the curves' own range
        ax_late.set_ylim(lo - 0.05 * (hi - lo), hi + 0.15 * (hi - lo))
    title = f"final loss = mean of the last {args.last} steps"
    if skipped:
        title += "; not run: " + ", ".join(skipped)
    fig.legend(*ax_all.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8, frameon=False,
               title=title, title_fontsize=8)  # fmt: skip

    if "fp32" in trained:
        ref, shown = smooth["fp32"], []
        for name in (n for n in trained if n != "fp32"):
            gap = [100 * (a - b) / b for a, b in zip(smooth[name], ref)]
            shown += gap[args.smooth :]  # the first window averages fewer steps: noisier, left out of the scale
            ax_gap.plot(range(1, len(gap) + 1), gap, color=COLORS.get(name, "gray"), ls=DASH.get(name, "-"),
                        lw=WIDTH.get(name, 1.4), label=name)  # fmt: skip
        ax_gap.axhline(0, color="black", lw=0.8)
        # Scaled to the gaps, not to the bar: gaps of hundredths of a percent are flat lines on a +-1 % axis.
        top = 1.3 * max([abs(v) for v in shown] + [0.01])
        ax_gap.set_ylim(-top, top)
        if args.bar <= top:
            ax_gap.axhspan(-args.bar, args.bar, color="tab:green", alpha=0.1, label=f"+-{args.bar:g} % (the bar)")
        else:
            ax_gap.text(0.02, 0.03, f"the bar, +-{args.bar:g} %, is {args.bar / top:.0f}x this axis' range",
                        transform=ax_gap.transAxes, fontsize=8, color="tab:green")  # fmt: skip
        ax_gap.legend(fontsize=8, loc="upper right")
    ax_gap.set(title="smoothed loss minus fp32's, in % of fp32's", xlabel="step", ylabel="%")
    fig.suptitle(
        f"Optimizer-state precision: the benchmark GPT, {args.steps} steps, ZeroAdamW stage {args.stage} on "
        f"{args.world_size} ranks, same weights and batches"
    )
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def redraw(json_path: str) -> Path:
    """The chart of a result file, drawn again from its JSON (next to it, as ``<name>.png``)."""
    data = json.loads(Path(json_path).read_text())
    c = data["config"]
    args = argparse.Namespace(smooth=c.get("smooth", 20), last=c["last"], bar=c["bar_pct"], steps=c["steps"],
                              stage=int(c["recipe"][-1]), world_size=c["world_size"])  # fmt: skip
    return save_chart(data["runs"], data["entropy_rate"], args, Path(json_path).with_suffix(".png"), data["checks"])


if __name__ == "__main__":
    print("wrote", redraw(sys.argv[1]))
