# Entry points (README): `make run` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is installed only when absent; a CUDA torch already present is kept.
TORCH_SPEC ?= torch==2.13.0
BUILD ?= build/cmake
# Tools installed by the dev extra live next to the interpreter, wherever PATH points.
SCRIPTS := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('scripts'))")
CLANG_FORMAT ?= $(SCRIPTS)/clang-format
# The suite on two pytest-xdist workers, one per core (each computes with one torch thread: tests/conftest.py). Work
# stealing keeps both busy to the end: the slowest tests (torchrun launches, the benchmark smoke runs) take 20-60 s.
# The gloo ranks fork from a preloaded server (tests/helpers/distributed.py). On 2 cores: 10:47 for `make test`
# against 16:45-20:29 in one process with spawned ranks (bench/results/suite_time.md).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal

.PHONY: install reinstall run test test-fast test-unit test-cuda coverage ctest lint format cuda-link

# The install is skipped when nothing it depends on changed since the last one for this interpreter: the stamp
# records the interpreter's prefix and is older than no build input, and zero_ext imported from outside the tree is
# this checkout's (an editable install made by another clone of the repository points elsewhere).
STAMP := build/.install-stamp
PREFIX := $(shell $(PYTHON) -c "import sys; print(sys.prefix)")
INPUTS := setup.py pyproject.toml csrc

install:
	@if [ -f $(STAMP) ] && [ "$$(cat $(STAMP))" = "$(PREFIX)" ] \
		&& [ -z "$$(find $(INPUTS) -newer $(STAMP) -print -quit)" ] \
		&& (cd / && $(PYTHON) -c "import sys, zero_ext; sys.exit(zero_ext.__file__ != '$(CURDIR)/zero_ext/__init__.py')") 2>/dev/null; then \
		echo "== zero_ext is installed and up to date for $(PYTHON) (make reinstall forces a rebuild)"; \
	else \
		$(PYTHON) -c "import torch" 2>/dev/null || { echo "== torch is not importable: installing $(TORCH_SPEC)"; \
			$(PIP) install -q "$(TORCH_SPEC)" || exit 1; }; \
		echo "== installing zero_ext (editable, with the dev extra): compiles the C++ kernels, about a minute the first time"; \
		$(PIP) install -q --no-build-isolation -e ".[dev]" || exit 1; \
		mkdir -p $(dir $(STAMP)) && echo "$(PREFIX)" > $(STAMP); \
	fi

reinstall:
	rm -f $(STAMP)
	$(MAKE) install

run: install
	$(PYTHON) bench/main_job.py

test: install
	@echo "== pytest: the CPU suite; tests marked cuda are deselected here (make test-cuda runs them on a GPU machine)"
	$(PYTHON) -m pytest -q $(XDIST)

# The quick loop, 2 minutes on 2 cores: everything but the tests marked slow (the 67M-parameter offload memory test,
# the benchmark smoke runs, and every multi-rank test but the first quick one of its module: tests/conftest.py).
# Both markers are named: a -m given here replaces pyproject's -m 'not cuda'.
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow and not cuda" $(XDIST)

# The single-process unit tests alone (kernels, checkpoint format, docs and tooling checks): no gloo rank is launched.
test-unit: install
	$(PYTHON) -m pytest -q -m "not multirank and not cuda"

test-cuda: install
	$(PYTHON) -m pytest -q -m cuda

# zero_ext's line coverage over the CPU suite (.coveragerc: spawned gloo ranks, torchrun scripts and benchmark
# subprocesses measured too); the report lands in build/coverage/. Before/after of changed test files, old against
# new: tests/coverage/compare_lines.py.
coverage: install
	$(PYTHON) -m coverage erase
	$(PYTHON) -m coverage run -m pytest -q $(XDIST)
	$(PYTHON) -m coverage combine -q
	$(PYTHON) -m coverage report | tee build/coverage/report.txt | tail -3

# Torch-free core: CPU kernel unit tests (ctest) and the nvcc compile check of every .cu file.
ctest:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD)
	ctest --test-dir $(BUILD) --output-on-failure

# The layers contract (.importlinter): zero_ext's folders import only downward, and no folder has an import cycle
# (function-local and TYPE_CHECKING imports counted).
LINT_IMPORTS ?= $(SCRIPTS)/lint-imports

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(LINT_IMPORTS)
	$(CLANG_FORMAT) --dry-run --Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	$(CLANG_FORMAT) -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

# Builds and links the real CUDA extension against the CUDA build of torch in its own venv (.venv-cuda),
# on a machine with no GPU: proves csrc/torch/cuda_ops.cpp and csrc/cuda/*.cu link into zero_ext.ops._C.
cuda-link:
	bash scripts/cuda_link_check.sh
