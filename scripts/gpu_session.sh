#!/usr/bin/env bash
# The one command for a GPU machine (H100/H200, torch 2.11+cu130, triton, nvcc, ncu,
# compute-sanitizer, no network). Builds the CUDA extension in place and runs, writing every log
# under $OUT (default ./gpu_out) and a one-line-per-step summary to $OUT/summary.txt:
#   build      pip install --no-build-isolation --no-deps -e .  (native arch only: faster build)
#   test       pytest -m cuda                                    (slow > 2^31-element tests included)
#   suite      pytest (the default CPU suite on the GPU machine; the Triton CPU tests run in a subprocess)
#   memcheck   CUDA op tests under compute-sanitizer memcheck    (caching allocator off: exact OOB)
#   memcheck_engine  the CUDA engine tests under memcheck        (NCCL, side streams, Triton staging)
#   racecheck  the shared-memory reductions under racecheck
#   bench      python bench/bench_fused_adamw.py --device cuda   (results also copied to $OUT)
#   overlap    python bench/profile_overlap.py: profiler check that the gradient reduce-scatter
#              overlaps backward (NCCL, one GPU; results also copied to $OUT)
#   ncu        one Nsight Compute pass over each kernel (speed of light, occupancy)
#   ctest      the torch-free launcher test (cmake/cuda_compile_check.cmake) on the GPU
# Usage: scripts/gpu_session.sh [STEP...]   (default: all, in that order; `test` and `overlap` build
# first when zero_ext._C lacks the CUDA kernels, and a rebuild is incremental). A device call may run
# at most ten minutes, so on a fresh machine run it as e.g. `... build test` then `... suite memcheck
# memcheck_engine` then `... racecheck bench overlap ncu ctest`; each step has its own timeout (STEP_TIMEOUT_<STEP> seconds) so
# one hang cannot eat the budget. Exit status: nonzero if any step failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
OUT="${OUT:-${ROOT}/gpu_out}"
mkdir -p "${OUT}"
SUMMARY="${OUT}/summary.txt"
PY="${PYTHON:-python}"
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(build test suite memcheck memcheck_engine racecheck bench overlap ncu ctest)
FAILED=0
# The op tests of the CUDA kernels: this file and the shared cpu/cuda op tests that exist.
OP_TESTS=$(ls tests/test_cuda_ops.py tests/test_fused_adamw*.py tests/test_flatten*.py \
  tests/test_sum_squares*.py 2>/dev/null | tr '\n' ' ')

# step NAME DEFAULT_TIMEOUT CMD...: runs CMD with its output in $OUT/NAME.log, records the outcome.
step() {
  local name="$1" default_timeout="$2"
  shift 2
  local var="STEP_TIMEOUT_${name^^}"
  local limit="${!var:-${default_timeout}}"
  local t0=$(date +%s)
  echo "== ${name} (timeout ${limit}s): $*" | tee -a "${OUT}/${name}.log"
  timeout --kill-after=10 "${limit}" "$@" >>"${OUT}/${name}.log" 2>&1
  local rc=$?
  local line="${name}: rc=${rc} $(( $(date +%s) - t0 ))s$([[ ${rc} -eq 124 ]] && echo ' TIMED OUT')"
  echo "${line}" | tee -a "${SUMMARY}"
  tail -3 "${OUT}/${name}.log"
  [[ ${rc} -eq 0 ]] || FAILED=1
  return ${rc}
}

{
  echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo '+dirty')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  "${PY}" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "${PY}" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
  nvcc --version | tail -2
} >"${OUT}/env.txt" 2>&1
cat "${OUT}/env.txt"

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
  "${PY}" -m pip install --no-build-isolation --no-deps -v -e . && has_cuda_build
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

for s in "${STEPS[@]}"; do
  case "${s}" in
    build) step build 480 run_build || { echo "build failed: nothing else can run"; exit 1; } ;;
    test)
      has_cuda_build || step build 480 run_build || exit 1
      step test 480 "${PY}" -m pytest -m cuda -q -ra --junitxml="${OUT}/pytest_cuda.xml" ;;
    suite)
      has_cuda_build || step build 480 run_build || exit 1
      step suite 600 "${PY}" -m pytest -q -ra --junitxml="${OUT}/pytest_suite.xml" ;;
    memcheck_engine)
      # The engine on one GPU through NCCL (side streams, events, staging, accumulate) under memcheck; the
      # caching allocator stays on here (NCCL and the engine allocate per step), so this finds out-of-bounds
      # accesses past whole allocations and use of freed memory the allocator returned to the driver.
      step memcheck_engine 480 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 \
        --target-processes all "${PY}" -m pytest -q -x -m "cuda and not slow" \
        tests/test_engine_cuda.py tests/test_engine_cuda_paths.py -k "not three_ways and not two_gpus" ;;
    memcheck)
      # No caching allocator: every tensor is its own cudaMalloc, so an out-of-bounds access hits
      # unallocated memory instead of a neighbour in the same pool block.
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 420 compute-sanitizer --tool memcheck \
        --error-exitcode 1 --print-limit 50 --target-processes all \
        "${PY}" -m pytest -q -x -m "not slow" -k "cuda and not large" ${OP_TESTS} ;;
    racecheck)
      step racecheck 240 compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 20 \
        "${PY}" -m pytest -q -x -m "not slow" -k "cuda and (sum_squares or hundreds)" \
        tests/test_cuda_ops.py ;;
    bench)
      step bench 480 "${PY}" bench/bench_fused_adamw.py --device cuda
      mkdir -p "${OUT}/bench_results" && cp -r bench/results/. "${OUT}/bench_results/" ;;
    overlap)
      has_cuda_build || step build 480 run_build || exit 1
      step overlap 300 "${PY}" bench/profile_overlap.py
      # Into the same folder as `bench` (merged, whichever of the two ran first).
      mkdir -p "${OUT}/bench_results" && cp -r bench/results/. "${OUT}/bench_results/" ;;
    ncu) step ncu 240 run_ncu ;;
    ctest) step ctest 240 run_ctest ;;
    *) echo "unknown step '${s}' (build test suite memcheck memcheck_engine racecheck bench overlap ncu ctest)"; FAILED=1 ;;
  esac
done
echo "---- summary (${SUMMARY})"
cat "${SUMMARY}"
exit ${FAILED}
