#!/usr/bin/env bash
# The one command for a GPU machine (this workplace's H100/H200: python3 = Python 3.12 with torch 2.11+cu130,
# triton 3.6, pytest, hypothesis, numpy, safetensors, transformers; nvcc 13, ncu, compute-sanitizer; no network).
#
# A session has 15 minutes of device time in all, on one GPU (H100 or H200): each machine start (1-2 minutes), the
# transfers, the 30 s a machine idles after a call and the calls themselves count. Two calls, most valuable first.
# Times are estimates (no GPU has run this script yet); each call stops starting steps at its budget (CALL_BUDGET_S,
# default the plan's) and records what did not fit as "rc=125 SKIPPED", so a call always ends inside it:
#
#   1. bash scripts/gpu_session.sh call1   (~7 min, at most 570 s; run(timeout_s=600))
#        build       this GPU's architecture only (~3 min, timeout 240 s); $OUT gets the built extension
#                    zero_ext/ops/_C.cpython-312-x86_64-linux-gnu.so
#        ops         pytest -m cuda on the kernel test files, the int8 register kernel's among them (~2 min, 150 s)
#        engine      pytest -m cuda on every other test file: the engine through NCCL, offload, stage 3's memory,
#                    bf16 moments, RL offload/reload, ZeroMuon through NCCL (torchrun), the HSDP 2x2 mesh; the ones
#                    that need 2+ GPUs skip saying how many they need and found (~2.5 min, 180 s). ops and engine
#                    together select every test marked cuda (tests/tooling/test_gpu_session_script.py checks it)
#   2. bash scripts/gpu_session.sh call2   (~2 min, at most 160 s; run(timeout_s=240), carry the .so)
#        bench       bench/bench_fused_adamw.py --device cuda --precision: GB/s and % of a copy measured in the
#                    same run for the default step and every precision setting (remainders, bf16 and int8 moments),
#                    against the >= 85 % target, and each setting's time over the default's (issue 37) (~25 s, 40 s)
#        memcheck    a short subset of the kernel tests under compute-sanitizer memcheck (~1.5 min, 120 s)
#
#   Between the calls: copy the .so from files_at into zero_ext/ops/ of this checkout and name it in call 2's `carry`
#   (a fresh machine has no build; a warm one keeps it, and carrying it costs nothing). Make call 2 at once: within
#   30 s the machine is still warm and call 2 skips a start. Device time, expected: ~1.5 (start) + ~7 + 0.5 + ~2 =
#   ~11 minutes, ~12.5 if call 2 starts a fresh machine. At the budgets' limits: 1.5 + 9.5 + 0.5 + 2.7 = 14.2 on
#   the warm machine, 15.7 with a second start, where the session's time runs out inside call 2 (its memcheck is
#   cut; what finished comes back). No time is left for a rerun: a step that failed or was SKIPPED goes to the
#   next session. Then give_back.
#
#   Results: unpack them into the repository with `tar -xzf logs.tar.gz bench/results` (the bench and overlap
#   result files, which carry device, date and commit, and gpu_session_<plan>.md: this call's env.txt and summary)
#   and commit them under bench/results/ with a message naming the device, the date and the commit the call ran at
#   (env.txt's first lines). Step logs, the pytest junit files and --durations stay in logs.tar.gz (read them to
#   replan: the slowest tests are listed).
#
# Other steps, each runnable by name (`bash scripts/gpu_session.sh engine ncu`; default call budget 540 s), for a
# session with device time to spare; not in the two-call plan:
#   engine_one  one engine test through NCCL at one rank, and the multi-GPU tests (a quick check, ~25 s)
#   overlap    bench/profile_overlap.py at stage 2 and 3 (~1 min)
#   test       ops, then engine
#   suite      pytest (the default CPU suite on the GPU machine; CI runs it too) (~8 min)
#   memcheck_engine  a subset of the CUDA engine tests under memcheck (NCCL, side streams, offload copies)
#   racecheck  the shared-memory reductions under racecheck
#   ncu        one Nsight Compute pass over each kernel (speed of light, occupancy)
#   ctest      the torch-free launcher test (cmake/cuda_compile_check.cmake) on the GPU
# Each step has its own timeout (STEP_TIMEOUT_<STEP> seconds overrides it), so one hang cannot eat the call. Steps
# that need the CUDA extension build it first when zero_ext.ops._C lacks the CUDA kernels. The repository root is put
# on PYTHONPATH, so a carried extension is what every step imports.
#
# What comes back ($OUT, default ./gpu_out; the device returns at most 8 files): summary.txt (one line per step with
# its exit status, time and pytest's tally; the reasons of skipped tests indented under it), env.txt (device,
# versions, missing Python packages), logs.tar.gz (every step's log, the pytest junit files and every bench/results
# file this call wrote, under their repository paths; rewritten after each step, so a call cut off at its limit
# still returns what finished) and, after `build`, the extension.
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
# The bench scripts put only bench/ on sys.path: without this a carried extension (no pip install) is not found.
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
ALL_STEPS=(build ops engine engine_one suite memcheck memcheck_engine racecheck bench overlap ncu ctest)
# The two device calls of a session (see the top) and each one's budget in seconds: the sum of its steps' timeouts,
# so every step gets its whole timeout even when the ones before it use theirs.
declare -A PLANS=([call1]="build ops engine" [call2]="bench memcheck")
declare -A PLAN_BUDGET_S=([call1]=570 [call2]=160)
# The kernel tests (`ops`); `engine` runs every other CUDA test.
KERNEL_TESTS=(tests/kernels/test_cuda_ops.py tests/kernels/test_fused_adamw*.py tests/kernels/test_flatten*.py
  tests/kernels/test_sum_squares*.py tests/kernels/test_master_split.py tests/kernels/test_ops_opcheck.py
  tests/kernels/test_triton_kernels.py tests/kernels/test_op_build.py)
KERNEL_IGNORES=("${KERNEL_TESTS[@]/#/--ignore=}")
# One engine test through NCCL at one rank (stage 2, bf16: side streams, events, Triton staging, reduce-scatter,
# the kernels, against torch.optim.AdamW every step), and the multi-GPU tests: on one GPU they skip and the summary
# shows their reason (how many GPUs they need and found).
ENGINE_ONE_TESTS=(tests/engine/test_engine_cuda.py tests/engine/test_engine_cuda_multi_gpu.py)
ENGINE_ONE_K="test_cuda_matches_unsharded_adamw and through_nccl-dtype0-2 or \
test_stage3_and_offload_through_nccl_match_the_reference"
# Under memcheck every launch is checked and slow: one small case of each kernel family (fp32 / amsgrad / unaligned
# fused_adamw_, bf16 moments with remainders, int8 and int8 amsgrad, master split, flatten, sum_squares).
MEMCHECK_TESTS=(tests/kernels/test_cuda_ops.py tests/kernels/test_fused_adamw_bf16_moments.py
  tests/kernels/test_fused_adamw_int8.py tests/kernels/test_fused_adamw_int8_amsgrad.py tests/kernels/test_master_split.py)
MEMCHECK_K="(test_cuda_matches_cpu and 1025-bf16-bf16_out) or (amsgrad_maximize and 1025-bf16-True-True) \
or (unaligned_views_take_the_scalar_path and 3-bf16) or hundreds_of_tensors or sum_squares_nonfinite_flag \
or (test_cuda_is_the_reference_bitwise and 1025-bf16_remainders-amsgrad-unaligned) \
or (test_cuda_matches_the_cpu_kernel and bf16-1025-64) or (test_cuda_remainder_mode_matches_cpu and 1025)"
# A few engine tests that cover each side stream and copy path.
MEMCHECK_ENGINE_TESTS=(tests/engine/test_engine_cuda.py tests/engine/test_engine_cuda_paths.py
  tests/engine/test_engine_cuda_offload.py)
MEMCHECK_ENGINE_K="(matches_unsharded and dtype0) or delayed_side_streams or (reads_finished_gradients and cpu_stage2 \
and bf16) or fp32_master"  # dtype0: bf16
PYTEST=("${PY}" -m pytest -q -ra --durations=10)

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
  so="zero_ext/ops/_C${suffix}"
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
# A plan's name stands for its steps; one plan alone runs under its budget.
STEPS=()
for arg in "${@:-}"; do
  if [[ -n "${arg}" && -n "${PLANS[${arg}]:-}" ]]; then
    read -ra plan_steps <<<"${PLANS[${arg}]}"
    STEPS+=("${plan_steps[@]}")
  elif [[ -n "${arg}" ]]; then
    STEPS+=("${arg}")
  fi
done
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=("${ALL_STEPS[@]}")
PLAN="steps"
if [[ $# -eq 1 && -n "${PLANS[$1]:-}" ]]; then
  PLAN="$1"
  CALL_BUDGET_S="${CALL_BUDGET_S:-${PLAN_BUDGET_S[$1]}}"
fi
CALL_BUDGET_S="${CALL_BUDGET_S:-540}"
MIN_STEP_S="${MIN_STEP_S:-30}"  # a step is not started with less of the call's budget left
RECORD="bench/results/gpu_session_${PLAN}.md"
FAILED=0

record() { echo "$1" | tee -a "${SUMMARY}"; }

pack() {
  # This call's record under bench/results (committed with the results), then one archive for every log and the
  # result files this call wrote: the device returns at most 8 files.
  mkdir -p "$(dirname "${RECORD}")"
  { echo "# gpu_session.sh ${PLAN}"; echo; echo '```'; cat "${OUT}/env.txt" "${SUMMARY}"; echo '```'; } >"${RECORD}"
  (find bench/results -type f -newer "${LOGS}/.started" 2>/dev/null || true) >"${LOGS}/results_written.txt"
  tar -czf "${OUT}/logs.tar.gz.part" -C "$(dirname "${LOGS}")" "$(basename "${LOGS}")" \
    -C "${ROOT}" -T "${LOGS}/results_written.txt" && mv "${OUT}/logs.tar.gz.part" "${OUT}/logs.tar.gz"
}

# pytest's tally ("1 passed, 2 skipped in 3.1s") from a step's log, empty when it has none.
pytest_tally() {
  grep -E '^[= ]*([0-9]+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b|no tests ran)' \
    "$1" | tail -1 | sed -E 's/^=+ //; s/ =+$//'
}

# step NAME DEFAULT_TIMEOUT CMD...: runs CMD (a program or one of the functions above) with its output in
# LOGS/NAME.log, records the outcome in summary.txt: exit status, time, pytest's tally, and the reasons of skipped
# tests (a multi-GPU test on one GPU says how many GPUs it found) on indented lines below.
step() {
  local name="$1" default_timeout="$2"
  shift 2
  local var="STEP_TIMEOUT_${name^^}"
  local limit="${!var:-${default_timeout}}"
  local left=$((CALL_BUDGET_S - ($(date +%s) - T_START)))
  if ((left < MIN_STEP_S)); then
    record "${name}: rc=125 0s SKIPPED (${left}s of this call's ${CALL_BUDGET_S}s left: run it in the next call)"
    FAILED=1
    pack
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
  local late="" tally
  [[ ${rc} -eq 124 || ${rc} -eq 137 ]] && late=" TIMED OUT"
  tally=$(pytest_tally "${log}")
  record "${name}: rc=${rc} $(($(date +%s) - t0))s${late}${tally:+ (${tally})}"
  grep -E '^SKIPPED \[[0-9]+\]' "${log}" | head -8 | sed 's/^/    /' | tee -a "${SUMMARY}"
  tail -3 "${log}"
  [[ ${rc} -eq 0 ]] || FAILED=1
  pack
  return ${rc}
}

# Steps that import zero_ext's CUDA kernels build them first when they are missing (a fresh machine).
ensure_build() {
  has_cuda_build && return 0
  step build 240 run_build && return 0
  record "build failed: nothing that needs the CUDA extension can run"
  pack
  exit 1
}

run_step() {
  case "$1" in
    build) step build 240 run_build || { record "build failed: nothing else can run"; pack; exit 1; } ;;
    ops)
      ensure_build
      step ops 150 "${PYTEST[@]}" -m cuda --junitxml="${LOGS}/pytest_ops.xml" "${KERNEL_TESTS[@]}" ;;
    engine)
      ensure_build
      step engine 180 "${PYTEST[@]}" -m cuda --junitxml="${LOGS}/pytest_engine.xml" "${KERNEL_IGNORES[@]}" tests ;;
    engine_one)
      ensure_build
      step engine_one 35 "${PYTEST[@]}" -m cuda --junitxml="${LOGS}/pytest_engine_one.xml" \
        "${ENGINE_ONE_TESTS[@]}" -k "${ENGINE_ONE_K}" ;;
    test) run_step ops; run_step engine ;;
    suite)
      ensure_build
      step suite 540 "${PYTEST[@]}" --junitxml="${LOGS}/pytest_suite.xml" ;;
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
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 120 compute-sanitizer --tool memcheck \
        --error-exitcode 1 --print-limit 50 --target-processes all \
        "${PY}" -m pytest -q -x -ra -m "cuda and not slow" "${MEMCHECK_TESTS[@]}" -k "${MEMCHECK_K}" ;;
    racecheck)
      ensure_build
      step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 20 \
        "${PY}" -m pytest -q -x -m "not slow" -k "cuda and (sum_squares or hundreds)" \
        tests/kernels/test_cuda_ops.py ;;
    bench)
      ensure_build
      step bench 40 "${PY}" bench/bench_fused_adamw.py --device cuda --precision ;;
    overlap)
      ensure_build
      step overlap 90 run_overlap ;;
    ncu)
      ensure_build
      step ncu 150 run_ncu ;;
    ctest) step ctest 180 run_ctest ;;
    *) record "unknown step '$1' (steps: ${ALL_STEPS[*]} test; plans: ${!PLANS[*]})"; FAILED=1 ;;
  esac
}

# Wheels carried in .whl/ (see the top): installed for this call only.
if compgen -G "${ROOT}/.whl/*.whl" >/dev/null; then
  "${PY}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${ROOT}"/.whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH}"
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
echo "# $(date -u +%FT%TZ) ${PLAN}: ${STEPS[*]} (call budget ${CALL_BUDGET_S}s)" >>"${SUMMARY}"

for s in "${STEPS[@]}"; do
  run_step "${s}"
done
pack
echo "---- summary (${SUMMARY})"
cat "${SUMMARY}"
exit ${FAILED}
