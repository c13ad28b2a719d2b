"""Per-folder wall time and test count of pytest junit XML files, side by side (issue 47: the suite in 12 minutes).

    python -m pytest -q --junitxml=build/suite_before.xml ...   # once per version
    python tests/coverage/suite_times.py --out bench/results/suite_times.md before=build/suite_before.xml \\
        after=build/suite_after.xml

Each column is one run's seconds per tests/<folder> (the sum of its tests' times, setup and teardown included) and
its number of tests; the slowest tests of the last run are listed below. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def load(path: str) -> tuple[dict[str, float], dict[str, int], list[tuple[float, str]]]:
    secs, count, tests = collections.defaultdict(float), collections.Counter(), []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        folder = cls.split(".")[1] if cls.startswith("tests.") and cls.count(".") >= 2 else cls.split(".")[0]
        t = float(case.get("time", 0))
        secs[folder] += t
        if case.find("skipped") is None:
            count[folder] += 1
        tests.append((t, f"{cls}::{case.get('name')}"))
    return secs, count, sorted(tests, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--slowest", type=int, default=30)
    ap.add_argument("runs", nargs="+", help="name=junit.xml")
    args = ap.parse_args()
    runs = [(r.split("=", 1)[0], load(r.split("=", 1)[1])) for r in args.runs]
    folders = sorted({f for _, (s, _, _) in runs for f in s}, key=lambda f: -runs[0][1][0].get(f, 0))
    head = "| folder | " + " | ".join(f"{n} s | {n} tests" for n, _ in runs) + " |"
    lines = [f"# Suite time per folder: {', '.join(args.runs)}", "", head, "|---" * (1 + 2 * len(runs)) + "|"]
    for f in folders:
        lines.append(f"| {f} | " + " | ".join(f"{s.get(f, 0):.0f} | {c.get(f, 0)}" for _, (s, c, _) in runs) + " |")
    lines.append("| **all** | " + " | ".join(f"{sum(s.values()):.0f} | {sum(c.values())}" for _, (s, c, _) in runs)
                 + " |")  # fmt: skip
    name, (_, _, tests) = runs[-1]
    lines += ["", f"Slowest tests of `{name}`:", ""] + [f"- {t:.1f} s {n}" for t, n in tests[: args.slowest]] + [""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
