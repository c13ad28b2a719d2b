"""Is the main job's ``zero3_lean`` row (stage 3 with ``param_remainders`` and int8 moments) slower a step than the
default stage 3 row? Issue 37 asks for "no slower in the same run"; on the 2-core dev VM one job's step medians swing
by +-30 % between runs (other tenants, the two ranks sharing the cores), so one run cannot say. This runs the main job's
two stage 3 rows (``bench/main_job.py --stages 3 --no-baseline --no-muon``, each row in fresh processes) several
times and reports each run's two median step times, their ratio, and the median of the ratios.

    python bench/investigations/zero3_lean_step_time.py [--runs 6] [--out-dir bench/results]

Writes zero3_lean_step_time.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
import torch  # noqa: E402

ROWS = ("zero3", "zero3_lean")


def one_run(k: int, tmp: Path) -> dict:
    main_job = Path(__file__).resolve().parents[1] / "main_job.py"
    cmd = [sys.executable, str(main_job), "--stages", "3", "--no-baseline", "--no-muon", "--no-chart", "--no-progress",
           "--name", f"run{k}", "--out-dir", str(tmp)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"main_job.py failed:\n{out.stderr[-2000:]}")
    runs = json.loads((tmp / f"run{k}.json").read_text())["runs"]
    return {row: {"label": runs[row]["label"], **harness.step_stats(runs[row])} for row in ROWS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--out-dir", default=str(harness.RESULTS))
    ap.add_argument("--name", default="zero3_lean_step_time")
    args = ap.parse_args()
    meta = harness.meta(torch.device("cpu"))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            runs.append(one_run(k, Path(tmp)))
            r = runs[-1]
            print(f"run {k + 1}/{args.runs}: stage 3 {r['zero3']['median_s'] * 1e3:.0f} ms, zero3_lean "
                  f"{r['zero3_lean']['median_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
    ratios = [r["zero3_lean"]["median_s"] / r["zero3"]["median_s"] for r in runs]
    median = statistics.median(ratios)
    verdict = "PASS" if median <= 1.0 else "FAIL"
    rows = [[k + 1, f"{r['zero3']['median_s'] * 1e3:.0f}", f"{r['zero3_lean']['median_s'] * 1e3:.0f}", f"{q:.2f}"]
            for k, (r, q) in enumerate(zip(runs, ratios))]  # fmt: skip
    body = (
        f"The main job's two stage 3 rows, {args.runs} runs (each `bench/main_job.py --stages 3 --no-baseline "
        "--no-muon`, its rows in fresh processes, one after the other): each row's median step time after its warm-up "
        "steps (slowest rank), and zero3_lean's over stage 3's.\n\n"
        f"{runs[0]['zero3']['label']} vs {runs[0]['zero3_lean']['label']}\n\n"
        + harness.markdown_table(["run", "stage 3 ms", "zero3_lean ms", "zero3_lean / stage 3"], rows)
        + f"\n\n{verdict} zero3_lean no slower than stage 3: median ratio {median:.2f} over {args.runs} runs "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}).\n"
    )
    payload = {"runs": runs, "ratios": ratios, "median_ratio": median, "verdict": verdict}
    for p in harness.write_results(args.name, meta, payload, body, args.out_dir):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
