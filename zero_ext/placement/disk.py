"""``offload="nvme"`` (ZeRO-Infinity): the update rule's state (fp32 master and moments) in files, streamed through a bounded
window of host memory; the reduced gradient shard stays in host memory (landed as ``offload="cpu"`` lands it).

The step walks the rank's shard in *chunks* (whole 4 KiB blocks, sized so that ``slots`` chunks of every kind
plus their new parameters fit the window): while the CPU kernel updates chunk ``i``, chunk ``i + 1`` is read
ahead and chunk ``i - 1`` written behind, on I/O threads (:mod:`.files`). A chunk's units are its intersections
with the buckets (the update's step counters and run boundaries are per bucket); a bucket's all-gather starts once
the chunk holding its end is updated. After the last chunk, ``step_done`` waits for every write: when ``step()``
returns, the files hold the new state. It then reads the next step's first chunks into the slots they will use, so
that those reads run during forward and backward instead of at the start of the next step (one rank on this
repository's disk, iteration 67 -> 53 ms at 4M params, 225 -> 197 ms at 16M, 925 -> 796 ms at 64M, bitwise the
same training: bench/results/nvme_read_ahead.md). The slots are the window's own: no memory is added. Whatever
writes the files outside a step (a loaded state dict, the master following edited parameters) first drops what was
read ahead.

The files are this process's working memory, not a checkpoint: they are created when the optimizer is built,
deleted when it is closed, collected or the interpreter exits (a process killed with SIGKILL leaves them behind,
in a directory named after the rank, the host and the process, which the next optimizer using ``offload_dir`` on that
host reports: :mod:`.leftovers`). Save with :mod:`zero_ext.checkpoint` to keep the state.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Iterator, Optional, Sequence

import torch

from ..layout import Bucket, Layout, Range
from ..update.adamw import REMAINDER, UpdateRule
from ..update.protocol import PARAMETERS
from .device import BucketState, Unit, items_of, views_of
from .files import ALIGN, StateFiles, aligned_buffer, granule
from .host import HostGradients, copy_runs_to_device, fetch_params

SLOTS = 3  # chunks in the window: one updated, one read ahead, one written behind


def _window_bytes_per_element(rule: UpdateRule) -> int:
    """A chunk's bytes per element: every kind in the files and the new parameters (param dtype; none for fp32
    parameters, copied from the master). A remainder and int8 moments' scales stay in host memory, outside the
    window."""
    files = sum(k.itemsize for k in file_kinds(rule))
    return files + (rule.param_dtype.itemsize if rule.param_dtype != torch.float32 else 0)


def file_kinds(rule: UpdateRule) -> list:
    """The kinds in files, each in its own dtype (bf16 moments: bf16 files; int8 moments: their int8 codes). A
    remainder (2 bytes per element) and int8 moments' block scales (4/64 byte per element each) stay in host memory
    beside the 4-byte grad shard: the disk moves the per-element bytes only."""
    return [k for k in rule.kinds if k.name != REMAINDER and k.block == 1]


def host_kinds(rule: UpdateRule) -> list:
    """The kinds kept in host memory (see :func:`file_kinds`)."""
    return [k for k in rule.kinds if k.name == REMAINDER or k.block > 1]


def _granule(rule: UpdateRule) -> int:
    """Elements that are whole 4 KiB blocks of every file (1024 with fp32 files only, 2048 with bf16 ones)."""
    return granule([k.dtype for k in file_kinds(rule)])


def param_align_on_disk(rule: UpdateRule) -> int:
    """Where a rule of whole parameters needs its parameters to start in a shard on disk (a whole file block: the
    chunks the step streams then start at a parameter, :func:`parameter_chunks`)."""
    return _granule(rule)


def parameter_chunks(layout: Layout, rank: int, chunk: int) -> list[Range]:
    """The chunks of a shard of whole parameters (an owner layout whose parameters start at file blocks): cut only
    where a parameter starts, each at most ``chunk`` elements unless one parameter is larger (it is a chunk of its
    own). They tile the shard."""
    n, starts, cuts = layout.shard_numel, [], [0]
    for piece in layout.owned_pieces(rank):
        starts.append((piece.shard_range.start, piece.shard_range.end))
    for start, end in starts:
        if start > cuts[-1] and end - cuts[-1] > chunk:
            cuts.append(start)
    cuts.append(n)
    return [Range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def chunk_numel(window_bytes: int, rule: UpdateRule, shard_numel: int) -> int:
    """Elements per chunk: ``SLOTS`` chunks of every kind fit ``window_bytes``; whole blocks of every file; no
    larger than the shard needs."""
    per = _granule(rule)
    numel = window_bytes // (SLOTS * _window_bytes_per_element(rule)) // per * per
    needed = -(-shard_numel // per) * per
    return max(per, min(numel, needed))


def min_window_bytes(rule: UpdateRule) -> int:
    return SLOTS * _window_bytes_per_element(rule) * _granule(rule)


class _Slot:
    """One chunk's buffers in the window, with the I/O and the host-to-device copy that use them."""

    def __init__(self, numel: int, rule: UpdateRule, cuda: bool):
        kinds = file_kinds(rule)
        self.raw = {k.name: _io_buffer(numel * k.itemsize, cuda) for k in kinds}
        self.typed = {k.name: self.raw[k.name].view(k.dtype) for k in kinds}  # each kind in its dtype
        param_dtype = rule.param_dtype
        lowp = param_dtype != torch.float32
        self.param_out = torch.empty(numel, dtype=param_dtype, pin_memory=cuda) if lowp else None
        self.reads: list[Future] = []
        self.writes: list[Future] = []
        self.copied: Optional[torch.cuda.Event] = None

    def wait_free(self) -> None:
        """Its last chunk is written back and copied to the device (and no read into it is in flight, after a step
        that stopped early): the buffers may be overwritten."""
        _wait(self.reads)
        _wait(self.writes)
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def tensors(self) -> list[torch.Tensor]:
        return list(self.raw.values()) + ([self.param_out] if self.param_out is not None else [])


def _io_buffer(nbytes: int, cuda: bool) -> torch.Tensor:
    """A uint8 host buffer O_DIRECT accepts (page-aligned), pinned on CUDA so that copies from it are asynchronous."""
    if cuda:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if buf.data_ptr() % ALIGN == 0:
            return buf
    return aligned_buffer(nbytes)


def _wait(futures: list[Future]) -> None:
    try:
        for f in futures:
            f.result()
    finally:
        futures.clear()


class DiskState(HostGradients):
    location = "disk"

    def __init__(self, layout: Layout, params, device: torch.device, rule: UpdateRule, directory: str, stem: str,
                 window: int):  # fmt: skip
        # The files hold the kinds in their dtypes (bf16 moments: bf16 files, half the bytes moved). param_remainders'
        # int16 remainder stays in host memory beside the grad shard (2 bytes per element next to its 4): the disk
        # then moves the moments only, 8 bytes per element each way instead of 12 (4 with bf16 moments); the
        # master's high half is the parameters. Its tie bit is the sign bit of exp_avg_sq (rule.tie_kind): the step
        # moves the files' bytes as they are, so the bit goes to disk and back with its element; serialisers read and
        # write it through DeviceState.read / write.
        files = file_kinds(rule)
        self._init_gradients(layout, params, device, rule)
        n = layout.shard_numel
        self.kinds = tuple(k.name for k in files)
        self.itemsize = {k.name: k.itemsize for k in files}
        self.buffers = {k.name: torch.zeros(k.items(n), dtype=k.dtype) for k in host_kinds(rule)}
        self.files = StateFiles(directory, stem, self.kinds, n, {k.name: k.dtype for k in files})
        self.window_budget = window  # bytes: SLOTS chunks of every kind fit it (memory_report's bound)
        try:
            self.chunk = chunk_numel(window, rule, n)
            if rule.unit == PARAMETERS:  # chunks cut at parameters; the slots hold the largest
                self.chunks = parameter_chunks(layout, params.rank, self.chunk)
                self.chunk = max([self.chunk, *(self._blocks(c.numel) for c in self.chunks)])
                self.window_budget = max(window, SLOTS * self.chunk * _window_bytes_per_element(rule))
            else:
                self.chunks = [Range(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk)]
            self.slots = [_Slot(self.chunk, rule, self.cuda) for _ in range(SLOTS)]
            self._read_ahead = 0  # leading chunks already read (or being read) into their slots for the next step
            self._pristine = True  # the files were never written: they read as zeros (param_remainders: no tie bit)
            self.reset_master()
        except BaseException:
            self.files.close()
            raise

    # ---------------------------------------------------------------- the update
    def _start_read(self, i: int) -> None:
        if i < self._read_ahead:
            return  # read after the last step: the files have not changed since
        slot, chunk = self.slots[i % SLOTS], self.chunks[i]
        slot.wait_free()
        numel = self._blocks(chunk.numel)
        slot.reads = [
            self.files.read_async(k, chunk.start, slot.raw[k][: numel * self.itemsize[k]]) for k in self.kinds
        ]

    def _start_write(self, i: int) -> None:
        self._pristine = False
        slot, chunk = self.slots[i % SLOTS], self.chunks[i]
        numel = self._blocks(chunk.numel)
        slot.writes = [
            self.files.write_async(k, chunk.start, slot.raw[k][: numel * self.itemsize[k]]) for k in self.kinds
        ]

    def _blocks(self, numel: int) -> int:
        """``numel`` rounded up to whole blocks of every file (elements)."""
        per = _granule(self.rule)
        return -(-numel // per) * per

    def units(self, buckets: Sequence[Bucket]) -> Iterator[Unit]:
        wanted = {b.index for b in buckets}
        ahead = SLOTS - 2  # reads ahead of the chunk being updated; one slot is left to the write behind
        for i in range(min(ahead, len(self.chunks))):
            self._start_read(i)
        for i, chunk in enumerate(self.chunks):
            if i + ahead < len(self.chunks):
                self._start_read(i + ahead)
            slot = self.slots[i % SLOTS]
            _wait(slot.reads)
            if i == 0:  # chunk 1's read, skipped above if read ahead, is started: from here on read as usual
                self._read_ahead = 0
            self._dirty = False
            for bucket in self.layout.buckets:
                part = bucket.shard_range.intersect(chunk)
                if not part.numel or bucket.index not in wanted:
                    continue
                local = part.shifted(-chunk.start)  # in the slot's buffers
                out = None if slot.param_out is None else local.of(slot.param_out)
                kinds = {k: local.of(t) for k, t in slot.typed.items()}
                kinds.update(views_of(self.buffers, part, self.rule.blocks))  # a remainder, scales: host memory
                if self.rule.param_remainders:  # the high half from the parameters
                    fetch_params(self.params, bucket, part.shifted(-bucket.shard_offset), out)
                views = BucketState(kinds, part.of(self.grad), out, self.rule.blocks)
                self._slot = slot
                yield Unit(bucket, part.shifted(-bucket.shard_offset), views, part.end == bucket.shard_range.end)
            if self._dirty:  # some unit of the chunk updated: write it behind
                self._start_write(i)

    def unit_done(self, unit: Unit, updated: Sequence[Range]) -> None:
        if not updated:
            return
        self._dirty = True
        source = unit.views.param_out if unit.views.param_out is not None else unit.views.master
        copy_runs_to_device(self.params, unit, source, updated)
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot.copied = event

    def step_done(self) -> None:
        """Every chunk is back in its files (a failed write raises here, naming the file). Then the next step's
        first chunks are read ahead into the slots they will use, while forward and backward run."""
        for slot in self.slots:
            slot.wait_free()
        ahead = min(SLOTS - 1, len(self.chunks))
        for i in range(ahead):
            self._start_read(i)
        self._read_ahead = ahead

    def _drop_read_ahead(self) -> None:
        """The files are about to change outside a step: what was read ahead is stale (and a read that failed will
        be made again, by the next step, which then reports it)."""
        self._read_ahead = 0
        for slot in self.slots:
            try:
                _wait(slot.reads)
            except OSError:
                pass

    # ---------------------------------------------------------------- serialisers
    # DeviceState's codec converts (the joined master, the tie bits of param_remainders) over these two.
    def read_runs(self, kind: str, shard_range: Range) -> list[tuple[Range, torch.Tensor]]:
        """One run of fresh values: the kinds on disk are read into new memory whatever the cut."""
        return [(shard_range, self.read(kind, shard_range))]

    def stored(self, kind: str, shard_range: Range) -> torch.Tensor:
        if kind == "grad":
            return shard_range.of(self.grad)
        if kind in self.buffers:  # a remainder or int8 moments' scales, in host memory
            return items_of(kind, shard_range, self.rule.blocks).of(self.buffers[kind])
        return self.files.read_range(kind, shard_range.start, shard_range.numel)  # as kept: DeviceState.read widens

    def store(self, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        if kind == "grad" or kind in self.buffers:
            items_of(kind, shard_range, self.rule.blocks).of(self._buffer(kind)).copy_(values)
            return
        self._drop_read_ahead()
        self._pristine = False
        # No fp32 copy of ``values`` first: write_range converts them into its page-aligned buffer (an anonymous
        # mapping, unmapped when freed). A per-bucket fp32 temporary (16 MiB at the default 4M-element buckets) goes
        # to glibc's heap once its dynamic mmap threshold has risen past it, and the heap kept 32-80 MiB of them
        # after reset_master (construction), varying run to run: RSS grew 67-163 MiB past the grad shard and the
        # window, one 64M-element bf16 parameter at one rank (tests/engine/test_fragment_memory.py).
        self.files.write_range(kind, shard_range.start, values.detach())

    def _clear_ties(self) -> None:
        if not self._pristine:  # fresh files hold no tie bit: no read and write of the tie kind's file at construction
            super()._clear_ties()

    def host_view(self, kind: str, shard_range: Range) -> Optional[torch.Tensor]:
        return shard_range.of(self.grad) if kind == "grad" else None

    # ---------------------------------------------------------------- the ledger
    def tensors(self) -> dict[str, object]:
        return {**self.buffers, **self._landing_tensors(), "window": [t for s in self.slots for t in s.tensors()]}

    def where(self) -> dict[str, str]:
        kinds = {**dict.fromkeys(self.buffers, "host"), **dict.fromkeys(self.kinds, "disk")}
        return {**kinds, "window": "host", **self._landing_where()}

    def disk_bytes(self) -> int:
        return sum(self.files.nbytes_of.values())

    def disk_bytes_by_kind(self) -> dict[str, int]:
        return dict(self.files.nbytes_of)

    def close(self) -> None:
        try:
            for slot in getattr(self, "slots", []):
                slot.wait_free()
        finally:
            self.files.close()
