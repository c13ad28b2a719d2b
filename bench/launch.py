"""Run a function on N fresh processes (gloo on CPU, NCCL on GPUs) and collect rank 0's return value.

Each call spawns new processes, so every run starts from a clean process: its peak memory is its own.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def default_world(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" else 2


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, device_type: str, port: int, out_path: str, fn: Callable, args: tuple) -> None:
    # zero_ext calls reduce_scatter_tensor / all_gather_into_tensor, deprecated in torch 2.13: one warning per
    # rank and collective would bury the progress bar.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        # Share the cores between the ranks instead of every rank using all of them (oversubscription).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // world))
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, device, *args)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, device_type: str, *args) -> Any:
    """``fn(rank, world, device, *args)`` on ``world`` new processes; returns what rank 0 returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        # fork on CPU: the children inherit the imported torch instead of importing it again (seconds per
        # process on a small machine); CUDA cannot be forked once initialised, so GPUs get fresh processes.
        method = "spawn" if device_type == "cuda" else "fork"
        mp.start_processes(
            _entry, args=(world, device_type, _free_port(), out, fn, args), nprocs=world, start_method=method
        )
        with open(out, "rb") as f:
            return pickle.load(f)
