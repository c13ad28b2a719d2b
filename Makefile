# Entry points (README): `make run` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is installed only when absent; a CUDA torch already present is kept.
TORCH_SPEC ?= torch==2.13.0
BUILD ?= build/cmake
# Tools installed by the dev extra live next to the interpreter, wherever PATH points.
SCRIPTS := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('scripts'))")
CLANG_FORMAT ?= $(SCRIPTS)/clang-format

.PHONY: install run test test-cuda ctest lint format cuda-link

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-build-isolation -e ".[dev]"

run: install
	$(PYTHON) bench/main_job.py

test: install
	$(PYTHON) -m pytest -q

test-cuda: install
	$(PYTHON) -m pytest -q -m cuda

# Torch-free core: CPU kernel unit tests (ctest) and the nvcc compile check of every .cu file.
ctest:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD)
	ctest --test-dir $(BUILD) --output-on-failure

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(CLANG_FORMAT) --dry-run --Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	$(CLANG_FORMAT) -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

# Builds and links the real CUDA extension against the CUDA build of torch in its own venv (.venv-cuda),
# on a machine with no GPU: proves csrc/torch/cuda_ops.cpp and csrc/cuda/*.cu link into zero_ext._C.
cuda-link:
	bash scripts/cuda_link_check.sh
