"""Smoke test of the main job: a tiny GPT, 2 steps, 2 gloo processes; it must write its files and agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["--steps", "2", "--vocab", "64", "--seq-len", "16", "--d-model", "32", "--layers", "1", "--heads", "2"]


def test_main_job_tiny(tmp_path):
    cmd = [sys.executable, "bench/main_job.py", *TINY, "--batch", "4", "--device", "cpu", "--world-size", "2"]
    cmd += ["--out-dir", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"main_job.{suffix}").stat().st_size > 0
    assert "PASS stage 1 vs stage 2 bitwise" in proc.stdout

    result = json.loads((tmp_path / "main_job.json").read_text())
    for key in ("device", "date", "commit", "torch", "command"):
        assert result["meta"][key]
    runs = result["runs"]
    assert set(runs) == {"ddp", "zero1", "zero2"}
    assert runs["zero1"]["losses"] == runs["zero2"]["losses"]  # bitwise
    assert runs["zero1"]["param_digest"] == runs["zero2"]["param_digest"]
    for name in ("zero1", "zero2"):
        check = result["checks"][f"{name}_vs_ddp"]
        assert check["ok"] and check["max_abs_loss_diff"] <= check["tolerance_nats"]
        run = runs[name]
        assert len(run["losses"]) == 2 and run["skipped_steps"] == 0
        parts = run["formula_this_rank"] + run["padding"] + run["staging"] + run["grad_shard_fp32"]
        assert parts == run["model_state_total"]
    assert runs["ddp"]["model_state"]["exp_avg"] == 4 * runs["ddp"]["num_params"]

    mem = subprocess.run(
        [sys.executable, "bench/bench_memory_model.py", "--main-job", str(tmp_path / "main_job.json")]
        + ["--out-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert mem.returncode == 0, mem.stdout[-3000:] + mem.stderr[-3000:]
    assert "PASS 7.5B params, 64 ranks: 120.0 / 31.4 / 16.6 / 1.9 GB" in mem.stdout


def test_collectives_tiny(tmp_path):
    """bench_collectives.py on 3 ranks, a small buffer: every contender timed, the files written."""
    cmd = [sys.executable, "bench/bench_collectives.py", "--world-size", "3", "--numel", "5000", "--buckets", "1,2"]
    cmd += ["--reps", "2", "--warmup", "1", "--out-dir", str(tmp_path), "--name", "coll"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "coll.json").read_text())
    assert result["config"]["numel"] % (3 * 2 * 64) == 0 and result["config"]["numel"] >= 5000
    assert len(result["runs"]) == 6 * 2
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in result["runs"].values())
    assert (tmp_path / "coll.md").read_text().count("| all_to_all + sum") == 4
