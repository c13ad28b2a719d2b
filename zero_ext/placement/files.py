"""Arrays in files (fp32, or bf16 / int8 moments), read and written by I/O threads: the NVMe placement's working memory.

One file per (rank, flat group, kind) under a directory the placement creates, each in its kind's dtype. I/O is plain ``preadv``/``pwritev``
on a reader and a writer thread (they release the GIL, so reads ahead and writes behind overlap the CPU AdamW
kernel), with ``O_DIRECT`` where the filesystem accepts it (no page cache: what is read comes from the disk, what is
written leaves memory; tmpfs refuses it, and then the page cache is used). O_DIRECT needs the memory address, the
file offset and the length aligned to the device's block: buffers come from ``aligned_buffer`` (page-aligned, in
huge pages from 2 MiB up) and every transfer covers whole ``ALIGN``-byte blocks; files are sized up to a whole block.

Why threads and not a library: liburing/libaio are not on PyPI for Python in a form that would not add a compiled
dependency, and for the few, large, sequential transfers of a step (megabytes each; the kernel splits each into many
device requests) one read and one write in flight keep a disk busy; the benchmark (bench/bench_offload.py) measures
how close a step comes to the disk's own sequential bandwidth.
"""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

ALIGN = 4096  # bytes: a page, and a multiple of every device's logical block size we expect
ALIGN_ELEMENTS = ALIGN // 4  # fp32 elements per aligned block
FILE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}


def block_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` per aligned block (a transfer starts and ends on one)."""
    return ALIGN // dtype.itemsize


def granule(dtypes: Sequence[torch.dtype]) -> int:
    """Elements that are whole blocks in every one of ``dtypes``' files (fp32 only: 1024; with bf16: 2048): transfers
    of every kind at once start and end on a multiple of it."""
    return max((block_elements(d) for d in dtypes), default=ALIGN_ELEMENTS)


def file_nbytes(numel: int, dtypes: dict[str, torch.dtype]) -> dict[str, int]:
    """Each kind's file size for ``numel`` elements: whole granules (every file covers the same elements, so a
    transfer of the last granule stays inside each)."""
    per = granule(list(dtypes.values()))
    padded = max(per, -(-numel // per) * per)
    return {k: padded * d.itemsize for k, d in dtypes.items()}


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of ``nbytes``, backed by an anonymous mapping; from 2 MiB up it starts on a
    huge-page boundary and is advised to use transparent huge pages.

    Why huge pages: an O_DIRECT transfer pins the buffer's pages and hands the device one segment per physically
    contiguous run, and a request holds a bounded number of segments (254 on this repository's virtio disk, so
    ~1 MB per request from scattered 4 KiB pages, up to its 4 MiB request limit from 2 MiB pages). Measured there
    (bench/results/disk_modes.md): the sequential O_DIRECT probe read 0.88-1.58 GB/s and wrote 2.6-3.9 GB/s from
    4 KiB-page buffers, varying from process to process, and read 2.45-2.55 GB/s and wrote 5.4-5.6 GB/s from
    huge-page ones; an nvme step at 128M params took 2335 ms with 4 KiB-page windows and 1187 ms with these
    (bench/results/trace_nvme_step.md). Linux gives anonymous memory huge pages only where advised when THP is in
    ``madvise`` mode (a common default), so advise; where THP is off, or not built into the kernel, the buffer has
    4 KiB pages. The alignment slack is never touched and takes no memory."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    huge = size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    region = mmap.mmap(-1, size + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    start = 0
    if huge:
        start = -t.data_ptr() % HUGE_PAGE  # a multiple of the page size: the mapping starts on a page
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:  # a kernel built without transparent huge pages (EINVAL): 4 KiB pages, slower I/O
            pass
    t = t[start : start + nbytes]
    t._zero_ext_mapping = region  # keep the mapping alive with the tensor
    return t


class StateFiles:
    """``kinds`` arrays of ``numel`` elements, one file each, in ``directory`` (created here; the files are deleted,
    and the directory when empty, by :meth:`close`, when this object is collected, or at exit). ``dtypes``: each
    kind's dtype (default fp32)."""

    def __init__(self, directory: str, stem: str, kinds: Sequence[str], numel: int,
                 dtypes: Optional[dict[str, torch.dtype]] = None):  # fmt: skip
        self.directory, self.numel = directory, numel
        self.dtypes = {k: (dtypes or {}).get(k, torch.float32) for k in kinds}
        self.nbytes_of = file_nbytes(numel, self.dtypes)
        os.makedirs(directory, exist_ok=True)
        self.paths = {k: os.path.join(directory, f"{stem}.{k}.{FILE_SUFFIX[d]}") for k, d in self.dtypes.items()}
        self.direct = True
        self.fds: dict[str, int] = {}
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        pools: list[ThreadPoolExecutor] = []  # filled below; the finalizer waits for their I/O before closing fds
        # Runs once: close() calls it, else the garbage collector or the interpreter's exit does. The I/O threads'
        # tasks hold no reference to this object (module-level functions of fds and buffers), so a dropped optimizer
        # is collected even with a read ahead in flight, and its files go as soon as that read is done.
        self._remove = weakref.finalize(self, _remove_files, self.fds, list(self.paths.values()), directory, pools)
        # A multiprocessing child (mp.spawn, torch.multiprocessing) leaves through os._exit: no atexit, so the
        # finalizer above would not run at its exit; multiprocessing runs its own finalizers there.
        multiprocessing.util.Finalize(self, self._remove, exitpriority=0)
        try:
            for kind, path in self.paths.items():
                self.fds[kind] = self._open(path)
                # Reserve the blocks now: a full disk fails here, not in the middle of a step's write-behind.
                # The reserved blocks read as zeros (every kind but the master starts at zero).
                os.posix_fallocate(self.fds[kind], 0, self.nbytes_of[kind])
        except OSError as e:
            self.close()
            raise OSError(
                e.errno, f"zero_ext offload: cannot create {self.nbytes_of[kind]} bytes in {directory}: {e.strerror}"
            )
        except BaseException:
            self.close()
            raise
        # One reader and one writer thread: a read ahead (which the next chunk's update waits for) never queues
        # behind the writes behind, and the disk sees one read and one write in flight. Four threads did worse with
        # 4 KiB-page buffers (64-68 % of the disk against 67-93 % for one or two, at 128M params, not kept in a
        # results file). With huge-page buffers, at 128M (bench/results/trace_nvme_step.md): reader + writer 1187 ms
        # a step, one thread for both 1244 ms (reads then run alone at 2.26 GB/s instead of 1.37 beside the writes,
        # but the thread idles while the kernel updates a chunk).
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="zero_ext-nvme-read")
        self._writers = ThreadPoolExecutor(1, thread_name_prefix="zero_ext-nvme-write")
        pools += [self._readers, self._writers]

    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:  # e.g. tmpfs: no O_DIRECT; buffered I/O through the page cache instead
                self.direct = False
        self.direct = False
        return os.open(path, flags, 0o600)

    def _offset(self, kind: str, start: int, buf: torch.Tensor) -> int:
        """Byte offset of element ``start`` of ``kind``'s file; checks that the transfer is whole aligned blocks."""
        offset = start * self.dtypes[kind].itemsize
        if offset % ALIGN or buf.numel() % ALIGN or buf.data_ptr() % ALIGN:
            raise ValueError("StateFiles: transfers must be whole aligned blocks (start, length and address)")
        return offset

    def read_async(self, kind: str, start: int, buf: torch.Tensor) -> Future:
        """Fill ``buf`` (aligned uint8) with the file's bytes from element ``start`` (aligned), on an I/O thread."""
        offset = self._offset(kind, start, buf)
        return self._readers.submit(pread_all, self.fds[kind], self.paths[kind], offset, buf)

    def write_async(self, kind: str, start: int, buf: torch.Tensor) -> Future:
        offset = self._offset(kind, start, buf)
        return self._writers.submit(pwrite_all, self.fds[kind], offset, buf)

    def _block_range(self, kind: str, start: int, numel: int) -> tuple[int, int, torch.Tensor]:
        """The whole blocks around elements [start, start + numel): (first element, buffer of them read)."""
        per = block_elements(self.dtypes[kind])
        lo, hi = start // per * per, -(-(start + numel) // per) * per
        buf = aligned_buffer((hi - lo) * self.dtypes[kind].itemsize)
        pread_all(self.fds[kind], self.paths[kind], self._offset(kind, lo, buf), buf)
        return lo, buf

    def read_range(self, kind: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) as a new tensor of the kind's dtype (any alignment; synchronous)."""
        lo, buf = self._block_range(kind, start, numel)
        return buf.view(self.dtypes[kind])[start - lo : start - lo + numel].clone()

    def write_range(self, kind: str, start: int, values: torch.Tensor) -> None:
        """Overwrite elements from ``start`` with ``values`` (any alignment; cast to the kind's dtype, rounding to
        nearest even; synchronous read-modify-write)."""
        numel = values.numel()
        lo, buf = self._block_range(kind, start, numel)
        buf.view(self.dtypes[kind])[start - lo : start - lo + numel].copy_(values.reshape(-1))
        pwrite_all(self.fds[kind], self._offset(kind, lo, buf), buf)

    def close(self) -> None:
        """Finish the I/O in flight, close and delete the files (the state is working memory; checkpoints are the
        durable copy). A second call does nothing."""
        for pool in (self._readers, self._writers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._readers = self._writers = None
        self._remove()


def pread_all(fd: int, path: str, offset: int, buf: torch.Tensor) -> int:
    """``buf``'s bytes from ``offset`` of the file (``path`` names it in errors); the bytes read."""
    mv, done = memoryview(buf.numpy()), 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read of {path} at byte {offset + done}")
        done += n
    return done


def pwrite_all(fd: int, offset: int, buf: torch.Tensor) -> int:
    mv, done = memoryview(buf.numpy()), 0
    while done < len(mv):
        done += os.pwritev(fd, [mv[done:]], offset + done)
    return done


def _remove_files(fds: dict[str, int], paths: list[str], directory: str, pools: list[ThreadPoolExecutor]) -> None:
    for pool in pools:  # no read or write may be in flight on an fd about to close (and be reused)
        pool.shutdown(wait=True)
    for kind, fd in list(fds.items()):
        os.close(fd)
        del fds[kind]
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)  # only when empty: other flat groups' files may still be there
    except OSError:
        pass
