"""zero_ext lines hit by two versions of some test files (issue 47: coverage not lower when tests are merged or
pruned). Runs each version's files under coverage.py (.coveragerc: spawned gloo ranks and subprocesses measured),
then compares the sets of (file, line) hit: the new set must contain the old one.

    python tests/coverage/compare_lines.py --old-rev 8476b8e --out bench/results/coverage_rl.md tests/rl/test_x.py

The old version is `git archive`d, less zero_ext/ kernels/ csrc/, into a scratch folder and run there; both import
the same zero_ext (this checkout's editable install), so only the tests differ. Not collected by pytest (no
test_ prefix); a tool for the person who changes tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(tree: Path, files: list[str], data: Path, extra: list[str]) -> tuple[dict[str, set[int]], str, float]:
    """Lines of zero_ext hit by ``pytest files`` run in ``tree`` (every marker but cuda)."""
    env = dict(os.environ, COVERAGE_FILE=str(data), COVERAGE_RCFILE=str(ROOT / ".coveragerc"))
    py = [sys.executable, "-m", "coverage"]
    subprocess.run([*py, "erase"], cwd=tree, env=env, check=True)
    t0 = time.perf_counter()
    run = subprocess.run([*py, "run", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda", *extra,
                          *files], cwd=tree, env=env, capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - t0
    tally = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    subprocess.run([*py, "combine", "-q"], cwd=tree, env=env, check=True)
    out = data.parent.parent / f"{data.parent.name}.json"  # not beside the data files: combine would read it
    subprocess.run([*py, "json", "-q", "-o", str(out)], cwd=tree, env=env, check=True)
    report = json.loads(out.read_text())["files"]
    lines = {os.path.relpath(f, ROOT) if os.path.isabs(f) else f: set(v["executed_lines"]) for f, v in report.items()}
    return lines, tally, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-rev", required=True, help="the commit whose versions of the files are the baseline")
    ap.add_argument("--out", required=True, help="markdown result file")
    ap.add_argument("--old-files", nargs="*", help="the old version's files, when they differ from the new ones")
    ap.add_argument("--pytest-args", default="", help='more pytest arguments for both runs, e.g. "-n 2" (xdist)')
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="cov_old_"))
    try:
        # Everything the old tests may import (bench/, docs/, scripts/) but the packages: zero_ext is imported from
        # this checkout's editable install (with its built extension) in both runs.
        archive = subprocess.run(["git", "archive", args.old_rev], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
        for package in ("zero_ext", "kernels", "csrc"):
            shutil.rmtree(scratch / package, ignore_errors=True)
        # Each run's data in a folder of its own: several comparisons may run at once.
        (scratch / "old").mkdir()
        (scratch / "new").mkdir()
        extra = args.pytest_args.split()
        old, old_tally, old_wall = measure(scratch, args.old_files or args.files, scratch / "old" / ".coverage", extra)
        new, new_tally, new_wall = measure(ROOT, args.files, scratch / "new" / ".coverage", extra)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for tally in (old_tally, new_tally):
        if " passed" not in tally or "error" in tally or "failed" in tally:
            print(f"a run did not pass: old {old_tally!r}, new {new_tally!r}")
    lost = {f: sorted(ls - new.get(f, set())) for f, ls in old.items() if ls - new.get(f, set())}
    gained = {f: sorted(ls - old.get(f, set())) for f, ls in new.items() if ls - old.get(f, set())}
    n_old, n_new = sum(map(len, old.values())), sum(map(len, new.values()))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    lines = [
        f"# zero_ext lines hit: {' '.join(args.files)}",
        "",
        f"`python tests/coverage/compare_lines.py --old-rev {args.old_rev} --out {args.out}"
        f"{f' --pytest-args {args.pytest_args!r}' if args.pytest_args else ''} {' '.join(args.files)}`"
        f" at {rev.strip()} (the old files from {args.old_rev}); wall times on a shared 2-core machine.",
        "",
        "| version | zero_ext lines hit | pytest | wall s |",
        "|---|---|---|---|",
        f"| old ({args.old_rev}) | {n_old} | {old_tally} | {old_wall:.0f} |",
        f"| new | {n_new} | {new_tally} | {new_wall:.0f} |",
        "",
        f"Lines the old version hit and the new one does not: {sum(map(len, lost.values()))}"
        + ("" if not lost else "\n\n" + "\n".join(f"- {f}: {v}" for f, v in sorted(lost.items()))),
        "",
        f"Lines the new version hits and the old one did not: {sum(map(len, gained.values()))}"
        + ("" if not gained else "\n\n" + "\n".join(f"- {f}: {v}" for f, v in sorted(gained.items()))),
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"old_rev": args.old_rev, "files": args.files, "old_lines": n_old, "new_lines": n_new, "old_tally": old_tally,
         "new_tally": new_tally, "old_wall_s": old_wall, "new_wall_s": new_wall, "lost": lost}, indent=1))  # fmt: skip
    print("\n".join(lines[:9]))
    passed = all(" passed" in t and "error" not in t and "failed" not in t for t in (old_tally, new_tally))
    sys.exit(1 if lost or not passed else 0)


if __name__ == "__main__":
    main()
