"""bench/bench_sleep_wake.py at a tiny size, as a user runs it, checked through the JSON result it writes (slow: a
process of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_sleep_wake_smoke(tmp_path):
    cmd = [sys.executable, "bench/bench_sleep_wake.py", "--params", "3e5", "--dim", "256", "--reps", "1",
           "--out-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "sleep_wake_cpu.json").read_text())
    assert data["meta"]["command"].startswith("python bench/bench_sleep_wake.py")
    res = data["result"]
    assert res["bytes"] > 0 and all(len(v) == 1 for v in res["times"].values())
    for policy in ("kept", "per_cycle"):
        mem = res["memory"][policy]
        assert mem["after_offload"]["optimizer_device_bytes"] == 0
        assert mem["after_reload"]["optimizer_device_bytes"] == mem["before"]["optimizer_device_bytes"] == res["bytes"]
