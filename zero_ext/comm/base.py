"""What every communicator is: the collectives the engine uses and the policy questions a backend answers, a
:class:`Pending` for an operation in flight, and the counters of what was sent.

[Note: streams]
On CUDA each communicator owns two side streams, one per purpose::

    compute     | backward ... grad hooks: cast into staging | ...        | step: adam(b0) adam(b1) ...
    reduce_     |        wait(compute) RS(b0) +accumulate(b0) RS(b1) ... |
      scatter   |                                                        |
    all_gather  |                                           wait(compute) AG(b0)   AG(b1) ...
    (the next forward, or the end of step(), waits on the AG events; step() on the RS events)

Every collective is issued on its stream after that stream waited for what the compute stream queued so far
(so it reads finished data); its epilogue (the local sum, the cast or accumulate into the grad shard) is queued
behind it on the same stream, and an event recorded after the epilogue completes the :class:`Pending`.
Waiting on it makes the *current stream* wait for that event: no host synchronisation. Staging buffers are
reused only after their Pending was waited for (the next write then queues behind the event). On CPU there are
no streams: gloo runs the transfer in its own threads and the epilogue runs inside the first ``wait()``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .divergence import RING, DivergenceWatch

# The profiler range each collective is launched in (bench/profile_overlap.py finds the device work by them).
PROFILER_LABELS = {kind: f"zero_ext::{kind}" for kind in ("reduce_scatter", "all_gather", "all_reduce")}


class CollectiveTimeout(RuntimeError):
    """Some rank did not reach a collective call within its timeout (it is not making the call at all)."""


class Pending:
    """One collective in flight with its epilogue, holding every tensor it reads or writes until it is waited
    for (FSDP2's ``(result, event)`` pairs): nothing it touches can be freed or reused early."""

    __slots__ = ("_work", "_event", "_device", "_epilogue", "_tensors", "_done", "_watch", "_seq")

    def __init__(
        self, work=None, event=None, device=None, epilogue: Optional[Callable[[], None]] = None, tensors=(),
        watch=None, seq: int = 0,
    ):  # fmt: skip
        self._work, self._event, self._device = work, event, device
        self._epilogue, self._tensors = epilogue, tensors
        self._watch, self._seq = watch, seq  # the divergence watch that waits for ``work`` (collective ``seq``)
        self._done = work is None and event is None and epilogue is None

    @property
    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        """CUDA: the current stream waits for the collective and its epilogue. CPU: block until the transfer
        finished, then run the epilogue. A second wait does nothing."""
        if self._done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            if self._work is not None:
                if self._watch is None:
                    self._work.wait()
                else:  # with a deadline; past it, the ranks' positions are compared (divergence.py)
                    try:
                        self._work.wait(self._watch.limit)
                    except RuntimeError as e:
                        self._watch.waited_past_deadline(e, self._work, self._seq)
            if self._epilogue is not None:
                self._epilogue()
        self._done = True
        self._work = self._epilogue = None
        self._tensors = ()

    def wait_on(self, stream) -> None:
        """CUDA: ``stream`` waits for the collective, and the pending stays to be waited for by its owner (a
        second consumer, such as offload's device-to-host copy stream). CPU: the same as :meth:`wait`."""
        if self._event is not None:
            stream.wait_event(self._event)
        else:
            self.wait()


DONE = Pending()  # an operation that needed no communication


class Position:
    """Where this rank is in zero_ext's collectives (``divergence.py``, which compares them): ``phase``/``module``
    are set by the hooks (:meth:`at`), and each collective is recorded as it is issued, labelled with the bucket its
    issuer names (an argument of the collective, ``bucket=``)."""

    __slots__ = ("count", "ring", "phase", "module", "step")

    def __init__(self):
        self.count = 0
        self.ring: list = [None] * RING
        self.phase, self.module, self.step = "construction", "", 0

    def at(self, phase: str, module: str = "") -> None:
        self.phase, self.module = phase, module

    def issued(self, kind: str, numel: int, bucket=None, phase=None) -> int:
        """One more collective (of ``bucket``, None: no bucket's); returns its count. ``phase``: the phase its issuer
        says it opens (:meth:`at` with no module), so that the issuer need not call in here separately."""
        if phase is not None:
            self.at(phase)
        self.count += 1
        self.ring[self.count % RING] = (self.count, kind, numel, bucket, self.phase, self.module, self.step)
        return self.count

    def recent(self) -> list:
        return sorted((e for e in self.ring if e is not None), key=lambda e: e[0])


class CommCounts:
    """Elements and bytes passed to each kind of collective since construction (ZeRO-1/2 promise 2*Psi
    elements per step; the benchmarks check it). Bytes depend on the dtype that travels.

    Also the *wire* bytes this rank sent, by link: a ring reduce-scatter or all-gather of ``n`` bytes over ``g``
    ranks sends ``(g-1)/g * n`` from every rank, an all-reduce twice that. ``link`` says which network the group's
    collectives cross: ``"inter"`` when the group spans nodes, ``"intra"`` when it stays in one (see
    :func:`link_of`; a mesh's shard group is intra-node and its replicate group inter-node, by the mesh's
    convention). ``as_dict()`` adds ``{kind}_{link}_node_bytes`` and the totals ``intra_node_bytes`` and
    ``inter_node_bytes``: what HSDP meshes promise to cut (``zero_ext.comm.hsdp``)."""

    KINDS = ("reduce_scatter", "all_gather", "all_reduce")
    LINKS = ("intra", "inter")

    def __init__(self, group_size: int = 1, link: str = "intra"):
        self.group_size, self.link = group_size, link
        # A group spanning nodes with several of its ranks per node (a mesh's world group): the share of a rank's
        # peers inside its node, whose part of each collective counts as intra-node. Exact for an all-to-all (the
        # gloo reduce-scatter: n/g to each peer); the share of peers for a ring's hops.
        self.intra_share = 0.0
        self._elements = dict.fromkeys(self.KINDS, 0)
        self._bytes = dict.fromkeys(self.KINDS, 0)
        self._wire = {(kind, link): 0 for kind in self.KINDS for link in self.LINKS}

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        self._elements[kind] += tensor.numel()
        self._bytes[kind] += n
        g = self.group_size
        wire = (2 if kind == "all_reduce" else 1) * (g - 1) * n // g
        intra = round(wire * self.intra_share) if self.link == "inter" else 0
        self._wire[(kind, self.link)] += wire - intra
        self._wire[(kind, "intra")] += intra

    def as_dict(self) -> dict[str, int]:
        """``{kind}_elements``, ``{kind}_bytes``, ``{kind}_{link}_node_bytes`` for every kind, and the wire totals
        ``intra_node_bytes`` and ``inter_node_bytes``."""
        out = {}
        for kind in self.KINDS:
            out[f"{kind}_elements"] = self._elements[kind]
            out[f"{kind}_bytes"] = self._bytes[kind]
            for link in self.LINKS:
                out[f"{kind}_{link}_node_bytes"] = self._wire[(kind, link)]
        for link in self.LINKS:
            out[f"{link}_node_bytes"] = sum(self._wire[(kind, link)] for kind in self.KINDS)
        return out

    @staticmethod
    def summed(parts: "list[CommCounts]") -> dict[str, int]:
        """The counts of several groups' communicators (a mesh's), added up."""
        total: dict[str, int] = {}
        for part in parts:
            for key, value in part.as_dict().items():
                total[key] = total.get(key, 0) + value
        return total


def link_of(world_size: int) -> str:
    """``"inter"`` when a group of ``world_size`` ranks spans nodes: more ranks than torchrun's
    ``LOCAL_WORLD_SIZE`` (ranks per node); ``"intra"`` otherwise, and where the variable is not set (mp.spawn, one
    machine)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return "inter" if local.isdigit() and 0 < int(local) < world_size else "intra"


class Communicator:
    """The collectives the engine uses, and the policy questions a backend answers for it."""

    name = "base"
    communicates = True  # False: one process; gradients go straight into the grad shard
    buckets_per_model = 8  # default bucket count for a model whose size does not clamp the bucket size

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, world_size: int, rank: int):
        self.group = group
        self.device = torch.device(device)
        self.world_size = world_size
        self.rank = rank
        self.counts = CommCounts(world_size, link_of(world_size))
        # The process's identity in host agreements (``agree`` answers in this order) and messages: the group's rank
        # here; a mesh's layout rank differs from it (hsdp.py).
        self.process_rank, self.process_count = rank, world_size
        # Where this rank is in its collectives, and the watch that compares every rank's position when a wait
        # lasts past ZeroAdamW's collective_timeout (None: plain waits). See divergence.py.
        self.position = Position()
        self.watch: Optional[DivergenceWatch] = None
        # Collectives of host objects (CPU tensors, pickled objects): a group with a CPU backend. NCCL replaces it.
        self.cpu_group = group
        # Two streams, one per purpose (see [Note: streams]); None on CPU.
        cuda = self.device.type == "cuda" and self.communicates
        # reduce_scatter: gradient reduction and its epilogue overlap backward on it.
        self.reduce_scatter_stream = torch.cuda.Stream(device=self.device) if cuda else None
        # all_gather: parameter gathers overlap the optimizer update and the next forward on it.
        self.all_gather_stream = torch.cuda.Stream(device=self.device) if cuda else None

    def layout_ranks(self) -> list:
        """Every process's layout rank, in process order (None: a replica that writes no checkpoint files)."""
        return list(range(self.world_size))

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes its shard files (a replica of replicated state does not)."""
        return True

    # ---------------------------------------------------------------- policy
    def wire_dtype(self, grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``grad_dtype`` travels in, for a mean in ``reduce_dtype``."""
        return reduce_dtype

    def prescale(self, grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> float:
        """What a gradient is multiplied by before it is sent (1/N where the collective sums)."""
        return 1.0 / self.world_size

    def workspace_bytes(self, bucket_numel: int, wire_dtype: torch.dtype, reduce_dtype, accumulate: bool) -> int:
        """Bytes of caller-owned workspace :meth:`start_reduce_scatter` needs for a bucket of ``bucket_numel``."""
        return 0

    # ---------------------------------------------------------------- no_sync across nodes (a mesh's; hsdp.py)
    def hold_replicas(self, hold: bool) -> bool:
        """``no_sync()``: keep reduced gradients inside the node (True) until the synchronising micro-batch; returns
        the previous setting. Nothing to hold without replicas."""
        return False

    def held_keys(self) -> frozenset:
        """The buckets whose node-reduced gradients wait to cross nodes (:meth:`start_release`)."""
        return frozenset()

    def start_release(self, key, out: torch.Tensor, accumulate: bool) -> Pending:
        """Send bucket ``key``'s held gradients across nodes into ``out`` (its grad shard)."""
        raise KeyError(key)

    def drop_held(self) -> None:
        """Forget the held gradients (``zero_grad()``)."""

    # ---------------------------------------------------------------- collectives
    def start_reduce_scatter(
        self,
        send: torch.Tensor,
        out: torch.Tensor,
        *,
        reduce_dtype: torch.dtype,
        accumulate: bool,
        workspace: Optional[torch.Tensor] = None,
        bucket=None,
        phase: Optional[str] = None,
    ) -> Pending:
        """Start turning every rank's ``send`` (a bucket in :meth:`wire_dtype`, pre-scaled by :meth:`prescale`)
        into this rank's slice of their mean in ``out`` (the fp32 grad shard of the bucket): written, or added
        with ``accumulate``. ``accumulate`` consumes ``send`` (it may be overwritten once transferred).
        ``workspace`` (bytes, :meth:`workspace_bytes`) and ``send`` must stay untouched until waited for.
        ``bucket``: the key of the bucket it reduces (labels the collective, ``divergence.py``; a mesh keeps a
        bucket's held sums under it, ``hsdp.py``). ``phase``: the phase it opens, recorded in the position before
        it (the first reduce-scatter of a stage-1/2 backward says "backward")."""
        raise NotImplementedError

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor, bucket=None) -> Pending:
        """Start gathering every rank's ``input`` into ``output`` (in place when ``input`` is this rank's slice
        of ``output``). The same on every backend that communicates (on the all-gather stream on CUDA).
        ``bucket``: the key of the bucket it gathers (labels the collective)."""
        collective = functools.partial(all_gather_flat, output, input, group=self.group, async_op=True)
        return self._on_stream(self.all_gather_stream, "all_gather", collective, None, (output, input), bucket)

    def start_all_reduce(self, tensor: torch.Tensor) -> Pending:
        """Start summing ``tensor`` over ranks, in place."""
        collective = functools.partial(dist.all_reduce, tensor, group=self.group, async_op=True)
        return self._on_stream(self.all_gather_stream, "all_reduce", collective, None, (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> None:
        """Collective, synchronous: every rank's ``tensor`` becomes rank ``src``'s (a rank of this group), over
        ``group`` (default: this communicator's; :attr:`cpu_group` for host tensors beside an NCCL group)."""
        if self.world_size > 1:
            group = self.group if group is None else group
            src_global = dist.get_global_rank(group, src) if group is not None else src
            dist.broadcast(tensor, src=src_global, group=group)

    def reduce_step_stats(self, flags: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """Collective: sum ``flags`` (a small fp32 CPU vector the host reads: per-parameter "got a gradient", an
        error flag) and ``stats`` (fp32 on the device: the norm's partial sums, reduced in place) over ranks;
        returns the summed flags, on the host, without reading the device."""
        raise NotImplementedError

    def agree(self, value: int, timeout: Optional[float] = None) -> list[int]:
        """Every rank's ``value`` (a small int64), synchronously: how ranks agree before acting, so that an error
        on one rank fails every rank instead of leaving the others waiting in a collective. With ``timeout``
        (seconds), a :class:`CollectiveTimeout` when some rank does not arrive in time (it is not calling)."""
        raise NotImplementedError

    def abort(self) -> None:
        """The ranks diverged (divergence.py): make whatever still waits on this group's collectives fail instead
        of waiting. Nothing to do for gloo (its waits are the host's own, which raises); NCCL aborts."""

    # ---------------------------------------------------------------- helpers
    def host_collective(self, kind: str, tensor: torch.Tensor, collective: Callable[[], object]) -> None:
        """Run a synchronous host collective (``collective()`` returns its work) counted and waited for like the
        engine's others: with the divergence watch's deadline (NCCL's host agreements on the CPU group)."""
        seq = self.position.issued(kind, tensor.numel())
        Pending(collective(), None, None, None, (tensor,), self.watch, seq).wait()

    def _on_stream(
        self,
        stream,
        kind: str,
        collective: Callable[[], object],
        epilogue: Optional[Callable[[], None]],
        tensors,
        bucket=None,
        phase: Optional[str] = None,
    ) -> Pending:
        """Issue ``collective()`` (its work) on ``stream``, counted (``tensors[0]``: what it sends) and recorded in
        the position (labelled ``bucket``), with ``epilogue`` behind it. ``collective`` is best torch's own function
        (a ``functools.partial``): control then leaves zero_ext here and does not come back into the caller."""
        # A named range per collective, so that a profiler trace shows which device work each one launched.
        label = PROFILER_LABELS[kind]
        self.counts.add(kind, tensors[0])
        seq = self.position.issued(kind, tensors[0].numel(), bucket, phase)
        if stream is None:
            with torch.profiler.record_function(label):
                return Pending(collective(), None, None, epilogue, tensors, self.watch, seq)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.profiler.record_function(label):
            work = collective()
            work.wait()  # the side stream waits for the collective's own (NCCL) stream
            if epilogue is not None:
                epilogue()
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(None, event, self.device, None, tensors)

    def _agree_on(self, device: torch.device, value: int, timeout: Optional[float], group=None) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        out = torch.empty(self.world_size, dtype=torch.int64, device=device)
        work = all_gather_flat(out, mine, group=self.group if group is None else group, async_op=True)
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while not work.is_completed():  # a query: no wait that could block past the deadline
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"not every rank of the {self.world_size} reached this call within {timeout:g} s"
                    )
                time.sleep(0.001)
        work.wait()
        return out.tolist()
