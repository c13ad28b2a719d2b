"""A 2-D mesh's collectives: shard within a node, replicate across nodes (HSDP), the optimizer state still sharded
over every rank by default.

A mesh of ``R`` replicas x ``S`` shard ranks (``("replicate", "shard")``, FSDP2's convention: the shard group is a
node's ranks, the replicate group one rank of each node). :class:`MeshCommunicator` is the communicator the rest of
the engine sees; it composes the two groups' own communicators (each with its streams on CUDA):

- **State sharded over all R x S ranks** (default, ``replicate_state=False``). The layout is the 1-D layout of
  ``N = R x S`` ranks, and rank ``(r, s)`` is its slice ``k = s * R + r``: the ``R`` slices of shard rank ``s`` are
  contiguous (its *chunk*, ``1/S`` of a bucket). So a reduce-scatter is the shard group's reduce-scatter into the
  chunk (inside the node) and then the replicas' reduce-scatter of the chunk into the slice (across nodes, ``1/S``
  of the bytes); an all-gather is the replicas' all-gather of the slice into the chunk, then the shard group's of the
  chunk into the bucket (on gloo, bf16 gradients summed in fp32 on nodes of 2 ranks are reduce-scattered once over
  every rank instead: as many bytes across nodes in one collective, :meth:`MeshCommunicator.flat_reduce_scatter`).
  Across nodes travel ``2 (R-1)/R x Psi/S`` bytes per rank and step, what FSDP2 HSDP's all-reduce of the chunk
  sends, but each rank keeps ``1/N`` of the master and moments instead of ``1/S``. Because the layout is the 1-D
  layout of ``N`` ranks, the state, its checkpoints (written once: every rank holds different bytes) and their
  consolidation are those of ``N`` ranks: a checkpoint moves between ``R x S`` meshes and 1-D runs like one between
  world sizes. Stage 3 keeps each rank's chunk of the parameters (``1/S`` of them: what the
  shard group gathers from, so forward and backward gathers never leave the node) and after each update the
  replicas all-gather their updated slices into it (``state.sharded_params.ChunkedParams``).
- **State replicated over the R replicas** (``replicate_state=True``, FSDP2's HSDP): the layout is that of the
  ``S`` shard ranks; a reduce-scatter is the shard group's into the slice, then an all-reduce of the slice over the
  replicas (one collective latency fewer per bucket); parameters are gathered inside the shard group only; each
  replica updates the same slice to the same bits. Checkpoints are written by replica 0 only.

The process identity (``process_rank``: the global rank) is what host agreements and error messages use; ``rank``
is the layout's.

On CPU (gloo) a two-level collective's second level (``two_level.py``) starts when it is waited for, or when this
communicator starts its next collective (whichever comes first; the same points on every rank, so each group sees
its collectives in the same order everywhere); on CUDA both levels are queued at once, the second on its group's
stream behind an event of the first (no host wait).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..kernels.dispatch import accumulate_into
from .base import DONE, CommCounts, Communicator, Pending
from .compress import InterNodeCodec
from .gloo import GlooCommunicator
from .two_level import TwoLevel, local_work


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


class MeshCommunicator(Communicator):
    """The collectives of a ``replicate`` x ``shard`` mesh (see the module's docstring). ``shard`` and
    ``replicate``: the two groups' communicators (this rank's row and column); ``world``: one over every rank of the
    mesh (host agreements, the step's statistics)."""

    name = "mesh"

    def __init__(
        self, shard: Communicator, replicate: Communicator, world: Communicator, replicate_state: bool,
        grid: list[list[int]], inter_node_dtype: Optional[torch.dtype] = None,
    ):  # fmt: skip
        self.shard, self.replicate, self.world, self.grid = shard, replicate, world, grid
        self.replicate_state = replicate_state
        # inter_node_reduce_dtype: the replicas exchange encoded node sums (compress.py); None: fp32 as sent
        self.codec = None if inter_node_dtype is None else InterNodeCodec(inter_node_dtype)
        if self.codec is not None and replicate_state:
            raise ValueError("MeshCommunicator: inter_node_dtype needs the state sharded over every rank")
        R, S = replicate.world_size, shard.world_size
        self.replicas, self.replica = R, replicate.rank
        world_size = S if replicate_state else R * S
        rank = shard.rank if replicate_state else shard.rank * R + replicate.rank
        super().__init__(world.group, world.device, world_size, rank)
        self.reduce_scatter_stream, self.all_gather_stream = shard.reduce_scatter_stream, shard.all_gather_stream
        self.cpu_group = world.cpu_group
        self.process_rank, self.process_count = world.process_rank, world.process_count
        # the mesh's convention: the shard group inside a node, the replicas (and so the world) across nodes; the
        # world's S - 1 of N - 1 peers share a node (its flat reduce-scatter's part inside the node)
        shard.counts.link, replicate.counts.link, world.counts.link = "intra", "inter", "inter"
        world.counts.intra_share = (S - 1) / max(1, R * S - 1)
        for c in (shard, replicate, world):  # one position: the divergence watch sees every group's collectives
            c.position = self.position
        self._unlaunched: list[TwoLevel] = []  # CPU: second levels not started yet, in order
        self._process_slices: Optional[torch.Tensor] = None  # the flat reduce-scatter's send order, by process
        # no_sync(): each bucket's node-reduced gradient sum (1/S of it, in reduce_dtype) until it crosses nodes
        self._holding = False
        self._held: dict = {}

    # ---------------------------------------------------------------- what the engine reads
    @property
    def counts(self):
        return _MeshCounts(self)

    @counts.setter
    def counts(self, value) -> None:  # Communicator.__init__ assigns one; the groups' own are what count
        pass

    @property
    def watch(self):
        return self.world.watch

    @watch.setter
    def watch(self, value) -> None:
        for c in (getattr(self, "shard", None), getattr(self, "replicate", None), getattr(self, "world", None)):
            if c is not None:
                c.watch = value

    def layout_ranks(self) -> list[Optional[int]]:
        """Every process's layout rank, in process order (None: a replica that does not write checkpoints)."""
        R = self.replicas
        where = {}
        for row in self.grid:  # a row: one shard group; a column: one replicate group (group ranks: sorted order)
            for s, g in enumerate(sorted(row)):
                where[g] = [None, s]
        for column in zip(*self.grid):
            for r, g in enumerate(sorted(column)):
                where[g][0] = r
        out: list[Optional[int]] = []
        for g in range(len(where)):
            r, s = where[g]
            out.append((s if r == 0 else None) if self.replicate_state else s * R + r)
        return out

    @property
    def writes_checkpoints(self) -> bool:
        return not self.replicate_state or self.replica == 0

    # ---------------------------------------------------------------- policy
    def wire_dtype(self, grad_dtype, reduce_dtype):
        return self.shard.wire_dtype(grad_dtype, reduce_dtype)

    def prescale(self, grad_dtype, reduce_dtype) -> float:
        # 1.0: each level's exact mean divides by its own size (gloo, fp32); else the sums of both levels make the
        # mean of values pre-scaled by 1/(R x S)
        if self.shard.prescale(grad_dtype, reduce_dtype) == 1.0:
            return 1.0
        return 1.0 / (self.replicas * self.shard.world_size)

    def flat_reduce_scatter(self, wire_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
        """Whether a bucket's gradients are reduce-scattered by one all-to-all over every rank instead of the two
        levels: on gloo, state sharded over every rank, no inter-node codec, ``R, S > 1``, and when it sends no
        more bytes across nodes. gloo's reduce-scatter is an all-to-all: over all ``N = R x S`` ranks a rank sends
        ``wire x n (N - S) / N`` bytes of a bucket of ``n`` elements to the other nodes; the two levels send the
        node's sums, ``reduce x n / S x (R - 1) / R``. The first is no more than the second exactly when
        ``wire x S <= reduce``: bf16 gradients summed in fp32 on nodes of 2 ranks (the two levels would send as
        many bytes across, in two collectives where one does: bench/results/hsdp_launch_variants.md). On nodes
        of more ranks, with fp32 gradients or bf16 sums, the two levels send fewer bytes across and are kept."""
        if self.replicate_state or self.codec is not None or self.replicas == 1 or self.shard.world_size == 1:
            return False
        if not isinstance(self.world, GlooCommunicator):  # NCCL's algorithms are its own: the two levels
            return False
        return wire_dtype.itemsize * self.shard.world_size <= reduce_dtype.itemsize

    def _divides(self, grad_dtype, reduce_dtype) -> bool:
        return self.prescale(grad_dtype, reduce_dtype) == 1.0

    def _segments(self, bucket_numel, wire_dtype, reduce_dtype, accumulate) -> tuple[int, int, int]:
        """Bytes of the workspace's three parts: the shard level's, the chunk (in ``reduce_dtype``), the replica
        level's."""
        chunk = bucket_numel // self.shard.world_size
        first = self.shard.workspace_bytes(bucket_numel, wire_dtype, reduce_dtype, False)
        if self.replicate_state:
            second = 0
        elif self.codec is not None:
            second = self.codec.workspace_bytes(chunk, self.replicas)
        else:
            second = self.replicate.workspace_bytes(chunk, reduce_dtype, reduce_dtype, accumulate)
        return _aligned(first), _aligned(chunk * reduce_dtype.itemsize), _aligned(second)

    def workspace_bytes(self, bucket_numel, wire_dtype, reduce_dtype, accumulate) -> int:
        two_levels = sum(self._segments(bucket_numel, wire_dtype, reduce_dtype, accumulate))
        if not self.flat_reduce_scatter(wire_dtype, reduce_dtype):
            return two_levels
        # the flat path: the send in process order, then the world's own workspace (no_sync() takes the two levels)
        flat = _aligned(bucket_numel * wire_dtype.itemsize)
        flat += self.world.workspace_bytes(bucket_numel, wire_dtype, reduce_dtype, accumulate)
        return max(two_levels, flat)

    # ---------------------------------------------------------------- collectives
    def _advance(self) -> None:
        """CPU: start the second level of every earlier two-level collective (in order) before a new one."""
        while self._unlaunched:
            self._unlaunched.pop(0).launch()

    def _two_level(self, first: Pending, then: Callable[[], Pending], second: Communicator, stream_kind: str):
        stream = getattr(second, stream_kind)
        pending = TwoLevel(first, then, stream)
        if stream is None:
            self._unlaunched.append(pending)
        return pending

    def start_reduce_scatter(
        self, send, out, *, reduce_dtype, accumulate, workspace=None, bucket=None, phase=None
    ) -> Pending:
        """The shard group's reduce-scatter into the chunk, then the replicas' (or their all-reduce) into ``out``.
        Under ``no_sync()`` (:meth:`hold_replicas`) the chunk is added to the bucket's held sum instead and ``out``
        gets nothing of this micro-batch (zeros, or unchanged with ``accumulate``); the synchronising micro-batch
        (or :meth:`start_release`) sends the sum across nodes once. ``bucket``: the key the held sum is kept under
        (and the collectives' label)."""
        self._advance()
        n = send.numel()
        if not self._holding and bucket not in self._held and self.flat_reduce_scatter(send.dtype, reduce_dtype):
            return self._flat_reduce_scatter(send, out, reduce_dtype, accumulate, workspace, bucket, phase)
        a, c, b = self._segments(n, send.dtype, reduce_dtype, accumulate)
        if workspace is None or workspace.dtype != torch.uint8 or workspace.numel() < a + c + b:
            raise ValueError(f"start_reduce_scatter: `workspace` must be a uint8 buffer of at least {a + c + b} bytes")
        chunk = workspace[a : a + c].view(reduce_dtype)[: n // self.shard.world_size]
        first = self.shard.start_reduce_scatter(
            send,
            chunk,
            reduce_dtype=reduce_dtype,
            accumulate=False,
            workspace=workspace[:a],
            bucket=bucket,
            phase=phase,
        )
        stream = self.replicate.reduce_scatter_stream
        if self._holding:

            def hold() -> None:
                held = self._held.get(bucket)
                if held is None:
                    self._held[bucket] = chunk.clone()
                else:
                    held.add_(chunk)
                if not accumulate:
                    out.zero_()

            return self._two_level(
                first, lambda: local_work(stream, hold, (chunk, out)), self.replicate, "reduce_scatter_stream"
            )
        held = self._held.pop(bucket, None)

        def then() -> Pending:
            if held is not None:  # the synchronising micro-batch: the held micro-batches' sums go with it
                local_work(stream, lambda: chunk.add_(held), (chunk, held))
            return self._across(chunk, out, accumulate, send.dtype, reduce_dtype, workspace[a + c :], bucket)

        return self._two_level(first, then, self.replicate, "reduce_scatter_stream")

    def _flat_reduce_scatter(self, send, out, reduce_dtype, accumulate, workspace, bucket, phase) -> Pending:
        """One all-to-all over every rank (:meth:`flat_reduce_scatter`): ``send``'s slices reordered so that
        process ``g`` receives the slice of its layout rank, then the world's reduce-scatter (every rank's slices
        summed in process order, divided by ``N``)."""
        n, N = send.numel(), self.world.world_size
        need = self.workspace_bytes(n, send.dtype, reduce_dtype, accumulate)
        if workspace is None or workspace.dtype != torch.uint8 or workspace.numel() < need:
            raise ValueError(f"start_reduce_scatter: `workspace` must be a uint8 buffer of at least {need} bytes")
        if self._process_slices is None:
            self._process_slices = torch.tensor(self.layout_ranks(), dtype=torch.int64)
        a = n * send.element_size()
        ordered = workspace[:a].view(send.dtype)
        torch.index_select(send.view(N, -1), 0, self._process_slices, out=ordered.view(N, -1))
        return self.world.start_reduce_scatter(
            ordered, out, reduce_dtype=reduce_dtype, accumulate=accumulate, workspace=workspace[_aligned(a) :],
            bucket=bucket, phase=phase,
        )  # fmt: skip

    def _across(self, chunk, out, accumulate, wire_dtype, reduce_dtype, workspace, bucket=None) -> Pending:
        """The node-reduced ``chunk`` across nodes into ``out``."""
        if self.replicate_state:
            return self._all_reduce_chunk(chunk, out, accumulate, self._divides(wire_dtype, reduce_dtype), bucket)
        if self.codec is not None:
            divide = self._divides(wire_dtype, reduce_dtype)
            return self._compressed_across(chunk, out, accumulate, divide, workspace, bucket)
        return self.replicate.start_reduce_scatter(
            chunk, out, reduce_dtype=reduce_dtype, accumulate=accumulate, workspace=workspace, bucket=bucket
        )

    def hold_replicas(self, hold: bool) -> bool:
        previous, self._holding = self._holding, hold
        return previous

    def held_keys(self) -> frozenset:
        return frozenset(self._held)

    def start_release(self, key, out, accumulate: bool) -> Pending:
        self._advance()
        held = self._held.pop(key)
        reduce_dtype = held.dtype
        workspace = None
        if self.codec is not None:
            need = self.codec.workspace_bytes(held.numel(), self.replicas)
            workspace = torch.empty(need, dtype=torch.uint8, device=held.device)
        elif not self.replicate_state:
            need = self.replicate.workspace_bytes(held.numel(), reduce_dtype, reduce_dtype, accumulate)
            workspace = torch.empty(need, dtype=torch.uint8, device=held.device)
        return self._across(held, out, accumulate, reduce_dtype, reduce_dtype, workspace, key)

    def drop_held(self) -> None:
        self._held.clear()

    def _compressed_across(self, chunk, out, accumulate: bool, divide: bool, workspace, bucket=None) -> Pending:
        """inter_node_reduce_dtype: encode the chunk's R slices, one all-to-all of the messages, then the decoded
        messages added in fp32 in replica order (compress.py's error model) into ``out``. The encoding runs when
        the collective is issued: on CPU when the second level starts, on CUDA queued on the replicas' stream
        behind the first level's event."""
        codec, replicate = self.codec, self.replicate
        send, received, decoded, total = codec.split(workspace, chunk.numel(), self.replicas)
        target = out if not accumulate and out.dtype == torch.float32 else total

        def collective():
            codec.encode(chunk, send)
            return dist.all_to_all_single(received.view(-1), send.view(-1), group=replicate.group, async_op=True)

        def epilogue() -> None:
            codec.sum_into(received, decoded, target, divide)
            if accumulate:
                accumulate_into(out, target)
            elif target is not out:
                out.copy_(target)

        tensors = (send, chunk, out, workspace)
        stream = replicate.reduce_scatter_stream
        return replicate._on_stream(stream, "reduce_scatter", collective, epilogue, tensors, bucket)

    def _all_reduce_chunk(self, chunk, out, accumulate: bool, divide: bool, bucket=None) -> Pending:
        """replicate_state: sum the shard group's reduced slice over the replicas, into ``out``."""
        replicate = self.replicate

        def epilogue() -> None:
            if divide:
                chunk.div_(replicate.world_size)
            if accumulate:
                accumulate_into(out, chunk)
            else:
                out.copy_(chunk)

        collective = lambda: dist.all_reduce(chunk, group=replicate.group, async_op=True)  # noqa: E731
        stream = replicate.reduce_scatter_stream
        return replicate._on_stream(stream, "all_reduce", collective, epilogue, (chunk, out), bucket)

    def start_all_gather(self, output, input, bucket=None) -> Pending:
        """Gather every rank's ``input`` into ``output``: a slice of ``1/N`` (stages 1 and 2's updated slice) over
        the replicas into the chunk, then over the shard group; a chunk (``1/S``: stage 3's kept parameters, or
        every gather with ``replicate_state``) over the shard group only, inside the node."""
        self._advance()
        S = self.shard.world_size
        if input.numel() * S == output.numel():
            return self.shard.start_all_gather(output, input, bucket)
        if input.numel() * S * self.replicas != output.numel():
            raise ValueError(
                f"start_all_gather: `input` must be 1/{S} or 1/{S * self.replicas} of `output`, got {input.numel()} "
                f"and {output.numel()} elements"
            )
        chunk = output.view(S, -1)[self.shard.rank]
        first = self.replicate.start_all_gather(chunk, input, bucket)
        return self._two_level(
            first, lambda: self.shard.start_all_gather(output, chunk, bucket), self.shard, "all_gather_stream"
        )

    def start_replica_gather(self, chunk, slice_) -> Pending:
        """Stage 3 (state sharded over every rank): the replicas' updated slices into this rank's chunk."""
        self._advance()
        return self.replicate.start_all_gather(chunk, slice_)

    def start_all_reduce(self, tensor) -> Pending:
        self._advance()
        return self.world.start_all_reduce(tensor)

    def reduce_step_stats(self, flags: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        self._advance()
        summed = self.world.reduce_step_stats(flags, stats)
        if self.replicate_state:  # every replica contributed the same shard's values: the mean over replicas
            stats.div_(self.replicas)
            summed = summed / self.replicas
        return summed

    def broadcast(self, tensor, src, group=None) -> None:
        self.world.broadcast(tensor, src, group)

    def agree(self, value: int, timeout: Optional[float] = None) -> list[int]:
        self._advance()
        return self.world.agree(value, timeout)

    def abort(self) -> None:
        for c in (self.shard, self.replicate, self.world):
            c.abort()


class _MeshCounts:
    """What the mesh's groups sent, added up (``comm_stats()``); the shard group's counted intra-node, the
    replicas' inter-node."""

    def __init__(self, comm: MeshCommunicator):
        self.parts = [comm.shard.counts, comm.replicate.counts, comm.world.counts]

    def as_dict(self) -> dict[str, int]:
        return CommCounts.summed(self.parts)


__all__ = ["DONE", "MeshCommunicator", "TwoLevel"]
