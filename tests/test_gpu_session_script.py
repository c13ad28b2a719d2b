"""scripts/gpu_session.sh, run here with every tool it calls replaced by a stub on PATH (python3, python, nvidia-smi,
nvcc, ncu, compute-sanitizer, cmake, ctest): each step must start its tools with the expected arguments and record
rc=0 in summary.txt, so that the script cannot rot unseen between GPU sessions (it once handed shell functions to
`timeout`, which starts only programs: every function step failed with rc 127 and the build stopped the session).
The device-call plan at the top of the script must name only real steps and cover every one of them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
TOOLS = ("python3", "python", "nvidia-smi", "nvcc", "ncu", "compute-sanitizer", "cmake", "ctest")
STEPS = ("build", "ops", "engine", "suite", "memcheck", "memcheck_engine", "racecheck", "bench", "overlap", "ncu",
         "ctest")  # fmt: skip

# Each stub appends one line to $STUB_CALLS: its name and arguments, then the first line of its stdin when it is
# fed a program on stdin (`python3 -`). STUB_FAIL=<tool> makes that tool exit with status 3.
STUB = """#!/usr/bin/env bash
name="$(basename "$0")"
line="${name} $*"
if [[ " $* " == *" - "* || "$*" == "-" || "$*" == *" -" ]]; then
  line="${line} <<< $(head -1)"
fi
echo "${line}" >>"${STUB_CALLS}"
[[ "${STUB_FAIL:-}" == "${name}" ]] && exit 3
exit 0
"""

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")  # fmt: skip


def _run(tmp_path, *steps, fail=None, budget=None):
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for tool in TOOLS:
        path = stubs / tool
        path.write_text(STUB)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    calls, out, logs = tmp_path / "calls.txt", tmp_path / "out", tmp_path / "logs"
    calls.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CALL_BUDGET_S", "LOG_DIR", "OUT")}
    env.update(PATH=f"{stubs}:/usr/bin:/bin", OUT=str(out), LOG_DIR=str(logs), STUB_CALLS=str(calls))
    env.pop("STUB_FAIL", None)
    if fail is not None:
        env["STUB_FAIL"] = fail
    if budget is not None:
        env["CALL_BUDGET_S"] = str(budget)
    proc = subprocess.run(["bash", str(SCRIPT), *steps], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return proc, summary, calls.read_text().splitlines(), out


def _rc(summary: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+): rc=(-?\d+)", summary, re.M)}


def _calls_of(calls, tool):
    return [c for c in calls if c.split(" ", 1)[0] == tool]


@pytest.mark.slow
@needs_bash
def test_build_test_and_ncu_run_their_tools_and_record_rc_0(tmp_path):
    proc, summary, calls, out = _run(tmp_path, "build", "test", "ncu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _rc(summary) == {"build": 0, "ops": 0, "engine": 0, "ncu": 0}, summary
    py = _calls_of(calls, "python3")
    assert "python3 -m pip install --no-build-isolation --no-deps -v -e ." in py, calls
    assert not _calls_of(calls, "python"), "the GPU image's interpreter is python3"
    ops = [c for c in py if c.startswith("python3 -m pytest -m cuda") and "--ignore-glob=tests/test_engine_cuda*" in c]
    engine = [c for c in py if c.startswith("python3 -m pytest -m cuda") and "tests/test_engine_cuda.py" in c]
    assert len(ops) == 1 and len(engine) == 1, py
    for path in sorted(ROOT.glob("tests/test_engine_cuda*.py")):  # every engine test file, new ones included
        assert f"tests/{path.name}" in engine[0].split(), f"the engine step misses {path.name}: {engine[0]}"
    (ncu,) = _calls_of(calls, "ncu")
    assert ncu.startswith("ncu --target-processes all --kernel-name regex:fused_adamw|flatten|partial_sums")
    assert ncu.endswith("python3 - <<< import torch"), ncu  # the profiled program arrives on stdin
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {"build.log", "ops.log", "engine.log", "ncu.log", "env.txt"} <= logs, logs
    assert len([p for p in out.iterdir() if p.is_file()]) <= 8, "the device returns at most 8 files"


@pytest.mark.slow
@needs_bash
def test_every_step_runs_and_records_rc_0(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, *STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _rc(summary) == dict.fromkeys(STEPS, 0), summary
    expected = {
        "suite": "python3 -m pytest -q -ra --junitxml=",
        "bench": "python3 bench/bench_fused_adamw.py --device cuda",
        "overlap": "python3 bench/profile_overlap.py --stage 3 --name profile_overlap_cuda_stage3",
        "memcheck": "compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 --target-processes all "
        "python3 -m pytest -q -x -m not slow -k cuda and not large tests/test_cuda_ops.py",
        "memcheck_engine": "compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 --target-processes "
        "all python3 -m pytest -q -x -m cuda and not slow tests/test_engine_cuda.py",
        "racecheck": "compute-sanitizer --tool racecheck",
        "ctest": "ctest --test-dir build/cmake-gpu -R cuda_test_launchers --output-on-failure",
        "cmake": "cmake --build build/cmake-gpu --target cuda_test_launchers",
    }
    for what, prefix in expected.items():
        assert any(c.startswith(prefix) for c in calls), f"{what}: no call starting {prefix!r} in {calls}"
    assert any(c.startswith("nvidia-smi --query-gpu=") for c in calls) and any(c == "nvcc --version" for c in calls)


@needs_bash
@pytest.mark.parametrize("tool,step", [("ncu", "ncu"), ("cmake", "ctest"), ("compute-sanitizer", "racecheck")])
def test_a_failing_tool_fails_its_step_and_the_script(tmp_path, tool, step):
    proc, summary, _, _ = _run(tmp_path, "ops", step, fail=tool)
    assert _rc(summary) == {"ops": 0, step: 3}, summary
    assert proc.returncode == 1


@needs_bash
def test_a_failed_build_stops_the_call(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, "build", "ops", fail="python3")
    assert proc.returncode == 1 and "build failed" in summary and "ops:" not in summary, summary


@needs_bash
def test_steps_past_the_call_budget_are_skipped_and_reported(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, "ops", "bench", budget=0)
    assert _rc(summary) == {"ops": 125, "bench": 125} and "SKIPPED" in summary, summary
    assert proc.returncode == 1
    assert not [c for c in calls if "pytest" in c or "bench_fused_adamw" in c], calls


def test_the_device_call_plan_names_real_steps_and_covers_them_all():
    text = SCRIPT.read_text()
    plan = re.findall(r"^#\s+\d\. bash scripts/gpu_session\.sh ([a-z_ ]+?)\s*(?:\(|$)", text, re.M)
    assert len(plan) >= 3, plan
    named = [s for call in plan for s in call.split()]
    assert set(named) == set(STEPS), f"the plan {plan} must run every step once: {sorted(set(STEPS) ^ set(named))}"
    assert len(named) == len(set(named)), plan
    assert plan[0].split()[0] == "build", "the first call builds"
    (listed,) = re.findall(r"^MEMCHECK_ENGINE_TESTS=\((.*)\)$", text, re.M)
    for path in listed.split():
        assert (ROOT / path).is_file(), f"memcheck_engine names {path}, which does not exist"


@pytest.mark.slow
def test_the_memcheck_engine_subset_selects_tests_of_every_file_it_names():
    """The subset is a -k expression over parametrized names (an id that changes selects nothing, silently)."""
    text = SCRIPT.read_text()
    (listed,) = re.findall(r"^MEMCHECK_ENGINE_TESTS=\((.*)\)$", text, re.M)
    (k,) = re.findall(r'^MEMCHECK_ENGINE_K="(.*?)"', text, re.M | re.S)
    k = k.replace("\\\n", "")
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda and not slow",
           *listed.split(), "-k", k]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    selected = [line for line in proc.stdout.splitlines() if "::" in line]
    for path in listed.split():
        assert any(line.startswith(path + "::") for line in selected), f"-k {k!r} selects nothing in {path}"
    assert len(selected) <= 12, f"{len(selected)} tests under memcheck: too many for one device call"
