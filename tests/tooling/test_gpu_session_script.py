"""scripts/gpu_session.sh, run here with every tool it calls replaced by a stub on PATH (python3, python, nvidia-smi,
nvcc, ncu, compute-sanitizer, cmake, ctest), in a copy of the repository's shape (the script, the test file names, an
empty bench/results, a fake built extension): each step must start its tools with the expected arguments and record
its outcome in summary.txt, so that the script cannot rot unseen between GPU sessions (it once handed shell functions
to `timeout`, which starts only programs: every function step failed with rc 127 and the build stopped the session).

The session's two device calls fit 15 minutes of device time: `call1` runs exactly build, ops and engine, `call2`
bench and memcheck, each under its budget (9.5 and 2.7 minutes); the pytest commands of the plan, collected here,
select every test marked cuda; a step that no longer fits is recorded SKIPPED; the results come back packed."""

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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
TOOLS = ("python3", "python", "nvidia-smi", "nvcc", "ncu", "compute-sanitizer", "cmake", "ctest")
STEPS = ("build", "ops", "engine", "engine_one", "suite", "memcheck", "memcheck_engine", "racecheck", "bench",
         "overlap", "ncu", "ctest")  # fmt: skip
PLANS = {"call1": (("build", "ops", "engine"), 570), "call2": (("bench", "memcheck"), 160)}
DEVICE_S = 15 * 60  # a session's device time: one machine start (~90 s), the calls, 30 s of idling between them
SO = "_C.cpython-312-x86_64-linux-gnu.so"  # the GPU image's Python 3.12

# Each stub appends one line to $STUB_CALLS: its name and arguments, then the first line of its stdin when it is
# fed a program on stdin (`python3 -`). STUB_FAIL=<tool> makes that tool exit with status 3; STUB_SLEEP=<text>=<s>
# makes a call whose arguments contain <text> take <s> seconds. python3 answers the script's two questions (the
# extension suffix, the GPU's architecture), prints $STUB_PYTEST_OUTPUT for pytest, and a bench script writes a
# result file, as the real ones do.
STUB = """#!/usr/bin/env bash
name="$(basename "$0")"
line="${name} $*"
if [[ " $* " == *" - "* || "$*" == "-" || "$*" == *" -" ]]; then
  line="${line} <<< $(head -1)"
fi
echo "${line}" >>"${STUB_CALLS}"
[[ "${STUB_FAIL:-}" == "${name}" ]] && exit 3
if [[ -n "${STUB_SLEEP:-}" && "$*" == *"${STUB_SLEEP%=*}"* ]]; then
  sleep "${STUB_SLEEP##*=}"
fi
if [[ "${name}" == python3 ]]; then
  case "$*" in
    *EXT_SUFFIX*) echo ".cpython-312-x86_64-linux-gnu.so" ;;
    *get_device_capability*) echo "9.0" ;;
    *"-m pytest"*) [[ -z "${STUB_PYTEST_OUTPUT:-}" ]] || cat "${STUB_PYTEST_OUTPUT}" ;;
    bench/*.py*) mkdir -p bench/results && echo stub >"bench/results/stub_$(basename "$1" .py).txt" ;;
  esac
fi
exit 0
"""
# What pytest prints at the end of a one-GPU engine_one run.
PYTEST_OUTPUT = """SKIPPED [1] tests/engine/test_engine_cuda_multi_gpu.py:125: needs 2 GPUs, found 1
SKIPPED [1] tests/engine/test_engine_cuda_multi_gpu.py:125: needs 3 GPUs, found 1
1 passed, 2 skipped, 13 deselected in 21.07s
"""

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")  # fmt: skip


def _repo(tmp_path) -> Path:
    """The repository's shape: the script, every test file's name (the script lists some by glob), bench/results,
    and an extension where the build leaves it."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / SCRIPT.name)
    for path in ROOT.glob("tests/**/*.py"):
        (repo / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (repo / path.relative_to(ROOT)).write_text("")
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "zero_ext" / "ops").mkdir(parents=True)
    (repo / "zero_ext" / "ops" / SO).write_bytes(b"\x7fELF")
    return repo


def _run(tmp_path, *steps, fail=None, budget=None, env_extra=None):
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for tool in TOOLS:
        path = stubs / tool
        path.write_text(STUB)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    repo = _repo(tmp_path)
    calls, out, logs = tmp_path / "calls.txt", tmp_path / "out", tmp_path / "logs"
    calls.write_text("")
    (tmp_path / "pytest_output.txt").write_text(PYTEST_OUTPUT)
    drop = ("PYTHON", "PYTHONPATH", "CALL_BUDGET_S", "MIN_STEP_S", "LOG_DIR", "OUT", "TORCH_CUDA_ARCH_LIST")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("STUB_", "STEP_TIMEOUT_"))}
    env.update(PATH=f"{stubs}:/usr/bin:/bin", OUT=str(out), LOG_DIR=str(logs), STUB_CALLS=str(calls),
               STUB_PYTEST_OUTPUT=str(tmp_path / "pytest_output.txt"), **(env_extra or {}))  # fmt: skip
    if fail is not None:
        env["STUB_FAIL"] = fail
    if budget is not None:
        env["CALL_BUDGET_S"] = str(budget)
    proc = subprocess.run(["bash", str(repo / "scripts" / SCRIPT.name), *steps], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return proc, summary, calls.read_text().splitlines(), out


def _rc(summary: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+): rc=(-?\d+)", summary, re.M)}


def _calls_of(calls, tool):
    return [c for c in calls if c.split(" ", 1)[0] == tool]


def _timeouts(stdout: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^== (\w+) \(timeout (\d+)s\)", stdout, re.M)}


def _packed(out: Path) -> set[str]:
    with tarfile.open(out / "logs.tar.gz") as tar:
        return set(tar.getnames())


def _var(name: str) -> str:
    """A variable of the script as written: NAME=(...) (an array) or NAME="..." (line continuations joined)."""
    text = SCRIPT.read_text()
    m = re.search(rf"^{name}=\((.*?)\)$", text, re.M | re.S) or re.search(rf'^{name}="(.*?)"', text, re.M | re.S)
    assert m, f"no {name}= in the script"
    return m.group(1).replace("\\\n", "")


def _files(pattern_list: str) -> list[str]:
    """The test files a script array names, its globs expanded as bash does in the repository root."""
    return sorted({str(p.relative_to(ROOT)) for pat in pattern_list.split() for p in ROOT.glob(pat)})


def _pytest_args(call: str) -> list[str]:
    """A stub's record of a pytest call, from `-m pytest` on (the plan's pytest calls have no -k with spaces)."""
    args = call.split()
    return args[args.index("pytest") + 1 :]


@needs_bash
def test_call1_builds_for_this_gpu_then_runs_every_cuda_test(tmp_path):
    proc, summary, calls, out = _run(tmp_path, "call1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, budget = PLANS["call1"]
    assert list(_rc(summary)) == list(steps) and set(_rc(summary).values()) == {0}, summary
    assert f"call1: {' '.join(steps)} (call budget " in summary
    assert int(re.search(r"call budget (\d+)s", summary).group(1)) <= budget, summary
    timeouts = _timeouts(proc.stdout)
    assert list(timeouts) == list(steps) and sum(timeouts.values()) <= budget, timeouts  # each step fits whole
    py = [c for c in _calls_of(calls, "python3") if "-m pip" in c or "-m pytest" in c or "bench/" in c]
    assert len(py) == 3, py
    assert py[0] == "python3 -m pip install --no-build-isolation --no-deps -v -e .", py
    ops, engine = py[1].split(), py[2].split()
    assert ops[:5] == ["python3", "-m", "pytest", "-q", "-ra"] and "cuda" in ops, ops
    kernel_files = _files(_var("KERNEL_TESTS"))
    assert sorted(a for a in ops if a.startswith("tests/")) == kernel_files, ops
    assert not [f for f in kernel_files if "engine" in f]
    # engine: every test file but the kernel files, the cuda ones only.
    assert engine[:5] == ["python3", "-m", "pytest", "-q", "-ra"], engine
    assert engine[engine.index("-m", 3) + 1] == "cuda", engine
    ignored = sorted(a.removeprefix("--ignore=") for a in engine if a.startswith("--ignore="))
    assert ignored == kernel_files and engine[-1] == "tests", engine
    assert not _calls_of(calls, "python") and not _calls_of(calls, "compute-sanitizer") and not _calls_of(calls, "ncu")
    assert "TORCH_CUDA_ARCH_LIST=9.0" in (tmp_path / "logs" / "build.log").read_text()  # this GPU's only
    # The multi-GPU tests' skip reasons and pytest's tally show in the summary.
    assert "engine: rc=0" in summary and "(1 passed, 2 skipped, 13 deselected in 21.07s)" in summary, summary
    assert "    SKIPPED [1] tests/engine/test_engine_cuda_multi_gpu.py:125: needs 3 GPUs, found 1" in summary, summary
    # Packed: the built extension to carry, every log, the result files written and this call's record.
    assert (out / SO).read_bytes() == b"\x7fELF"
    files = [p.name for p in out.iterdir() if p.is_file()]
    assert len(files) <= 8 and {"summary.txt", "env.txt", "logs.tar.gz", SO} <= set(files), files
    names = _packed(out)
    assert {"build.log", "ops.log", "engine.log", "env.txt"} <= {Path(n).name for n in names}
    assert "bench/results/gpu_session_call1.md" in names, names
    record = (tmp_path / "repo" / "bench" / "results" / "gpu_session_call1.md").read_text()
    assert "engine: rc=0" in record and "nvidia-smi" not in record  # env.txt and the summary, not commands


@needs_bash
def test_call2_benches_and_memchecks_the_kernels_with_the_carried_build(tmp_path):
    proc, summary, calls, out = _run(tmp_path, "call2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, budget = PLANS["call2"]
    assert list(_rc(summary)) == list(steps) and set(_rc(summary).values()) == {0}, summary
    timeouts = _timeouts(proc.stdout)
    assert list(timeouts) == list(steps) and sum(timeouts.values()) <= budget, timeouts
    assert int(re.search(r"call budget (\d+)s", summary).group(1)) <= budget, summary
    assert not [c for c in calls if "pip install" in c], "the carried extension is used, not rebuilt"
    assert "python3 bench/bench_fused_adamw.py --device cuda --precision" in _calls_of(calls, "python3"), calls
    (memcheck,) = _calls_of(calls, "compute-sanitizer")
    assert memcheck.startswith("compute-sanitizer --tool memcheck --error-exitcode 1"), memcheck
    for path in _var("MEMCHECK_TESTS").split():
        assert f" {path} " in memcheck, memcheck
    assert " -k (test_cuda_matches_cpu and " in memcheck, memcheck
    assert {"bench/results/stub_bench_fused_adamw.txt", "bench/results/gpu_session_call2.md"} <= _packed(out)


def test_the_two_calls_fit_the_sessions_device_time():
    """At every step's time limit: a machine start, call 1, the idle wait, call 2 on the warm machine."""
    start_s, idle_s = 90, 30
    assert start_s + PLANS["call1"][1] + idle_s + PLANS["call2"][1] <= DEVICE_S
    assert PLANS["call1"][1] <= 600 - 30 and PLANS["call2"][1] <= 600 - 30  # one run() lasts at most 600 s


@pytest.mark.slow
@needs_bash
def test_the_plan_runs_every_test_marked_cuda(tmp_path):
    """The pytest commands the two calls issue, collected here as the GPU machine would (-m cuda), select every test
    marked cuda in tests/: a CUDA test written ahead cannot miss the session (a new file, a -k that drops one)."""
    planned = set()
    for call in PLANS:
        (tmp_path / call).mkdir()
        _, _, calls, _ = _run(tmp_path / call, call)
        for c in calls:
            if c.startswith("python3 -m pytest"):
                report = ("-q", "-ra") + tuple(a for a in _pytest_args(c) if a.startswith(("--junitxml=", "--dur")))
                args = [a for a in _pytest_args(c) if a not in report]  # what selects, not what reports
                planned |= set(_collect_args(args))
    every = set(_collect_args(["-m", "cuda", "tests"]))
    assert len(every) > 100 and every - planned == set(), sorted(every - planned)[:20]


@pytest.mark.slow
@needs_bash
def test_a_step_past_the_call_budget_is_skipped_and_reported(tmp_path):
    """ops takes 7 s of a 10 s budget: engine, left with less than MIN_STEP_S, is not started."""
    env = dict(MIN_STEP_S="5", STUB_SLEEP="test_cuda_ops.py=7")
    proc, summary, calls, out = _run(tmp_path, "call1", budget=10, env_extra=env)
    rc = _rc(summary)
    assert list(rc) == list(PLANS["call1"][0]) and rc["build"] == 0 and rc["ops"] in (0, 124), summary
    assert rc["engine"] == 125 and re.search(r"^engine: rc=125 0s SKIPPED", summary, re.M), summary
    assert proc.returncode == 1
    assert not [c for c in calls if "--ignore=" in c], calls
    assert "engine: rc=125" in (out / "summary.txt").read_text() and "ops.log" in str(_packed(out))


@needs_bash
def test_steps_past_a_spent_budget_are_skipped(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, "ops", "bench", budget=0)
    assert _rc(summary) == {"ops": 125, "bench": 125} and "SKIPPED" in summary, summary
    assert proc.returncode == 1
    assert not [c for c in calls if "pytest" in c or "bench_fused_adamw" in c], calls


@pytest.mark.slow
@needs_bash
def test_every_step_runs_and_records_rc_0(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, *STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _rc(summary) == dict.fromkeys(STEPS, 0), summary
    expected = {
        "suite": "python3 -m pytest -q -ra --durations=10 --junitxml=",
        "memcheck_engine": "compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 --target-processes "
        "all python3 -m pytest -q -x -m cuda and not slow tests/engine/test_engine_cuda.py",
        "racecheck": "compute-sanitizer --tool racecheck",
        "ncu": "ncu --target-processes all --kernel-name regex:fused_adamw|flatten|partial_sums",
        "ctest": "ctest --test-dir build/cmake-gpu -R cuda_test_launchers --output-on-failure",
        "cmake": "cmake --build build/cmake-gpu --target cuda_test_launchers",
    }
    for what, prefix in expected.items():
        assert any(c.startswith(prefix) for c in calls), f"{what}: no call starting {prefix!r} in {calls}"
    (ncu,) = _calls_of(calls, "ncu")
    assert ncu.endswith("python3 - <<< import torch"), ncu  # the profiled program arrives on stdin
    # engine: every CUDA test the kernel step does not run.
    (engine,) = [c for c in calls if c.startswith("python3 -m pytest") and "--ignore=" in c]
    ignored = sorted(a.removeprefix("--ignore=") for a in engine.split() if a.startswith("--ignore="))
    assert ignored == _files(_var("KERNEL_TESTS")) and engine.endswith(" tests"), engine
    assert any(c.startswith("nvidia-smi --query-gpu=") for c in calls) and any(c == "nvcc --version" for c in calls)


@needs_bash
@pytest.mark.parametrize("tool,step", [("ncu", "ncu"), ("cmake", "ctest"), ("compute-sanitizer", "racecheck")])
def test_a_failing_tool_fails_its_step_and_the_script(tmp_path, tool, step):
    proc, summary, _, _ = _run(tmp_path, "ops", step, fail=tool)
    assert _rc(summary) == {"ops": 0, step: 3}, summary
    assert proc.returncode == 1


@needs_bash
def test_a_failed_build_stops_the_call(tmp_path):
    proc, summary, calls, _ = _run(tmp_path, "call1", fail="python3")
    assert proc.returncode == 1 and "build failed" in summary and "ops:" not in summary, summary


def test_the_header_plans_two_calls_and_names_every_step():
    text = SCRIPT.read_text()
    header = text[: text.index("set -uo pipefail")]
    plan = re.findall(r"^#\s+\d\. bash scripts/gpu_session\.sh (\w+)\s+\(~(\d+) min, at most (\d+) s", header, re.M)
    assert [name for name, _, _ in plan] == list(PLANS), plan
    budgets = dict(re.findall(r"\[(\w+)\]=(\d+)", _var("declare -A PLAN_BUDGET_S")))
    for name, minutes, budget in plan:  # the estimate inside the budget, the budget as the script has it
        assert int(minutes) * 60 <= int(budget) == int(budgets[name]) <= PLANS[name][1], (name, minutes, budget)
    assert "15 minutes of device time" in header
    for s in STEPS:
        assert re.search(rf"^#\s+{s}\s", header, re.M), f"the header does not describe step {s}"
    for name in ("KERNEL_TESTS", "ENGINE_ONE_TESTS", "MEMCHECK_TESTS", "MEMCHECK_ENGINE_TESTS"):
        for pattern in _var(name).split():
            assert list(ROOT.glob(pattern)), f"{name} names {pattern}, which matches no file"


def _collect_args(args: list[str]) -> list[str]:
    """The test ids pytest collects here with these arguments, from the repository root."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _collect(files: str, k: str, marks: str) -> list[str]:
    return _collect_args(["-m", marks, *files.split(), "-k", k])


@pytest.mark.slow
@pytest.mark.parametrize("files,k,most", [("MEMCHECK_ENGINE_TESTS", "MEMCHECK_ENGINE_K", 12),
                                          ("MEMCHECK_TESTS", "MEMCHECK_K", 16)])  # fmt: skip
def test_the_memcheck_subsets_select_tests_of_every_file_they_name(files, k, most):
    """Each subset is a -k expression over parametrized names (an id that changes selects nothing, silently)."""
    selected = _collect(_var(files), _var(k), "cuda and not slow")
    for path in _var(files).split():
        assert any(line.startswith(path + "::") for line in selected), f"-k {_var(k)!r} selects nothing in {path}"
    assert len(selected) <= most, f"{len(selected)} tests under memcheck: too many for one device call"


@pytest.mark.slow
def test_engine_one_selects_one_engine_test_and_the_multi_gpu_tests():
    selected = _collect(_var("ENGINE_ONE_TESTS"), _var("ENGINE_ONE_K"), "cuda")
    one = [s for s in selected if s.startswith("tests/engine/test_engine_cuda.py::")]
    assert one == ["tests/engine/test_engine_cuda.py::test_cuda_matches_unsharded_adamw[through_nccl-dtype0-2]"], (
        selected
    )
    multi = [s for s in selected if s.startswith("tests/engine/test_engine_cuda_multi_gpu.py::")]
    assert len(multi) == 2 and len(selected) == 3, selected
