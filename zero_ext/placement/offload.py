"""Optimizer state off the device: ``ZeroAdamW(..., offload="cpu")`` keeps each rank's optimizer state (every kind
of the update rule: the fp32 master and the moments) and reduced-gradient shard in host memory and updates them with
the CPU fused kernel (:mod:`.host`, ZeRO-Offload); ``offload="nvme", offload_dir=...`` keeps the state in files
and streams them through a window of ``offload_window`` bytes of host memory (:mod:`.disk`, ZeRO-Infinity).

Both compute exactly what the in-memory optimizer computes on the CPU (the same kernel on the same values in the
same order: bitwise the same parameters), and save and load the same checkpoints: a run may resume with or
without offload, at any world size.

This module checks the options, prepares the directory (agreed by every rank: a full disk or an unwritable
directory fails construction on every rank before anything is allocated) and picks the placement per flat group.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..layout import Layout, fingerprint
from ..update.protocol import UpdateRule
from ..update.registry import DEFAULT_RULE, rule_named
from . import leftovers
from .device import DeviceState
from .disk import DiskState, file_kinds, min_window_bytes
from .files import file_nbytes
from .host import HostState

__all__ = [
    "OFFLOADS",
    "DEFAULT_WINDOW",
    "check_offload_options",
    "prepare_offload",
    "placement_class",
    "placement_factory",
]

OFFLOADS = (None, "cpu", "nvme")
# Bytes of host memory through which the state on disk streams (all flat groups). 128 MiB rather than 64: 12.8 MB
# transfers instead of 6.4; at 128M params with one or two I/O threads, 78-93 % of the disk's sequential rate in
# four side-by-side runs against 67-76 % in two (not a committed result file). That sweep predates the huge-page
# window buffers (.files.aligned_buffer) and has not been repeated with them; at 32 and 16 MiB windows small models
# did no better in single runs.
DEFAULT_WINDOW = 128 * 2**20
WHERE = "zero_ext.ZeroAdamW"


def check_offload_options(offload, offload_dir, offload_window, where: str = WHERE) -> None:
    if offload not in OFFLOADS:
        raise ValueError(f"{where}: `offload` must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload == "nvme":
        if not isinstance(offload_dir, (str, os.PathLike)) or not str(offload_dir):
            raise ValueError(
                f"{where}: offload='nvme' needs `offload_dir`, a directory on the fast local disk to keep the optimizer "
                f"state in (not a RAM-backed /tmp), got {offload_dir!r}"
            )
    elif offload_dir is not None:
        raise ValueError(f"{where}: `offload_dir` is for offload='nvme' (offload={offload!r})")
    if offload_window is not None:
        if offload != "nvme":
            raise ValueError(f"{where}: `offload_window` is for offload='nvme' (offload={offload!r})")
        # the default rule's floor (nothing is built yet); each flat group's share is raised to its own rule's floor
        floor = min_window_bytes(rule_named(DEFAULT_RULE, torch.bfloat16))
        if not (isinstance(offload_window, int) and not isinstance(offload_window, bool) and offload_window >= floor):
            raise ValueError(f"{where}: `offload_window` must be an int >= {floor} (bytes), got {offload_window!r}")


def _processes_on_this_host() -> int:
    """torchrun's LOCAL_WORLD_SIZE; without it (mp.spawn, a launcher of one's own) the process group's size, as if
    every rank shared this host: the warning then never promises cores that other ranks are using."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def warn_if_one_thread(offload) -> None:
    """The CPU update runs on torch's intra-op threads; torchrun sets OMP_NUM_THREADS=1, which leaves it one core
    (DeepSpeed's users hit the same: CPU Adam several times slower than it could be)."""
    if offload is None or torch.get_num_threads() > 1:
        return
    cores = len(os.sched_getaffinity(0)) // _processes_on_this_host()
    if cores > 1:
        warnings.warn(
            f"zero_ext.ZeroAdamW: offload={offload!r} updates the optimizer state on the CPU with torch's intra-op "
            f"threads, and there is 1 (torchrun sets OMP_NUM_THREADS=1) while {cores} cores per rank are free: set "
            f"OMP_NUM_THREADS={cores} (or torch.set_num_threads({cores})) for a step up to {cores}x faster",
            stacklevel=3,
        )


def disk_bytes_needed(groups: Sequence[tuple[Layout, UpdateRule]]) -> int:
    """Bytes the state files of these flat groups take (one file per kind of each group's rule, whole blocks; a
    remainder and int8 moments' scales stay in host memory)."""
    return sum(
        sum(file_nbytes(layout.shard_numel, {k.name: k.dtype for k in file_kinds(rule)}).values())
        for layout, rule in groups
    )


def prepare_offload(
    comm: Communicator, offload, offload_dir, groups: Sequence[tuple[Layout, UpdateRule]], where: str = WHERE
) -> Optional[str]:
    """Collective for ``offload="nvme"``: create ``offload_dir`` when missing (with its parents) and this rank's
    directory under it, and check that the
    disk has room for the state of every rank that shares it; raises on every rank if any rank failed. Returns the
    directory (None without nvme offload)."""
    if offload != "nvme":
        return None
    error, directory, key = None, None, 0
    need = disk_bytes_needed(groups)
    try:
        parent = os.path.abspath(os.fspath(offload_dir))
        # Created when missing, with its parents, as checkpoint directories are (DeepSpeed's swap folder too); every
        # rank sharing it may create it at once (exist_ok). A file in the way fails here, and every rank with it.
        os.makedirs(parent, exist_ok=True)
        if not os.path.isdir(parent):
            raise OSError(f"`offload_dir` {parent!r} is not a directory")
        directory = tempfile.mkdtemp(prefix=leftovers.dir_prefix(comm.process_rank), dir=parent)
        key = fingerprint([socket.gethostname(), str(os.stat(parent).st_dev)])  # ranks sharing this disk
    except OSError as e:
        error = f"cannot use `offload_dir` {offload_dir!r}: {e}"
    keys = comm.agree(key)
    needs = comm.agree(need)
    sharing = [r for r, k in enumerate(keys) if k == key]
    if error is None:
        together = sum(needs[r] for r in sharing)
        free = shutil.disk_usage(directory).free
        if together > free:
            error = (
                f"offload='nvme' needs {together / 2**30:.2f} GiB in {offload_dir!r} for the optimizer state of rank(s) "
                f"{sharing} ({_bytes_per_element(groups)} bytes per parameter of each rank's shard), but the disk has {free / 2**30:.2f} GiB free"
            )
    failed = [r for r, f in enumerate(comm.agree(int(error is not None))) if f]
    if error is not None or failed:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        if error is not None:
            raise ValueError(f"{where}: {error}")
        raise ValueError(f"{where}: offload='nvme' failed on rank(s) {failed} (see their errors)")
    if comm.process_rank == sharing[0]:  # once per disk: what killed processes left there
        leftovers.warn(parent)
    return directory


def _bytes_per_element(groups: Sequence[tuple[Layout, UpdateRule]]) -> str:
    widths = sorted({sum(k.itemsize for k in file_kinds(rule)) for _, rule in groups})
    return " or ".join(map(str, widths))


def placement_class(offload) -> type:
    """The placement class ``offload`` names, whose policies (``update_device_on``, ``adds_in_place_on``) are known
    from the configuration alone, before any flat group is built."""
    return {None: DeviceState, "cpu": HostState, "nvme": DiskState}[offload]


def placement_factory(offload, directory: Optional[str], window: Optional[int], rank: int, groups: int) -> Callable:
    """``make(layout, flat_params, device, rule, group_index)`` -> the flat group's optimizer-state placement. The
    nvme window (``window`` bytes, default ``DEFAULT_WINDOW``) is split evenly between the ``groups`` flat groups; a
    share below ``min_window_bytes(rule)`` (one 4 KiB block per kind per slot) is raised to it, and a group whose
    shard is smaller than its share allocates only what the shard needs (``disk.chunk_numel``)."""
    if offload is None:
        return lambda layout, params, device, rule, index: DeviceState(layout, params, device, rule)
    if offload == "cpu":
        return lambda layout, params, device, rule, index: HostState(layout, params, device, rule)
    share = (window if window is not None else DEFAULT_WINDOW) // max(groups, 1)
    return lambda layout, params, device, rule, index: DiskState(
        layout, params, device, rule, directory, f"rank{rank}.group{index}", max(share, min_window_bytes(rule))
    )
