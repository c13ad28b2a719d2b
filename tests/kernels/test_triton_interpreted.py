"""On a GPU machine the Triton kernels are compiled for the GPU, so the tests that run them on CPU tensors (through
Triton's interpreter, which is process-wide) cannot run in the same process: this runs them in a subprocess with
the GPU hidden and the interpreter on. Without a GPU they run directly and this test has nothing to do."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_triton_cpu_tests_under_the_interpreter():
    if not torch.cuda.is_available():
        pytest.skip("no GPU: the Triton CPU tests run directly in this session")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "triton_cpu", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
