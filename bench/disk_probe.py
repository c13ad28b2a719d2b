"""The disk's own sequential bandwidth, in plain Python with no torch import: bench_offload.py measures it beside the
optimizer, bench/investigations/disk_modes.py in processes with and without torch loaded."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

ALIGN = 4096  # O_DIRECT alignment: zero_ext.placement.files.ALIGN (not imported: that module imports torch)
HUGE_PAGE = 2 << 20  # zero_ext.placement.files.HUGE_PAGE


def io_buffer(nbytes: int, pages: str = "huge") -> memoryview:
    """``nbytes`` of private anonymous memory, filled with random bytes, for O_DIRECT transfers. ``pages="huge"``:
    starting on a 2 MiB boundary and advised to use transparent huge pages, as the optimizer's window buffers are
    (zero_ext.placement.files.aligned_buffer); ``"4k"``: advised not to, so every 4 KiB page is its own piece of
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
