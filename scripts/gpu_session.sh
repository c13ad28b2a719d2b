#!/usr/bin/env bash
# The one command for a GPU machine (this workplace's H100/H200: python3 = Python 3.12 with torch 2.11+cu130,
# triton 3.6, pytest, hypothesis, numpy, safetensors, transformers; nvcc 13, ncu, compute-sanitizer; no network).
#
# The device calls of a session, in this order, most valuable first. A call may run 10 minutes and a session has 30
# minutes of device time; a machine stays warm only 30 s after a call, so every call may start on a bare machine
# (about a minute to start). Times are estimates (no GPU has run this script yet); each call stops starting steps
# at CALL_BUDGET_S (default 540 s) and records what did not fit as "rc=125 SKIPPED", to be run in the next call:
#
#   1. bash scripts/gpu_session.sh build ops engine                          (~8 min)
#        the build (sm_90 only, ~4 min), the CUDA op tests (~2 min), the CUDA engine tests (~2 min). $OUT gets the
#        built extension zero_ext/_C.cpython-312-x86_64-linux-gnu.so: copy it from files_at into zero_ext/ of the
#        checkout that travels and name it in `carry` for calls 2 and 3, which then skip the rebuild.
#   2. bash scripts/gpu_session.sh bench overlap ncu ctest                   (~6 min, carry the .so)
#   3. bash scripts/gpu_session.sh memcheck_engine memcheck racecheck        (~6 min, carry the .so)
#      About 20 minutes with the machine starts. Only with more than 12 minutes of device time left:
#   4. bash scripts/gpu_session.sh suite                                     (~8 min: the CPU suite; CI runs it too)
#
# Steps (each with its own timeout, STEP_TIMEOUT_<STEP> seconds, so one hang cannot eat the call):
#   build      pip install --no-build-isolation --no-deps -e .   (this GPU's architecture only: half the nvcc work)
#   ops        pytest -m cuda, every file but tests/test_engine_cuda*.py (the kernels; > 2^31-element tests too)
#   engine     pytest -m cuda tests/test_engine_cuda*.py   (the engine through NCCL, offload, stage 3, 2+ GPUs)
#   test       ops, then engine
#   suite      pytest (the default CPU suite on the GPU machine; the Triton CPU tests run in a subprocess)
#   memcheck   the CUDA op tests under compute-sanitizer memcheck    (caching allocator off: exact OOB)
#   memcheck_engine  a subset of the CUDA engine tests under memcheck (NCCL, side streams, offload copies)
#   racecheck  the shared-memory reductions under racecheck
#   bench      python bench/bench_fused_adamw.py --device cuda
#   overlap    bench/profile_overlap.py at stage 2 and stage 3: the profiler's check that the gradient reduce-scatter
#              overlaps backward (NCCL, one GPU)
#   ncu        one Nsight Compute pass over each kernel (speed of light, occupancy)
#   ctest      the torch-free launcher test (cmake/cuda_compile_check.cmake) on the GPU
# Steps that need the CUDA extension build it first when zero_ext._C lacks the CUDA kernels.
#
# What comes back ($OUT, default ./gpu_out; the device returns at most 8 files): summary.txt (one line per step),
# env.txt (device, versions, missing Python packages), logs.tar.gz (every step's log, the pytest junit files and every
# bench/results file this call wrote, under their repository paths; rewritten after each step, so a call cut off at
# its limit still returns what finished) and, after `build`, the extension. Unpack the results into the repository
# with `tar -xzf logs.tar.gz bench/results` and commit them.
#
# Python packages: every package the steps import is in the GPU image (KINDS.md). One that is missing there travels
# as wheels (/work/.library/device/README.md): put them in .whl/ at the repository root (ignored through
# .git/info/exclude), name .whl in `carry`; this script installs them into /tmp/site and puts that on PYTHONPATH.
#
# Exit status: nonzero if any step failed or was skipped.
set -uo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
ROOT="$(cd "$(dirname "${SELF}")/.." && pwd)"
cd "${ROOT}"
OUT="${OUT:-${ROOT}/gpu_out}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1  # the logs follow the run (a step cut off at its timeout keeps what it printed)
ALL_STEPS=(build ops engine suite memcheck memcheck_engine racecheck bench overlap ncu ctest)
ENGINE_TESTS=(tests/test_engine_cuda*.py)
# The op tests of the CUDA kernels: this file and the shared cpu/cuda op tests that exist.
OP_TESTS=$(ls tests/test_cuda_ops.py tests/test_fused_adamw*.py tests/test_flatten*.py \
  tests/test_sum_squares*.py 2>/dev/null | tr '\n' ' ')
# Under memcheck every launch is checked: a few engine tests that cover each side stream and copy path.
MEMCHECK_ENGINE_TESTS=(tests/test_engine_cuda.py tests/test_engine_cuda_paths.py tests/test_engine_cuda_offload.py)
MEMCHECK_ENGINE_K="(matches_unsharded and dtype0) or delayed_side_streams or (reads_finished_gradients and cpu_stage2 \
and bf16) or fp32_master"  # dtype0: bf16

has_cuda_build() {
  "${PY}" - <<'EOF' >/dev/null 2>&1
import torch
import zero_ext  # noqa: F401
assert torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::fused_adamw_", "CUDA")
EOF
}

run_build() {
  # Only this GPU's architecture unless the caller chose: half the nvcc work of "8.0;9.0".
  if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
    TORCH_CUDA_ARCH_LIST=$("${PY}" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
    export TORCH_CUDA_ARCH_LIST
  fi
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}"
  "${PY}" -m pip install --no-build-isolation --no-deps -v -e . && has_cuda_build && keep_extension
}

keep_extension() {
  # The built extension goes back with $OUT, so that later calls on a fresh machine can carry it instead of
  # rebuilding (at most 16 MiB comes back per file).
  local suffix so
  suffix=$("${PY}" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  so="zero_ext/_C${suffix}"
  if [[ -f "${so}" ]]; then
    cp "${so}" "${OUT}/" && echo "kept ${so} ($(du -h "${so}" | cut -f1)) in \$OUT: carry it in the next calls"
  else
    echo "no ${so} in the source tree: later calls rebuild"
  fi
}

run_overlap() {
  "${PY}" bench/profile_overlap.py &&
    "${PY}" bench/profile_overlap.py --stage 3 --name profile_overlap_cuda_stage3
}

run_ncu() {
  ncu --target-processes all --kernel-name 'regex:fused_adamw|flatten|partial_sums' \
    --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy \
    --section LaunchStats "${PY}" - <<'EOF'
import torch

from zero_ext import ops

n = 1 << 26  # 64M elements: 1 GiB of fp32 state per tensor kind, far beyond L2
master, m, v = (torch.rand(n, device="cuda") for _ in range(3))
grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in [4096 * 1024] * 16 + [768] * 200]
offsets, off = [], 0
for t in tensors:
    offsets.append(off)
    off += t.numel()
flat = torch.empty(off, device="cuda")
for _ in range(4):  # skip 3 of each, profile the 4th
    ops.fused_adamw_(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=10,
                     param_out=out)
    ops.flatten_(flat, tensors, offsets, 0.5)
    ops.sum_squares(master)
torch.cuda.synchronize()
EOF
}

run_ctest() {
  cmake -S . -B build/cmake-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build/cmake-gpu --target cuda_test_launchers &&
    ctest --test-dir build/cmake-gpu -R cuda_test_launchers --output-on-failure
}

# `timeout` starts programs, not shell functions: a step that is a function runs as `bash THIS_SCRIPT
# __run_function NAME`, which defines the functions above and calls NAME (the settings above are recomputed, the
# environment is inherited).
if [[ "${1:-}" == "__run_function" ]]; then
  shift
  "$@"
  exit $?
fi

# ------------------------------------------------------------------------------------------------------------ the run
mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
export OUT  # for the function steps, which run in a child of this script
SUMMARY="${OUT}/summary.txt"
LOGS="${LOG_DIR:-${ROOT}/build/gpu_session/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "${LOGS}"
LOGS="$(cd "${LOGS}" && pwd)"
touch "${LOGS}/.started"  # result files newer than this were written by this call
T_START=$(date +%s)
CALL_BUDGET_S="${CALL_BUDGET_S:-540}"
FAILED=0
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=("${ALL_STEPS[@]}")

record() { echo "$1" | tee -a "${SUMMARY}"; }

pack() {
  # One archive for every log and the result files this call wrote: the device returns at most 8 files.
  (find bench/results -type f -newer "${LOGS}/.started" 2>/dev/null || true) >"${LOGS}/results_written.txt"
  tar -czf "${OUT}/logs.tar.gz.part" -C "$(dirname "${LOGS}")" "$(basename "${LOGS}")" \
    -C "${ROOT}" -T "${LOGS}/results_written.txt" && mv "${OUT}/logs.tar.gz.part" "${OUT}/logs.tar.gz"
}

# step NAME DEFAULT_TIMEOUT CMD...: runs CMD (a program or one of the functions above) with its output in
# LOGS/NAME.log, records the outcome in summary.txt.
step() {
  local name="$1" default_timeout="$2"
  shift 2
  local var="STEP_TIMEOUT_${name^^}"
  local limit="${!var:-${default_timeout}}"
  local left=$((CALL_BUDGET_S - ($(date +%s) - T_START)))
  if ((left < 30)); then
    record "${name}: rc=125 0s SKIPPED (this call's ${CALL_BUDGET_S}s are spent: run it in the next call)"
    FAILED=1
    return 125
  fi
  ((limit <= left)) || limit=${left}
  if declare -F "$1" >/dev/null; then
    set -- bash "${SELF}" __run_function "$@"
  fi
  local log="${LOGS}/${name}.log" t0
  t0=$(date +%s)
  echo "== ${name} (timeout ${limit}s): $*" | tee -a "${log}"
  timeout --kill-after=10 "${limit}" "$@" >>"${log}" 2>&1
  local rc=$?
  local late=""
  [[ ${rc} -eq 124 || ${rc} -eq 137 ]] && late=" TIMED OUT"
  record "${name}: rc=${rc} $(($(date +%s) - t0))s${late}"
  tail -3 "${log}"
  [[ ${rc} -eq 0 ]] || FAILED=1
  pack
  return ${rc}
}

# Steps that import zero_ext's CUDA kernels build them first when they are missing (a fresh machine).
ensure_build() {
  has_cuda_build && return 0
  step build 360 run_build && return 0
  record "build failed: nothing that needs the CUDA extension can run"
  pack
  exit 1
}

run_step() {
  case "$1" in
    build) step build 360 run_build || { record "build failed: nothing else can run"; pack; exit 1; } ;;
    ops)
      ensure_build
      step ops 240 "${PY}" -m pytest -m cuda -q -ra --junitxml="${LOGS}/pytest_ops.xml" \
        --ignore-glob='tests/test_engine_cuda*' tests ;;
    engine)
      ensure_build
      step engine 300 "${PY}" -m pytest -m cuda -q -ra --junitxml="${LOGS}/pytest_engine.xml" "${ENGINE_TESTS[@]}" ;;
    test) run_step ops; run_step engine ;;
    suite)
      ensure_build
      step suite 540 "${PY}" -m pytest -q -ra --junitxml="${LOGS}/pytest_suite.xml" ;;
    memcheck_engine)
      # The engine on one GPU through NCCL (side streams, events, staging, accumulate, the offload copies) under
      # memcheck; the caching allocator stays on here (NCCL and the engine allocate per step), so this finds
      # out-of-bounds accesses past whole allocations and use of freed memory the allocator returned to the driver.
      ensure_build
      step memcheck_engine 240 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 \
        --target-processes all "${PY}" -m pytest -q -x -m "cuda and not slow" "${MEMCHECK_ENGINE_TESTS[@]}" \
        -k "${MEMCHECK_ENGINE_K}" ;;
    memcheck)
      # No caching allocator: every tensor is its own cudaMalloc, so an out-of-bounds access hits
      # unallocated memory instead of a neighbour in the same pool block.
      ensure_build
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 180 compute-sanitizer --tool memcheck \
        --error-exitcode 1 --print-limit 50 --target-processes all \
        "${PY}" -m pytest -q -x -m "not slow" -k "cuda and not large" ${OP_TESTS} ;;
    racecheck)
      ensure_build
      step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 20 \
        "${PY}" -m pytest -q -x -m "not slow" -k "cuda and (sum_squares or hundreds)" \
        tests/test_cuda_ops.py ;;
    bench)
      ensure_build
      step bench 240 "${PY}" bench/bench_fused_adamw.py --device cuda ;;
    overlap)
      ensure_build
      step overlap 180 run_overlap ;;
    ncu)
      ensure_build
      step ncu 150 run_ncu ;;
    ctest) step ctest 180 run_ctest ;;
    *) record "unknown step '$1' (${ALL_STEPS[*]} test)"; FAILED=1 ;;
  esac
}

# Wheels carried in .whl/ (see the top): installed for this call only.
if compgen -G "${ROOT}/.whl/*.whl" >/dev/null; then
  "${PY}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${ROOT}"/.whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:${PYTHONPATH}}"
fi

REV=$(git rev-parse --short HEAD 2>/dev/null) || REV="(not a git checkout)"
[[ "${REV}" == "(not"* ]] || git diff --quiet 2>/dev/null || REV="${REV}+dirty"
{
  echo "# $(date -u +%FT%TZ) ${REV}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  "${PY}" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "${PY}" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
  nvcc --version | tail -2
  # What the steps import: pytest, hypothesis, numpy, safetensors (the suites), transformers + accelerate (the
  # Trainer tests), matplotlib (bench charts). A missing one travels as wheels (see the top).
  "${PY}" - <<'EOF'
import importlib.util
names = ["torch", "triton", "pytest", "hypothesis", "numpy", "safetensors", "transformers", "accelerate", "matplotlib"]
missing = [n for n in names if importlib.util.find_spec(n) is None]
print("missing python packages: " + (", ".join(missing) + " (carry them as wheels: see the top of "
      "scripts/gpu_session.sh)" if missing else "none"))
EOF
} >"${OUT}/env.txt" 2>&1
cat "${OUT}/env.txt"
cp "${OUT}/env.txt" "${LOGS}/env.txt"
echo "# $(date -u +%FT%TZ) steps: ${STEPS[*]} (call budget ${CALL_BUDGET_S}s)" >>"${SUMMARY}"

for s in "${STEPS[@]}"; do
  run_step "${s}"
done
pack
echo "---- summary (${SUMMARY})"
cat "${SUMMARY}"
exit ${FAILED}
