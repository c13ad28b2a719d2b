import os
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run on CPU through the interpreter; this must be set before any @triton.jit
# function is imported. On a GPU machine they are compiled for real, and the tests that run Triton on CPU tensors
# run in a subprocess of their own with the interpreter on (tests/kernels/test_triton_interpreted.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

import zero_ext  # noqa: E402, F401

# `make test` runs two pytest-xdist workers on the two cores: each computes with one torch thread, since two workers
# of two OpenMP threads each oversubscribe the cores and their spinning threads burn what the other worker needs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Modules whose tests without the cuda marker all run Triton kernels on CPU tensors.
TRITON_CPU_MODULES = {"test_triton_kernels.py"}


def runs_triton_on_cpu(item) -> bool:
    if "cuda" in item.keywords:
        return False
    return item.path.name in TRITON_CPU_MODULES or "triton_ops" in getattr(item, "fixturenames", ())


def launches_ranks(item) -> bool:
    """A test of a module that imports the rank launchers (tests/helpers: run_on_ranks' gloo pool, torchrun scripts)
    may run on several processes; the rest are single-process unit tests (`make test-unit`)."""
    module = getattr(item, "module", None)
    return module is not None and any(hasattr(module, n) for n in ("run_on_ranks", "torchrun"))


# `make test-fast` (-m "not slow") fits in 2 minutes on 2 cores (issue 47) with the single-process tests and ONE test
# of each module that launches ranks: its first test not marked slow or cuda, a smoke of every multi-rank file. Its
# other multi-rank tests are marked slow here (`make test` runs them all).
@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m triton_cpu` picks these
def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton_cpu = pytest.mark.skip(
        reason="runs Triton on CPU tensors, which needs TRITON_INTERPRET=1 for the whole process; on a GPU machine "
        "tests/kernels/test_triton_interpreted.py runs these in a subprocess of their own"
    )
    smoked = set()  # modules whose multi-rank smoke test (`make test-fast`) is picked
    for item in items:
        if launches_ranks(item):
            item.add_marker(pytest.mark.multirank)
            quick = not any(m in item.keywords for m in ("slow", "cuda"))
            if quick and item.path in smoked:
                item.add_marker(pytest.mark.slow)
            elif quick:
                smoked.add(item.path)
        if runs_triton_on_cpu(item):
            item.add_marker(pytest.mark.triton_cpu)
        if not gpu and "cuda" in item.keywords:
            item.add_marker(skip_cuda)
        if gpu and not INTERPRETED and "triton_cpu" in item.keywords:
            item.add_marker(skip_triton_cpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def nccl_world():
    """A one-rank NCCL process group for the CUDA engine tests (initialised once per session)."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fd, path = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    os.remove(path)
