#!/usr/bin/env bash
# Builds the real CUDA extension (zero_ext.ops._C with csrc/torch/cuda_*.cpp and csrc/cuda/*.cu) against a
# CUDA build of torch on a machine with NO GPU, and proves it links and imports:
#   1. .venv-cuda (gitignored) gets a CUDA torch from PyPI whose CUDA major matches local nvcc;
#   2. the tracked + untracked-not-ignored working tree is copied to a temp dir (the in-tree build/
#      directory belongs to the CPU build and is left alone);
#   3. setup.py builds there with CUDA_HOME and TORCH_CUDA_ARCH_LIST="8.0;9.0", into build/lib: the package as
#      a wheel would install it (zero_ext.kernels: kernels/zero_ext_kernels/, through the zero_ext/kernels link);
#   4. the .so must have no undefined symbols (ldd -r), carry sm_80 and sm_90 code, import without a
#      GPU (from build/lib), and register a CUDA kernel for every op.
# Options (environment): ZERO_EXT_CUDA_TORCH (default 2.11.0: the version of the GPU machine,
# torch 2.11+cu130), CUDA_HOME (default /usr/local/cuda), KEEP_TMP=1 keeps the build dir.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-cuda"
TORCH_VERSION="${ZERO_EXT_CUDA_TORCH:-2.11.0}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="8.0;9.0"
T0=$(date +%s)
log() { echo "[cuda-link +$(($(date +%s) - T0))s] $*"; }

NVCC="${CUDA_HOME}/bin/nvcc"
[[ -x "${NVCC}" ]] || { echo "cuda-link: no nvcc at ${NVCC}" >&2; exit 2; }
NVCC_VERSION=$("${NVCC}" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
log "nvcc ${NVCC_VERSION} at ${NVCC}"

# --- 1. the CUDA torch venv ----------------------------------------------------------------------
venv_torch() { "${VENV}/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null; }
if [[ ! -x "${VENV}/bin/python" ]]; then
  log "creating ${VENV}"
  python3 -m venv "${VENV}"
fi
if ! venv_torch | grep -q "^${TORCH_VERSION}[+ ].* [0-9]"; then
  log "installing torch==${TORCH_VERSION} (CUDA build) from PyPI; several GB, takes minutes"
  # --isolated: ignore pip config (local find-links/extra indexes hold the CPU-only wheel).
  "${VENV}/bin/pip" --isolated install -q --cert /etc/ssl/certs/ca-certificates.crt \
    --index-url https://pypi.org/simple "torch==${TORCH_VERSION}" setuptools wheel ninja numpy
fi
read -r TV TCUDA <<<"$(venv_torch)"
log "venv torch ${TV}, built for CUDA ${TCUDA}"
if [[ "${TCUDA%%.*}" != "${NVCC_VERSION%%.*}" ]]; then
  echo "cuda-link: torch CUDA ${TCUDA} and nvcc ${NVCC_VERSION} differ in major version" >&2
  exit 2
fi

# --- 2. copy the working tree --------------------------------------------------------------------
WORK="$(mktemp -d /tmp/zero_ext_cuda_link.XXXXXX)"
[[ "${KEEP_TMP:-0}" == "1" ]] || trap 'rm -rf "${WORK}"' EXIT
(cd "${ROOT}" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done |
  tar --null -T - -cf -) | tar -xf - -C "${WORK}"
log "copied working tree to ${WORK}"

# --- 3. build ------------------------------------------------------------------------------------
cd "${WORK}"
export PATH="${VENV}/bin:${CUDA_HOME}/bin:${PATH}"
BUILD_LOG="${WORK}.build.log"
if ! "${VENV}/bin/python" setup.py -q build --build-lib build/lib >"${BUILD_LOG}" 2>&1; then
  grep -E 'error' "${BUILD_LOG}" | head -40 >&2
  echo "cuda-link: build failed; full log: ${BUILD_LOG}" >&2
  exit 1
fi
# Warnings from the CUDA side (the .cu files and the CUDA binding) are this check's business.
CUDA_WARNINGS=$(grep -E '(csrc/cuda/|cuda_ops\.cpp).*warning' "${BUILD_LOG}" || true)
[[ -z "${CUDA_WARNINGS}" ]] || { echo "cuda-link: warnings in CUDA sources:"; echo "${CUDA_WARNINGS}"; }
log "build log: ${BUILD_LOG} ($(grep -c warning "${BUILD_LOG}" || true) warning lines in all)"
SO=$(ls build/lib/zero_ext/ops/_C*.so 2>/dev/null | head -1)
[[ -n "${SO}" ]] || { echo "cuda-link: build produced no build/lib/zero_ext/ops/_C*.so" >&2; exit 1; }
log "built ${SO} ($(du -h "${SO}" | cut -f1))"

# --- 4. checks -----------------------------------------------------------------------------------
TORCH_LIB=$("${VENV}/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
# The Python C API (Py*, _Py*) is resolved by the interpreter that loads the module, never by ldd.
UNDEF=$(LD_LIBRARY_PATH="${TORCH_LIB}:${LD_LIBRARY_PATH:-}" ldd -r "${SO}" 2>&1 |
  grep -E 'undefined symbol|not found' | grep -vE 'undefined symbol: _?Py' || true)
if [[ -n "${UNDEF}" ]]; then
  echo "cuda-link: unresolved symbols or libraries:" >&2
  echo "${UNDEF}" | head -20 >&2
  exit 1
fi
log "ldd -r: every symbol and library resolves"
# cuobjdump: from CUDA_HOME, else the copy triton ships (a compile-only toolkit may lack it).
CUOBJDUMP="${CUDA_HOME}/bin/cuobjdump"
[[ -x "${CUOBJDUMP}" ]] || CUOBJDUMP=$(ls "${VENV}"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1)
[[ -x "${CUOBJDUMP}" ]] || { echo "cuda-link: no cuobjdump to list the device code" >&2; exit 1; }
ARCHS=$("${CUOBJDUMP}" --list-elf "${SO}" | grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')
log "device code in the .so: ${ARCHS}"
for a in sm_80 sm_90; do
  [[ "${ARCHS}" == *"${a}"* ]] || { echo "cuda-link: no ${a} code in ${SO}" >&2; exit 1; }
done

# From build/lib, where the built package is complete (the checkout's zero_ext/ has no kernels/).
cd build/lib
CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 "${VENV}/bin/python" - <<'EOF'
import torch

import zero_ext  # loads zero_ext.ops._C: must not need a GPU
import zero_ext.kernels.dispatch  # noqa: F401  (the kernels folder was built into the package)

assert not torch.cuda.is_available()
for op in ("fused_adamw_", "fused_adamw_int8_", "flatten_", "unflatten_", "sum_squares"):
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"zero_ext::{op}", key), (op, key)
print(f"import ok without a GPU: torch {torch.__version__}, CPU and CUDA kernels registered for every op")
EOF
log "cuda-link OK"
