import os

import pytest
import torch

# Without a GPU the Triton kernels run on CPU through the interpreter; this must be set before any
# @triton.jit function is imported. On a GPU machine they are compiled for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import zero_ext  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
