"""The chart and the markdown of ``bench_hsdp_cluster.py``'s analysed result (``hsdp_cluster_analysis.analyse``)."""

from __future__ import annotations

from harness import markdown_table
from hsdp_cluster_analysis import LAYERS, TARGET

MIB = 2**20


def chart(result: dict, path: str) -> None:
    """Left: step time against the link rate, measured and predicted, per contender. Right: predicted against
    measured for every shaped row, with the +-25 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 7), gridspec_kw={"width_ratios": [1.25, 1]})
    rows = [r for r in result["rows"] if "predicted_s" in r]
    key = "predicted_out_s" if all("predicted_out_s" in r for r in rows) else "predicted_s"
    what = "out of sample" if key == "predicted_out_s" else "in sample"
    for name in dict.fromkeys(r["contender"] for r in rows if not r["contender"].startswith("pattern")):
        pts = sorted((r for r in rows if r["contender"] == name), key=lambda r: r["rate_bps"])
        xs = [r["rate_bps"] / 1e6 for r in pts]
        (line,) = ax.plot(xs, [r["seconds"] for r in pts], "o-", label=f"{name}, measured")
        ax.plot(xs, [r[key] for r in pts], "x--", color=line.get_color(), label=f"{name}, predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("inter-node link (Mbit/s, tc tbf on the veth)")
    ax.set_ylabel("step time (s, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)  # below the axes: no line hidden
    for k, marker, label in (("predicted_s", "o", "constants from this run"),
                             ("predicted_out_s", "x", "constants from the other run")):  # fmt: skip
        pts = [r for r in rows if k in r]
        if pts:
            bx.scatter([r["seconds"] for r in pts], [r[k] for r in pts], marker=marker, label=label)
    lo, hi = min(r["seconds"] for r in rows) * 0.7, max(r["seconds"] for r in rows) * 1.4
    xs = [lo, hi]
    bx.plot(xs, xs, "k-", lw=0.8)
    bx.fill_between(xs, [x * (1 - TARGET) for x in xs], [x * (1 + TARGET) for x in xs], color="grey", alpha=0.2,
                    label="within 25 %")  # fmt: skip
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlim(lo, hi)
    bx.set_ylim(lo, hi)
    bx.set_xlabel("measured step (s)")
    bx.set_ylabel("predicted step (s)")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=8, loc="upper left")
    stage = result.get("stage", "?")
    fig.suptitle(f"2 emulated nodes x 2 gloo ranks, stage {stage}: measured and predicted step ({what} on the left)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(r: dict, key: str) -> str:
    s_key = "predicted_s" if key == "rel_error" else "predicted_out_s"
    return f"{r[s_key]:.3f} ({r[key] * 100:+.0f} %)" if key in r else "-"


def _constants(m: dict) -> str:
    beyond = "; beyond 25 %: " + ", ".join(m["beyond_target"]) if m["beyond_target"] else "; every row within 25 %"
    return (f"efficiency {m['efficiency']:.3f}, overlap {m['overlap_s'] * 1e3:.1f} ms; |error| median "
            f"{m['median_abs_rel_error'] * 100:.1f} %, max {m['max_abs_rel_error'] * 100:.1f} % ({m['worst_row']})"
            + beyond)  # fmt: skip


def markdown(result: dict, h100_text: str, chart_name: str = "") -> str:
    rows = []
    for r in result["rows"]:
        cs = r["comm_stats"]
        stats = f"{cs['inter_node_bytes'] / MIB:.2f} / {cs['intra_node_bytes'] / MIB:.2f}" if cs else "-"
        rows.append([r["rate"], r["contender"], f"{r['seconds']:.3f} [{r['q1_s']:.3f}, {r['q3_s']:.3f}]",
                     f"{r['local_s']:.3f}" if "local_s" in r else "-",
                     f"{r['veth_bytes_a_to_b'] / MIB:.2f} / {r['veth_bytes_b_to_a'] / MIB:.2f}",
                     f"{r['link_bytes'] / MIB:.2f} / {r['link_bytes_flat'] / MIB:.2f}", stats,
                     _pct(r, "rel_error"), _pct(r, "rel_error_out"),
                     f"{r['quiet_bytes_a_to_b'] / 1024:.1f} / {r['quiet_bytes_b_to_a'] / 1024:.1f}"])  # fmt: skip
    head = ["link", "contender", "step s, median [q1, q3]", "T_local: unshaped step s", "veth MiB a->b / b->a",
            "link MiB per direction, predicted: gloo / flat model", "comm_stats wire MiB (rank 0) inter / intra",
            "predicted s (error), constants from this run", "predicted s (error), constants from the other run",
            "quiet: KiB on the veth after the step, max a->b / b->a"]  # fmt: skip
    r0, m = result["rank0"], result["link_model"]
    probe = r0["alpha_probe"]
    netem = "applied" if result["netem"] else "not in this kernel: bandwidth only (tbf); alpha is gloo's and the veth's"
    mesh = "measured" if result["mesh_error"] is None else "not run: " + result["mesh_error"]
    lines = []
    if "reanalysis" in result["meta"]:
        a = result["meta"]["reanalysis"]
        lines += [f"Measured at the commit and date above; analysis recomputed from the committed JSON on {a['date']} "
                  f"at commit `{a['commit']}`: `{a['command']}`.", ""]  # fmt: skip
    lines += [
        f"Stage {result['stage']}, {r0['psi']:,} bf16 parameters ({LAYERS} linear layers of {r0['dim']}), "
        f"{r0['buckets']} buckets; 4 gloo ranks as 2 nodes x 2; {result['steps']} timed steps per contender and "
        f"speed after {result['warmup']} warm-up, interleaved. Link latency (netem): {netem}.",
        f"Mesh engine (`zero_mesh`): {mesh}.",
        "",
        markdown_table(head, rows),
        "",
        "The prediction: `T = T_local + max(0, L / (rate x efficiency) - overlap)`, T_local the contender's step on "
        "the unshaped link (measured: its compute and the collectives' fixed costs), L the bytes gloo's algorithms "
        "put on the link per step in its busier direction (`zero_ext.comm_time.step_link_load(..., "
        'algorithm="gloo")`: a reduce-scatter is one all-to-all, an all-gather and an all-reduce rings in rank '
        "order), efficiency and overlap two constants of the machine, fitted (least squares of the relative errors "
        "over every shaped row):",
    ]
    if "in_sample" in m:
        lines.append(f"- on this run's {m['rows']} shaped rows (in sample): {_constants(m['in_sample'])}")
    if "out_of_sample" in m:
        lines.append(f"- on {m['out_of_sample']['fitted_on']} (out of sample, this run's rows predicted with "
                     f"them): {_constants(m['out_of_sample'])}")  # fmt: skip
    if "payload_share" in m:
        share = ", ".join(f"{k} {v:.3f}" for k, v in m["payload_share"].items())
        lines.append(
            f"- the model's bytes / the veth's, median per rate: {share} (the rest: the headers the veth "
            "counts, part of what the efficiency absorbs; the efficiency itself is fitted, not probed)"
        )
    lines += [
        f"- alpha, probed (a 1-element all-reduce over 2 ranks, / 2 message steps, unshaped run): inside a node "
        f"{probe['shard'] * 1e3:.3f} ms, across the link {probe['replicate'] * 1e3:.3f} ms",
        "",
        "Earlier versions of this file fitted `T = c[contender] + k u` with an intercept per contender, which "
        "predicts nothing; the prediction above replaces those fits: T_local is measured and the two constants are "
        "shared by every contender and rate. The flat model (every rank's (g-1)/g of each collective through the "
        "link, `algorithm=\"ring\"`, `zero_ext.comm_time`'s default) is kept as a column: it overstates gloo's 1-D "
        "traffic (its reduce-scatter keeps a quarter of each bucket inside the node, its all-gather ring crosses "
        "each direction once).",
        "",
        "Columns: veth bytes crossed node a's and node b's end of the link per step (median; the barriers' few "
        "bytes included); `comm_stats()` counts `(g-1)/g` of each collective's tensor per rank as inter- or "
        "intra-node (the engine's buckets are padded to whole granules, and its step adds small all-reduces of "
        "statistics).",
    ]
    if chart_name:
        lines += ["", f"![measured and predicted step time]({chart_name})"]
    lines += ["", "## The flat model at 8 x 8 H100s", "", h100_text]
    return "\n".join(lines)
