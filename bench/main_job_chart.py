"""The main job's chart (main_job.png), drawn from what the runs measured (bench/main_job.py).

Four panels: the loss curves of every recipe (the main check), the per-step gap of each ZeRO run to DDP against the
tolerance, persistent model state per rank by kind with the formula and value labels above each bar (stage 3's window
of gathered parameters drawn hatched on top: transient, not persistent), and step time. Peak memory
is left out on purpose: at this model size it is activations, temporaries and runtime buffers, not model state
(it stays in the table of main_job.md). ``python bench/main_job_chart.py bench/results/main_job.json`` redraws a
result's chart from its JSON.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from harness import step_stats

MIB = 2**20
COLORS = {
    "ddp": "tab:blue",
    "zero1": "tab:orange",
    "zero2": "tab:green",
    "zero3": "tab:purple",
    "zero3_lean": "tab:red",
    "muon1": "tab:brown",
    "muon2": "tab:pink",
    "muon3": "tab:olive",
}
# Names under the bars and in the gap legend, the rest of each run's label wrapped below them (_tick): narrow
# enough that five runs' labels do not run into each other at fontsize 8.
SHORT = {"ddp": "DDP", "zero1": "stage 1", "zero2": "stage 2", "zero3": "stage 3", "zero3_lean": "stage 3 lean",
         "muon1": "Muon 1", "muon2": "Muon 2", "muon3": "Muon 3"}  # fmt: skip
# Loss curves lie on top of each other: DDP wide underneath, the stages thinner and differently dashed over it.
STYLES = {"ddp": dict(lw=5, alpha=0.45), "zero1": dict(lw=2.2), "zero2": dict(lw=1.6, ls="--"),
          "zero3": dict(lw=1.2, ls=":"), "zero3_lean": dict(lw=1.2, ls="-."), "muon1": dict(lw=2.2),
          "muon2": dict(lw=1.6, ls="--"), "muon3": dict(lw=1.2, ls=":")}  # fmt: skip
GAP_STYLES = {"zero1": dict(ls="-", marker="o", ms=3), "zero2": dict(ls="--"), "zero3": dict(ls=":", marker="x", ms=4),
              "zero3_lean": dict(ls="-.", marker="+", ms=5)}  # fmt: skip
# Stacking order and colour of each kind of model state (kinds a run does not have are skipped).
KINDS = {
    "params": "#4e79a7",
    "grads": "#a0cbe8",
    "master": "#f28e2b",
    "remainder": "#ffbe7d",  # param_remainders: the int16 low half of the master (the bf16 param is the rest)
    "momentum_buffer": "#9c755f",  # ZeroMuon: Muon's momentum of the matrices a rank owns
    "exp_avg": "#59a14f",
    "exp_avg_sq": "#8cd17d",
    "max_exp_avg_sq": "#c7e9c0",  # amsgrad
    "exp_avg_scale": "#2f6b2a",  # int8 moments: one fp32 scale per 64 elements of each
    "exp_avg_sq_scale": "#4f8f46",
    "max_exp_avg_sq_scale": "#6fb36a",
    "grad_shard": "#b6992d",
    "staging": "#bab0ac",
    "ddp_buckets": "#e15759",
    "landing": "#d37295",  # offload: the ring reduced gradients land in before the host grad shard
    "window": "#fabfd2",  # offload="nvme": the host window the state on disk streams through
    "step": "#79706e",
}


def _num(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _tick(name: str, label: str) -> str:
    """ "stage 3 lean" over "bf16 params," / "remainders +" / "int8 moments": the short name, then what the label
    says after its first comma, wrapped to the width of a bar's slot."""
    detail = label.split(", ", 1)[1] if ", " in label else ""
    return "\n".join([SHORT.get(name, name), *textwrap.wrap(detail.replace("param_remainders", "remainders"), 16)])


# A step-time bar more than this many times the others' tallest is drawn cut at the top (its median written), so the
# others stay readable: on a CPU without fast bf16 GEMMs ZeroMuon's Newton-Schulz (bf16, as torch runs it) makes its
# steps ~8x AdamW's (bench/results/main_job_epyc.md), which squashed every other bar to the bottom of the panel.
OFF_SCALE = 3.0


def time_axis_top(tops: list[float]) -> float:
    """The step-time panel's scale: the tallest bar, unless some are more than ``OFF_SCALE`` times the tallest of
    the others; then the others' tallest, with room (those are drawn cut at the top)."""
    ordered = sorted(tops)
    for k in range(1, len(ordered)):
        if ordered[k] > OFF_SCALE * ordered[k - 1]:  # a gap: everything from k up is off the scale
            return 1.5 * ordered[k - 1]
    return max(tops)


def save_chart(runs: dict, checks: dict, entropy: float, meta: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(runs)
    # wider with more than five runs (the ZeroMuon rows), so that the bars' labels keep their room
    width = 14 + 1.6 * max(0, len(names) - 5)
    fig, ((ax_loss, ax_gap), (ax_mem, ax_time)) = plt.subplots(2, 2, figsize=(width, 9.5), layout="constrained")
    # "zero2 (= stage 1, bitwise)": each stage equal bit for bit to the lowest stage run
    same = {k.removesuffix("_bitwise").split("_vs_")[1]: k.split("_vs_")[0] for k, c in checks.items()
            if k.endswith("_bitwise") and c["ok"]}  # fmt: skip

    for name in names:
        losses = runs[name]["losses"]
        label = runs[name]["label"] + (f" (= stage {same[name][-1]}, bitwise)" if name in same else "")
        ax_loss.plot(range(1, len(losses) + 1), losses, color=COLORS[name], label=label, **STYLES[name])
    ax_loss.axhline(entropy, color="gray", ls=":", lw=1)
    ax_loss.annotate(f"best possible {entropy:.3f}", (1, entropy), xytext=(2, 3), textcoords="offset points",
                     fontsize=8, color="gray", va="bottom")  # fmt: skip
    ax_loss.set(title="training loss (mean over ranks)", xlabel="step", ylabel="cross-entropy, nats")
    gaps = [c["max_abs_loss_diff"] for k, c in checks.items() if k.endswith("_vs_ddp")]
    title = f"max |ZeRO - DDP| = {max(gaps):.4f} nats: the curves overlap (gap at the right)" if gaps else None
    ax_loss.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False, title=title,
                   title_fontsize=8)  # fmt: skip

    # The gap to DDP, step by step, against the tolerance band.
    band = next((c for k, c in checks.items() if k.endswith("_vs_ddp")), None)
    if "ddp" in runs and band is not None:
        tols = band.get("tolerance_by_step") or [band["tolerance_nats"]] * len(runs["ddp"]["losses"])
        tol = max(tols)
        ref = runs["ddp"]["losses"]
        for name in (n for n in names if f"{n}_vs_ddp" in checks):  # (ZeroMuon is another optimizer: no gap)
            gap = [a - b for a, b in zip(runs[name]["losses"], ref)]
            worst = checks[f"{name}_vs_ddp"]["max_abs_loss_diff"]
            ax_gap.plot(
                range(1, len(gap) + 1),
                gap,
                color=COLORS[name],
                label=f"{SHORT.get(name, name)}: max |gap| {worst:.4f}",
                **GAP_STYLES[name],
            )
        steps = range(1, len(tols) + 1)
        rule = band.get("tolerance_rule", f"{tol} nats")
        ax_gap.fill_between(steps, [-t for t in tols], tols, color="tab:green", alpha=0.08, label=f"tolerance: {rule}")
        for sign in (-1, 1):
            ax_gap.plot(steps, [sign * t for t in tols], color="tab:red", ls=":", lw=1)
        ax_gap.axhline(0, color="black", lw=0.6)
        ax_gap.set_ylim(-max(1.6 * tol, 1.1 * max(gaps)), max(1.6 * tol, 1.1 * max(gaps)))
        ax_gap.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    else:
        ax_gap.text(0.5, 0.5, "no DDP baseline in this run", ha="center", va="center", transform=ax_gap.transAxes)
    ax_gap.set(title="loss(ZeRO) − loss(DDP) per step", xlabel="step", ylabel="nats")
    for ax in (ax_loss, ax_gap):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    # Model state per rank: stacked by kind, total and bytes/param on top, the formula as a black tick.
    x = list(range(len(names)))
    bottom = [0.0] * len(names)
    tallest = max(runs[n]["model_state_total"] for n in names) / MIB
    for kind, color in KINDS.items():  # kinds too small to see (AdamW's step counters) are left out
        vals = [runs[n]["model_state"].get(kind, 0) / MIB for n in names]
        if max(vals) > 1e-3 * tallest:
            ax_mem.bar(x, vals, 0.6, bottom=bottom, color=color, label=kind, edgecolor="white", lw=0.5)
            bottom = [b + v for b, v in zip(bottom, vals)]
    window = [runs[n].get("window_bound", 0) / MIB for n in names]
    hatched = [i for i in x if window[i]]  # stage 3: the declared bound of gathered buckets, transient, on top
    if hatched:  # (only those bars: a zero-height bar would still draw its edge)
        ax_mem.bar(hatched, [window[i] for i in hatched], 0.6, bottom=[bottom[i] for i in hatched], color="white",
                   edgecolor="tab:purple", hatch="///", lw=0.8, label="gathered window\n(stage 3 bound;\ntransient)")  # fmt: skip
    est = [runs[n]["estimate"] / MIB for n in names]
    ax_mem.hlines(est, [i - 0.36 for i in x], [i + 0.36 for i in x], color="black", lw=2, label="formula (estimate)")
    # The labels go above the bar, its window and its formula tick (offload="nvme" counts the state on disk in the
    # formula, so the tick can be above the bar): beside the bar, a label ran into the next bar's text.
    tops = [max(b + w, e) for b, w, e in zip(bottom, window, est)]
    for i, n in enumerate(names):
        total = runs[n]["model_state_total"]
        text = f"{_num(total / MIB)} MiB\n{total / runs[n]['num_params']:.1f} B/param"
        if window[i]:
            text += f"\n+ window {_num(window[i])}"
        if runs[n].get("on_disk"):  # offload="nvme": master and moments live in files, not in this bar
            text += f"\n+ {_num(runs[n]['on_disk'] / MIB)} on disk"
        text += f"\nformula {_num(est[i])}"
        ax_mem.text(i, tops[i] + 0.02 * max(tops), text, ha="center", va="bottom", fontsize=8)
    ticks = [_tick(n, runs[n]["label"]) for n in names]
    ax_mem.set_xticks(x, ticks, fontsize=8)
    ax_mem.set_ylim(0, max(tops) * 1.45)  # room for four label lines above the tallest bar
    ax_mem.set(title=f"persistent model state per rank (N = {runs[names[0]]['world_size']})", ylabel="MiB per rank")
    ax_mem.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)

    # Step time: median with min-max whiskers, value labels.
    stats = [step_stats(runs[n]) for n in names]
    med = [s["median_s"] * 1e3 for s in stats]
    err = [[m - s["min_s"] * 1e3 for m, s in zip(med, stats)], [s["max_s"] * 1e3 - m for m, s in zip(med, stats)]]
    ax_time.bar(x, med, 0.6, yerr=err, capsize=4, color=[COLORS[n] for n in names], alpha=0.8)
    tops = [m + e for m, e in zip(med, err[1])]
    top = time_axis_top(tops)
    for i, m in enumerate(med):  # above the whisker: inside a bar, a short bar's label would fall off it
        if tops[i] <= top:
            ax_time.text(i, tops[i] + 0.01 * top, f"median\n{m:.0f} ms", ha="center", va="bottom", fontsize=8)
        else:  # off the scale: cut at the top, its median written inside the axes
            ax_time.text(i, 0.98 * top * 1.15, f"median\n{m:.0f} ms\n(off scale)", ha="center", va="top", fontsize=8,
                         bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1))  # fmt: skip
    ax_time.set_ylim(0, top * 1.15)
    ax_time.set_xticks(x, ticks, fontsize=8)
    warm = runs[names[0]]["config"]["warmup"]
    ax_time.set(title="step time of the slowest rank: median, min-max", ylabel="ms")
    notes = [f"the first {warm} steps are warm-up, left out"] if len(runs[names[0]]["losses"]) > warm else []
    if top < max(tops):
        notes.append("bars marked off scale are cut at the top")
    ax_time.set_xlabel(f"({'; '.join(notes)})" if notes else "")

    psi = runs[names[0]]["num_params"]
    # How autocast's matmuls ran (main_job_compute.py); result files from before the probe do not say.
    gemm = {"bf16": ", bf16 GEMMs", "fp32": ", autocast matmuls as fp32 GEMMs"}.get(meta.get("matmul"), "")
    fig.suptitle(f"zero_ext main job: {psi:,}-param GPT, {meta['device']}{gemm}, commit {meta['commit']}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


if __name__ == "__main__":  # redraw a result's chart from its JSON: python bench/main_job_chart.py results/x.json
    import json
    import sys

    for arg in sys.argv[1:]:
        result = json.loads(Path(arg).read_text())
        print(save_chart(result["runs"], result["checks"], result["entropy_rate"], result["meta"],
                         Path(arg).with_suffix(".png")))  # fmt: skip
