"""What every benchmark result file records, and how it is written.

Each result is one JSON file (``meta`` + the script's own payload) and one markdown file with the same
numbers; both carry the device, date, git commit, torch version and the exact command that produced them,
so a number in ``bench/README.md`` can always be traced back to a run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The commit the code ran at, with ``-dirty`` when tracked files differed from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "zero_ext", "bench", "csrc"], cwd=REPO)
        return sha + ("-dirty" if dirty.returncode else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {cpu_name()}, {cores} cores"


def command_line() -> str:
    """The exact command, as a user would type it from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())
    return shlex.join(["python", script, *sys.argv[1:]])


def meta(device: torch.device, command: Optional[str] = None) -> dict[str, Any]:
    try:
        import zero_ext

        isa = zero_ext.ops.cpu_isa()
    except Exception as e:  # the record must say why it is missing, not fail the run
        isa = f"unavailable ({e})"
    return {
        "device": device_description(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "zero_ext_cpu_isa": isa,
        "command": command or command_line(),
        # Other work on the machine slows every timing: the 1-minute load average when the run started.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def meta_markdown(m: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"- device: {m['device']}",
            f"- date: {m['date']}, commit `{m['commit']}`, torch {m['torch']}, python {m['python']}",
            f"- command: `{m['command']}`",
            f"- load average (1 min) at the start: {m.get('load_avg_1m')} (timings are noisy when it exceeds the cores)",
        ]
    )


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def text_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_results(
    name: str, meta_: dict[str, Any], payload: dict[str, Any], markdown_body: str, out_dir: Optional[Path] = None
) -> list[Path]:
    """Write ``<out_dir>/<name>.json`` and ``<name>.md`` (default ``bench/results``); returns the paths."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps({"meta": meta_, **payload}, indent=2) + "\n")
    md.write_text(f"# {name}\n\n{meta_markdown(meta_)}\n\n{markdown_body.rstrip()}\n")
    return [js, md]


def free_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what a new allocation can get without swapping)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def append_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Append ``rows`` to a CSV that keeps every earlier row; a new column widens the header (old rows: blank)."""
    import csv

    path = Path(path)
    old_rows: list[dict[str, str]] = []
    fields: list[str] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            old_rows = list(reader)
    for row in rows:
        fields += [k for k in row if k not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(old_rows + rows)
    return path
