"""Stage 3's parameter storage: each rank keeps only its shard of every bucket; a bucket's full parameters exist
only while it is gathered.

Each bucket has one flat tensor, its *gathered storage*, made at its first gather (the buckets of a parameter split
across several, ``layout.Run``, share one: the parameter's view must be contiguous; the storage holds its bytes
while any of them is gathered, so the gathered window is at least the largest parameter, inherently); from then on
every parameter of the bucket is a view into it (``.data`` is not re-pointed again; before, a poison view: one NaN expanded to the
parameter's shape). Released, the storage is resized to zero bytes (FSDP2's ``untyped_storage().resize_(0)``): the
parameters keep their shape, dtype and device for any code that inspects them, and cost nothing. Gathered again, the
same storage is resized back and the all-gather writes into it. So a view autograd saved in forward (``F.linear``
saves ``weight.t()``) holds no copy of its own while the bucket is released, and reads the refilled values in
backward: freed means freed, and backward never needs a second copy. Reading a released storage would read freed
memory, so nothing may: every data access through a parameter whose bucket is not gathered is checked, and the
gather scheduler (param_gather.py) gathers a bucket before any backward that reads a saved view of it.

The check: the parameter's class becomes a subclass of its own class whose ``__torch_function__`` (which torch calls
for every op on the parameter) first makes sure the bucket is gathered: inside forward and backward it gathers it on
demand (a module reading a weight it does not own, ``F.linear(x, self.wte.weight)``), outside them it raises a clear
error instead of a collective one rank might make alone. Metadata (shape, dtype, device, ``.grad``, ``.data``
assignment) never triggers anything. Once its bucket's gather is complete a parameter gets its own class back
(param_gather.py), so the ops of forward pay nothing for the checks; ``close()`` restores the class for good.

Who gathers is a :class:`GatherOnUse` registered for the parameter here (:func:`watch`), not an attribute stamped on
it: this layer never reaches into the engine but through that protocol. The check itself runs outside torch.compile
(``torch.compiler.disable``): it has host-side effects (a collective, the scheduler's bookkeeping) that dynamo must
not trace, so an op reading a parameter whose bucket is not gathered is a graph break, run eagerly, as FSDP2's
hooks are. Inside a gather unit (engine/gather_units.py) every parameter is gathered by the unit's hook before its
graph runs, so a compiled unit has no such op and no break.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..layout import Bucket, Layout, Range, Run
from .params import AfterUpdate

# Properties that read no data: their getters (and .data/.grad/.requires_grad setters) pass straight through.
_METADATA = frozenset(
    "shape dtype device requires_grad grad data is_leaf ndim layout is_cuda is_cpu is_meta is_sparse is_quantized "
    "is_mkldnn is_nested names _version grad_fn output_nr _backward_hooks _post_accumulate_grad_hooks name "
    "_base is_complex itemsize nbytes".split()
)
_METADATA_METHODS = frozenset(
    "size dim numel nelement element_size is_floating_point is_contiguous stride storage_offset __len__ "
    "register_hook register_post_accumulate_grad_hook requires_grad_ _is_view __hash__ __eq__ get_device "
    "is_complex untyped_storage data_ptr "
    # what dynamo's fakeification asks of every tensor it traces (torch/_subclasses/meta_utils.py describe_tensor):
    # were these data reads, a rank that alone recompiles a frame (dynamic shapes after a rank-0-only generation)
    # would start a gather the other ranks never join
    "is_conj is_neg is_inference _is_zerotensor is_pinned is_shared dim_order is_signed "
    # tensors made like the parameter (shape, dtype, device, strides): a hand-assigned gradient
    # (``p.grad = torch.randn_like(p)``) or a buffer of its shape is made outside forward too
    "empty_like zeros_like ones_like full_like rand_like randn_like randint_like new_empty new_zeros new_ones "
    "new_full".split()
)


def _reads_data(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return owner not in _METADATA
    return name not in _METADATA_METHODS


class GatherOnUse(Protocol):
    """What gathers a sharded parameter when an op reads it (the engine's stage-3 gather scheduler)."""

    def ensure(self, param: torch.Tensor, func) -> None:
        """``func`` reads ``param``: make its bucket(s) gathered, or raise a clear error where it may not be."""


# parameter -> its gatherer, by identity (a weak key: a parameter dropped by the model takes its entry with it)
_GATHERERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def watch(param: torch.Tensor, gatherer: GatherOnUse) -> None:
    """Reads of ``param`` (while its class is a :class:`ShardedParameter`) go through ``gatherer`` first."""
    _GATHERERS[param] = gatherer


def unwatch(param: torch.Tensor) -> None:
    _GATHERERS.pop(param, None)


def _gather_what_it_reads(func, args, kwargs) -> None:
    """Every sharded parameter among ``func``'s arguments gathered (or a clear error), before ``func`` runs."""
    if not _reads_data(func):
        return
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, ShardedParameter):
            gatherer = _GATHERERS.get(a)
            if gatherer is not None:
                gatherer.ensure(a, func)


# Under torch.compile: never traced (see the module docstring), the frame breaks its graph here and runs the op
# eagerly. Only there: the wrapper costs microseconds per call, and eager code calls this for every op on a parameter
# whose bucket is not gathered (``.grad`` reads included).
_gather_outside_the_graph = torch.compiler.disable(_gather_what_it_reads)


class ShardedParameter(torch.nn.Parameter):
    """Mixed into a stage-3 parameter's own class (see :func:`shard_class`)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            _gather_outside_the_graph(func, args, kwargs)
        else:
            _gather_what_it_reads(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_CLASSES: dict[type, type] = {}  # a parameter class -> its checking class
_ORIGINAL: dict[type, type] = {}  # ... and back


def shard_class(cls: type) -> type:
    """``cls`` (nn.Parameter or a subclass of it) with :class:`ShardedParameter`'s checks (one class per ``cls``)."""
    if issubclass(cls, ShardedParameter):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedParameter, cls), {})
        _ORIGINAL[_CLASSES[cls]] = cls
    return _CLASSES[cls]


def original_class(cls: type) -> type:
    """The class :func:`shard_class` made ``cls`` from (``cls`` itself when it is not a sharded class)."""
    return _ORIGINAL.get(cls, cls)


class ShardedParams:
    """Stage 3: this rank's slices of every bucket, contiguous (its shard), persist; a bucket's full buffer exists
    only while the bucket is gathered.

    With bf16/fp16 parameters whose fp32 master is on the same device (no offload), the shard in the param dtype is
    not kept after construction (:meth:`cast_from`): each gather rounds this rank's slice of the master straight
    into its place in the gathered buffer, as FSDP2 casts its fp32 shard when it gathers. That is the value the
    AdamW kernel would have written (both round to nearest even), and it saves 2 bytes per parameter / N."""

    gathers_after_update = False  # the next use gathers the updated shard
    shards_params = True  # a bucket starts SHARDED (bucket_runtime.ParamState)
    replicas = 1  # the layout ranks whose slices this rank keeps per bucket (ChunkedParams: a mesh's replicas)

    def __init__(self, layout: Layout, rank: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.rank, self.dtype, self.device = layout, rank, dtype, device
        shard_numel = layout.shard_numel * self.replicas
        self.shard: Optional[torch.Tensor] = torch.zeros(shard_numel, dtype=dtype, device=device)
        self.source: Optional[Callable[[Bucket], torch.Tensor]] = None  # bucket -> its fp32 master slice
        # run index -> its gathered storage: made at the first gather of one of its buckets, the run's parameters
        # view it from then on; zero bytes while none of its buckets is gathered. (Not made here: a model built on
        # meta would pay for every bucket at once, and the freed blocks fragment the heap.)
        self.storage: dict[int, torch.Tensor] = {}
        # run index -> its buckets gathered or gathering (the storage keeps its bytes while there is one)
        self.present: dict[int, set[int]] = {}
        self.params: Sequence[torch.Tensor] = ()
        self.poison = torch.full((1,), float("nan"), dtype=dtype, device=device)

    def adopt(self, params: Sequence[torch.Tensor]) -> None:
        """Copy this rank's pieces of every parameter into the shard, then free them (poison views)."""
        self.params = list(params)
        for p in self.params:
            if p.is_meta:  # built on meta (meta_init.py initialises it later): become a tensor on our device
                torch.utils.swap_tensors(p, type(p)(self.poison.expand(p.shape), requires_grad=p.requires_grad))
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self._keep_pieces()
        for run in self.layout.runs:
            self.forget(run)

    def _keep_pieces(self) -> None:
        """This rank's pieces of every parameter into the kept shard."""
        for piece in self.layout.owned_pieces(self.rank):
            flat = self.params[piece.index].detach().reshape(-1)
            piece.shard_range.of(self.shard).copy_(piece.param_range.of(flat))

    def _run(self, bucket: Bucket) -> Run:
        return self.layout.runs[self.layout.run_of[bucket.index]]

    def forget(self, run: Run) -> None:
        """``run``'s parameters become poison views, and it has no gathered storage (the next gather makes one)."""
        self.storage.pop(run.index, None)
        self.present.pop(run.index, None)
        with torch._C.DisableTorchFunctionSubclass():  # metadata only
            for i in run.slots:
                self.params[i].data = self.poison.expand(self.params[i].shape)

    def view_into(self, run: Run, buf: torch.Tensor) -> None:
        """Make ``run``'s parameters views of ``buf`` (a flat tensor of the run's size)."""
        with torch._C.DisableTorchFunctionSubclass():  # metadata only
            for i in run.slots:
                p = self.params[i]
                p.data = run.slot_range(self.layout.slots[i]).of(buf).view(p.shape)

    def fill_shard(self, run: Run, full: torch.Tensor) -> None:
        """This rank's slice of every bucket of ``full`` (the whole run) into the shard (before :meth:`cast_from`)."""
        for b in run.buckets:
            bucket = self.layout.buckets[b]
            mine = bucket.rank_range(self.rank).shifted(-run.offset)
            bucket.shard_range.of(self.shard).copy_(mine.of(full))

    def cast_from(self, source: Callable[[Bucket], torch.Tensor]) -> None:
        """Stop keeping the shard: from now on a gather rounds ``source(bucket)`` (this rank's fp32 master slice of
        the bucket) into the gathered buffer."""
        self.source, self.shard = source, None

    def rank_slice(self, bucket: Bucket) -> Optional[torch.Tensor]:
        """This rank's slice of ``bucket``: where the AdamW kernel writes, and the all-gather's input; None when
        the shard is not kept (:meth:`cast_from`)."""
        return None if self.shard is None else bucket.shard_range.of(self.shard)

    def rank_values(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket`` in the param dtype (a copy when it is cast from the master)."""
        if self.shard is None:
            return self.source(bucket).to(self.dtype)
        return self.rank_slice(bucket)

    def gather_input(self, bucket: Bucket, full: torch.Tensor) -> torch.Tensor:
        """The all-gather's input for ``bucket`` into ``full``: the kept slice, or this rank's place in ``full``
        filled with the master slice rounded to the param dtype (an in-place all-gather)."""
        if self.shard is not None:
            return self.rank_slice(bucket)
        with torch._C.DisableTorchFunctionSubclass():
            mine = bucket.rank_range(self.rank).shifted(-bucket.offset).of(full)
            mine.copy_(self.source(bucket))
        return mine

    def unshard(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s part of its run's gathered storage, with its bytes (uninitialised: the all-gather's output);
        every view of it, the parameters' and any autograd saved, sees what is written into it."""
        run = self._run(bucket)
        buf = self.storage.get(run.index)
        if buf is None:  # the first gather (or the previous storage was left to numpy): make it, views into it
            buf = self.storage[run.index] = torch.empty(run.numel, dtype=self.dtype, device=self.device)
            self.view_into(run, buf)
        elif buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(run.numel * self.dtype.itemsize)
        self.present.setdefault(run.index, set()).add(bucket.index)
        return bucket.bucket_range.shifted(-run.offset).of(buf)

    def gathered(self, bucket: Bucket) -> Optional[torch.Tensor]:
        """``bucket``'s part of its gathered storage while it holds its bytes, else None."""
        run = self._run(bucket)
        buf = self.storage.get(run.index)
        if buf is None or not buf.untyped_storage().nbytes() or bucket.index not in self.present.get(run.index, ()):
            return None
        return bucket.bucket_range.shifted(-run.offset).of(buf)

    def release(self, bucket: Bucket) -> None:
        """Free ``bucket``'s full values: once no bucket of its run is gathered, the run's storage shrinks to zero
        bytes, for every view of it.

        A storage numpy shares (``param.detach().numpy()`` while gathered) can no longer be resized: it is left
        to the array, and the parameters become poison views until the next gather makes a new storage (a saved
        view of the old one keeps reading the values it saw, which are the bucket's until the next step)."""
        run = self._run(bucket)
        buf = self.storage.get(run.index)
        if buf is None:
            return
        present = self.present.get(run.index, set())
        present.discard(bucket.index)
        if present:
            return
        if buf.untyped_storage().resizable():
            buf.untyped_storage().resize_(0)
        else:
            self.forget(run)

    def gathered_bytes(self) -> int:
        """Bytes the gathered storages hold now: every full parameter value alive on this rank."""
        return sum(buf.untyped_storage().nbytes() for buf in self.storage.values())

    def misplaced(self, params: Sequence[torch.Tensor]) -> Optional[int]:
        """The index of a parameter that is neither its poison view nor a view of its bucket's gathered storage (the
        model was moved, cast or given new tensors after the optimizer was built), else None."""
        poison = self.poison.untyped_storage()._cdata
        with torch._C.DisableTorchFunctionSubclass():
            for slot, p in zip(self.layout.slots, params):
                buf = self.storage.get(self.layout.run_of[slot.bucket])
                mine = poison if buf is None else buf.untyped_storage()._cdata
                if (
                    p.device != self.device
                    or p.dtype != self.dtype
                    or (slot.numel and p.untyped_storage()._cdata != mine)
                ):
                    return slot.index
        return None

    def follow(self, bucket: Bucket, full: torch.Tensor) -> None:
        """The kept shard follows ``full`` (``bucket``'s gathered values, edited: ``gathered_params(modifier_rank)``)."""
        shard = self.rank_slice(bucket)
        if shard is not None:
            shard.copy_(bucket.rank_range(self.rank).shifted(-bucket.offset).of(full))

    def after_update(self, bucket: Bucket) -> Optional[AfterUpdate]:
        """Nothing to gather after an update: the next use gathers the updated shard (None)."""
        return None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.shard is None else {"params": self.shard}


class ChunkedParams(ShardedParams):
    """Stage 3 on a mesh whose optimizer state is sharded over every rank (``comm.hsdp``): each rank keeps its
    *chunk* of every bucket in the param dtype, the ``replicas`` contiguous slices of its shard-group rank (``1/S``
    of the bucket, where the master and moments are ``1/N``), so the gathers of forward and backward run inside the
    shard group (inside the node) from the chunk. The update writes this rank's slice of the chunk
    (:meth:`rank_slice`); :meth:`after_update` then asks the engine to gather the replicas' updated slices into it
    (across nodes, once per step). The chunk is kept, never cast from the master at each gather: the other replicas'
    slices are not on this rank."""

    def __init__(self, layout: Layout, rank: int, dtype: torch.dtype, device: torch.device, replicas: int):
        self.replicas = replicas
        self.replica = rank % replicas  # layout rank = shard rank x replicas + replica (comm/hsdp.py)
        self.first = rank - self.replica  # the chunk's first layout rank
        super().__init__(layout, rank, dtype, device)  # (the shard: replicas x the layout's shard_numel)

    def chunk(self, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of ``bucket`` (the shard group gathers it)."""
        start = bucket.shard_offset * self.replicas
        return self.shard[start : start + bucket.shard_numel * self.replicas]

    def _chunk_range(self, bucket: Bucket) -> Range:
        """The chunk's elements in the flat buffer (the first layout rank's slice to the last's)."""
        return Range(bucket.rank_range(self.first).start, bucket.rank_range(self.first + self.replicas - 1).end)

    def _keep_pieces(self) -> None:
        """The pieces of every layout rank of the chunk, each at its place in its bucket's chunk."""
        for j in range(self.replicas):
            for piece in self.layout.owned_pieces(self.first + j):
                bucket = self.layout.buckets[piece.bucket]
                at = piece.shard_offset - bucket.shard_offset + j * bucket.shard_numel
                flat = self.params[piece.index].detach().reshape(-1)
                self.chunk(bucket)[at : at + piece.numel].copy_(piece.param_range.of(flat))

    def fill_shard(self, run: Run, full: torch.Tensor) -> None:
        for b in run.buckets:
            bucket = self.layout.buckets[b]
            self.chunk(bucket).copy_(self._chunk_range(bucket).shifted(-run.offset).of(full))

    def cast_from(self, source) -> None:
        """The chunk is kept (see the class docstring): nothing to drop."""

    def rank_slice(self, bucket: Bucket) -> torch.Tensor:
        n = bucket.shard_numel
        return self.chunk(bucket)[self.replica * n : (self.replica + 1) * n]

    def gather_input(self, bucket: Bucket, full: torch.Tensor) -> torch.Tensor:
        return self.chunk(bucket)

    def follow(self, bucket: Bucket, full: torch.Tensor) -> None:
        self.chunk(bucket).copy_(self._chunk_range(bucket).shifted(-bucket.offset).of(full))

    def after_update(self, bucket: Bucket) -> Optional[AfterUpdate]:
        return AfterUpdate("replicas", self.chunk(bucket), self.rank_slice(bucket))
