"""The disk's own sequential bandwidth, and a replay of the nvme step's I/O pattern, in plain Python with no torch
import (bench/disk_modes.py runs them in processes with and without torch loaded; bench_offload.py uses the probe
beside the optimizer)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

ALIGN = 4096  # O_DIRECT alignment: zero_ext.offload.files.ALIGN (not imported: that module imports torch)
HUGE_PAGE = 2 << 20  # zero_ext.offload.files.HUGE_PAGE


def io_buffer(nbytes: int, pages: str = "huge") -> memoryview:
    """``nbytes`` of private anonymous memory, filled with random bytes, for O_DIRECT transfers. ``pages="huge"``:
    starting on a 2 MiB boundary and advised to use transparent huge pages, as the optimizer's window buffers are
    (zero_ext.offload.files.aligned_buffer); ``"4k"``: advised not to, so every 4 KiB page is its own piece of
    physical memory for the device."""
    huge = pages == "huge"
    region = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE if huge else 0
    try:
        region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, start, nbytes)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages either way
        pass
    view = memoryview(region)[start : start + nbytes]
    view[:] = os.urandom(nbytes)
    return view


class DiskStream:
    """The disk's own sequential bandwidth: ``nbytes`` written, and ``nbytes`` read, with O_DIRECT in ``block``
    transfers from one aligned buffer, the plain loop a user would write (what the optimizer's I/O threads are
    measured against), from a buffer of the kind the optimizer's window uses (``pages``, see :func:`io_buffer`).

    Two files, written and read alternately: each read is of a file written one round before, with the other's
    write in between, as the step reads state written one step before. (Reading back what was just written
    measures a cache: this VM's disk reads its last writes about 1.5x faster.)"""

    def __init__(self, directory: str, nbytes: int, block: int, pages: str = "huge"):
        self.block = max(ALIGN, block // ALIGN * ALIGN)
        self.nbytes = max(self.block, nbytes // self.block * self.block)
        self.buf = io_buffer(self.block, pages)
        self.paths = [os.path.join(directory, f"bandwidth.probe{i}") for i in range(2)]
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
        self.fds = [os.open(p, flags, 0o600) for p in self.paths]
        for fd in self.fds:
            os.posix_fallocate(fd, 0, self.nbytes)
            self._write(fd)
        self.turn = 0

    def _write(self, fd: int) -> None:
        for off in range(0, self.nbytes, self.block):
            os.pwritev(fd, [self.buf], off)
        os.fsync(fd)

    def write(self) -> float:
        t0 = time.perf_counter()
        self._write(self.fds[self.turn])
        return time.perf_counter() - t0

    def read(self) -> float:
        fd = self.fds[1 - self.turn]  # written a round ago
        self.turn = 1 - self.turn
        t0 = time.perf_counter()
        for off in range(0, self.nbytes, self.block):
            os.preadv(fd, [self.buf], off)
        return time.perf_counter() - t0

    def close(self) -> None:
        for fd, path in zip(self.fds, self.paths):
            os.close(fd)
            os.remove(path)


class StepReplay:
    """The nvme step's transfers without the optimizer: three files (master, exp_avg, exp_avg_sq) of ``nbytes / 3``
    each, walked in ``block``-byte chunks; chunk ``i + 1`` of every file is read, then chunk ``i - 1`` written, one
    transfer at a time (the order the step issues them in, without its threads and its CPU work)."""

    def __init__(self, directory: str, nbytes: int, block: int, pages: str = "huge"):
        self.block = max(ALIGN, block // ALIGN * ALIGN)
        self.chunks = max(1, nbytes // 3 // self.block)
        self.bufs = [io_buffer(self.block, pages) for _ in range(6)]
        self.paths = [os.path.join(directory, f"replay.{k}") for k in ("master", "exp_avg", "exp_avg_sq")]
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
        self.fds = [os.open(p, flags, 0o600) for p in self.paths]
        for fd in self.fds:
            os.posix_fallocate(fd, 0, self.chunks * self.block)
            for i in range(self.chunks):
                os.pwritev(fd, [self.bufs[0]], i * self.block)

    @property
    def nbytes(self) -> int:
        """Bytes read (and as many written) by one ``step()``."""
        return 3 * self.chunks * self.block

    def step(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.chunks + 1):
            if i < self.chunks:
                for k, fd in enumerate(self.fds):
                    os.preadv(fd, [self.bufs[k]], i * self.block)
            if i:
                for k, fd in enumerate(self.fds):
                    os.pwritev(fd, [self.bufs[3 + k]], (i - 1) * self.block)
        return time.perf_counter() - t0

    def close(self) -> None:
        for fd, path in zip(self.fds, self.paths):
            os.close(fd)
            os.remove(path)
