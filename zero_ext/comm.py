"""Asynchronous collectives on a side stream: reduce-scatter, all-gather and all-reduce.

On CUDA every collective is issued on a dedicated communication stream that first waits for the work the
compute stream has queued so far (so the collective reads finished data), and an event recorded after it
marks completion; waiting on a :class:`Pending` makes the *current stream* wait for that event: no host
synchronisation. On CPU (gloo) collectives run asynchronously in gloo's threads and waiting blocks.

gloo's ``reduce_scatter_tensor`` is slower than its ``all_reduce`` of the same buffer, although a
reduce-scatter needs to move only half the bytes (``bench/bench_collectives.py``; 3.3M fp32 elements over 2
ranks: 18.5 ms vs 14.8 ms). On gloo a reduce-scatter is therefore one ``all_to_all_single`` (each rank sends
slice j of the bucket to rank j: the (N-1)/N of the bucket a ring reduce-scatter also sends) into a receive
buffer, followed by a local sum of the N received slices in rank order (9.8 ms for the same buffer, sum
included). The caller provides that
receive buffer (``scratch``, :meth:`Communicator.scratch_numel` elements) so that it is allocated once and
counted in the memory ledger.

``then`` callbacks (e.g. accumulate a reduce-scatter output into the grad shard) run as soon as the result
is available: on CUDA they are enqueued on the communication stream right after the collective; on CPU
they run when the pending collective is first waited on.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (*_into_tensor / *_tensor -> *_single); older releases
# (the GPU machines' torch 2.11) only have the old names. Same arguments, same semantics.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """One in-flight collective (and its follow-up work)."""

    __slots__ = ("_work", "_event", "_device", "_then", "_done")

    def __init__(self, work, event, device: Optional[torch.device], then: Optional[Callable[[], None]]):
        self._work = work
        self._event = event
        self._device = device
        self._then = then
        self._done = False

    def wait(self) -> None:
        """CUDA: the current stream waits for the collective; CPU: block until it finished."""
        if self._done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            self._work.wait()
            if self._then is not None:
                self._then()
        self._done = True


class CommCounts:
    """Elements and bytes passed to each kind of collective since construction (ZeRO-1/2 promise 2*Psi
    elements per step; the benchmarks check it). Bytes depend on the dtype that travels."""

    KINDS = ("reduce_scatter", "all_gather", "all_reduce")

    def __init__(self):
        self._elements = dict.fromkeys(self.KINDS, 0)
        self._bytes = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self._elements[kind] += tensor.numel()
        self._bytes[kind] += tensor.numel() * tensor.element_size()

    def as_dict(self) -> dict[str, int]:
        """``{kind}_elements`` and ``{kind}_bytes`` for every kind."""
        out = {}
        for kind in self.KINDS:
            out[f"{kind}_elements"] = self._elements[kind]
            out[f"{kind}_bytes"] = self._bytes[kind]
        return out


class Communicator:
    """Collectives of one process group for buffers on one device."""

    def __init__(self, process_group: Optional[dist.ProcessGroup], device: torch.device):
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = device
        # NCCL has a real reduce-scatter; everything else (gloo) goes through all-to-all + a local sum.
        self.reduce_scatter_by_all_to_all = self.world_size > 1 and dist.get_backend(process_group) != "nccl"
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.counts = CommCounts()

    def _launch(self, collective: Callable[[], object], then: Optional[Callable[[], None]]) -> Pending:
        if self.stream is None:
            return Pending(collective(), None, None, then)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work = collective()
            work.wait()  # the comm stream waits for the collective's own (NCCL) stream
            if then is not None:
                then()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Pending(None, event, self.device, None)

    def scratch_numel(self, input_numel: int) -> int:
        """Elements of the receive buffer :meth:`reduce_scatter` needs for an input of ``input_numel``."""
        return input_numel if self.reduce_scatter_by_all_to_all else 0

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        then: Optional[Callable[[], None]] = None,
        scratch: Optional[torch.Tensor] = None,
        divide_by: int = 1,
    ) -> Pending:
        """Sum ``input`` over ranks; rank r receives slice r in ``output``. On the all-to-all path the sum is taken
        in ``output``'s dtype, which may be wider than ``input``'s. ``scratch`` (same dtype as ``input``,
        at least :meth:`scratch_numel` elements) must stay untouched until the result is waited for.
        ``divide_by`` (only where :attr:`reduce_scatter_by_all_to_all`): divide the sum by it, so that an
        fp32 mean is rounded once, exactly like ``sum(grads) / N``. There ``output`` may overlap ``input``: the
        sum is taken after the transfer, from ``scratch``."""
        if not self.reduce_scatter_by_all_to_all:
            if divide_by != 1:
                raise ValueError("reduce_scatter: `divide_by` needs the all-to-all path (the collective sums)")
            if output.dtype != input.dtype:
                raise ValueError(
                    f"reduce_scatter: `output` must have the dtype of `input` ({input.dtype}) when the collective "
                    f"sums, got {output.dtype}"
                )
            self.counts.add("reduce_scatter", input)
            return self._launch(lambda: _reduce_scatter_flat(output, input, group=self.group, async_op=True), then)
        n = input.numel()
        if scratch is None or scratch.numel() < n or scratch.dtype != input.dtype:
            raise ValueError(f"reduce_scatter: `scratch` must be a {input.dtype} buffer of at least {n} elements")
        self.counts.add("reduce_scatter", input)
        received = scratch[:n]
        slices = received.view(self.world_size, n // self.world_size).unbind(0)

        def sum_received() -> None:
            # Rank order, one slice at a time, in output's dtype (a bf16 slice is added to an fp32 output in
            # fp32): the same association on every rank and for every stage.
            if output.dtype == input.dtype:
                torch.add(slices[0], slices[1], out=output)
            else:
                output.copy_(slices[0])
                output.add_(slices[1])
            for s in slices[2:]:
                output.add_(s)
            if divide_by != 1:
                output.div_(divide_by)
            if then is not None:
                then()

        return self._launch(
            lambda: dist.all_to_all_single(received, input, group=self.group, async_op=True), sum_received
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Gather every rank's ``input`` into ``output`` (in place when ``input`` is this rank's slice of it).
        One rank gathering in place has nothing to do: no collective, nothing counted."""
        if self.world_size == 1 and output.data_ptr() == input.data_ptr() and output.numel() == input.numel():
            return _DONE
        self.counts.add("all_gather", output)
        return self._launch(lambda: _all_gather_flat(output, input, group=self.group, async_op=True), None)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> Pending:
        self.counts.add("all_reduce", tensor)
        return self._launch(lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), None)

    def all_gather_object_ints(self, value: int) -> list[int]:
        """Every rank's ``value`` (a small int64), synchronously: used once at construction."""
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        out = torch.empty(self.world_size, dtype=torch.int64, device=device)
        _all_gather_flat(out, mine, group=self.group)
        return out.tolist()


class _Done:
    """A collective that needed no communication: already complete."""

    def wait(self) -> None:
        pass


_DONE = _Done()
