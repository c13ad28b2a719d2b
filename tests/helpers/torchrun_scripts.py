"""Test scripts launched with torchrun: the tests written ahead for several GPUs (NCCL), each of which also runs on
CPU ranks through gloo in the default suite, so that the script cannot rot unseen.

In the parent test: :func:`torchrun` writes the script and launches it. In the script (``sys.path`` holding
:data:`HELPERS`): ``device = init_ranks(backend)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import free_port

HELPERS = os.path.dirname(os.path.abspath(__file__))  # tests/helpers: a script puts it on sys.path


def init_ranks(backend: str) -> torch.device:
    """In a torchrun child: join the process group and return this rank's device (``"nccl"``: the GPU that
    LOCAL_RANK names, made current; ``"gloo"``: the CPU, a dry run of a GPU test's script)."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def torchrun(script: str, path: Path, world: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """Write ``script`` to ``path`` and run it on ``world`` ranks with torchrun; its output, captured."""
    path.write_text(script)
    # A free port, not torchrun's default 29500: another pytest worker (pytest-xdist) may be launching beside it.
    launch = [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}"]
    cmd = [*launch, f"--nproc_per_node={world}", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
