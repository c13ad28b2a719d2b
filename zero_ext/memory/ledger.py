"""The per-rank ledger: every byte a built ShardedState holds, by kind, read from the state's own tensors and set
against the ZeRO formula (:mod:`.formula`) term by term into a :class:`~.memory_report.MemoryReport`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..owner_layout import OwnerLayout
from .formula import mesh_divisors
from .memory_report import Buffer, MemoryReport

if TYPE_CHECKING:  # a type only: buffers.py never imports this module back
    from ..state.sharded_state import ShardedState

__all__ = ["report", "OFFLOAD_BUFFER_KINDS"]


def report(
    state: "ShardedState",
    staging=None,
    window=None,
    *,
    mesh: Optional[tuple[int, int]] = None,
    replicate_state: bool = False,
) -> MemoryReport:
    """Every persistent byte ``state`` holds on this rank, by kind, and how it relates to the formula. ``staging``:
    the engine's gradient staging pool (``engine.bucket_runtime.StagingPool``), bounded, not per parameter; ``window``:
    stage 3's gather scheduler (``engine.param_gather.ParamGather``), whose gathered buckets are bounded, not
    persistent. ``mesh=(R, S)`` (HSDP, ``comm.hsdp``): ``state``'s layout is that of the R x S ranks (layout rank
    ``s * R + r``; stage 3 keeps the param-dtype chunk of the R slices of shard rank s), or with
    ``replicate_state`` that of the S shard ranks; the report's ``world_size`` is R x S either way."""
    # The ledger checks every byte against the formula, term by term, so it follows the formula's arithmetic on the
    # stage number (estimate_breakdown) rather than the stage object's questions: the two must read alike.
    stage, world, rank = state.stage, state.world_size, state.rank
    replicas = 1  # the layout ranks whose slices make this rank's stage-3 parameter chunk
    if mesh is not None:
        _, layout_ranks = mesh_divisors(None, mesh, replicate_state)
        replicas = 1 if replicate_state else mesh[0]
        if layout_ranks != world:
            raise ValueError(f"mesh {mesh}: the state's layout has {world} ranks, not {layout_ranks}")
    out = MemoryReport(stage, world if mesh is None else mesh[0] * mesh[1], 0, 0, rank=rank, mesh=mesh,
                       replicate_state=replicate_state)  # fmt: skip
    owned = [g.layout for g in state.groups if isinstance(g.layout, OwnerLayout)]
    if owned:
        out.muon_numel = sum(layout.real_numel for layout in owned)
        costs = [sum(layout.rank_costs[r] for layout in owned) for r in range(world)]
        mine = sum(p.numel for layout in owned for p in layout.owned_pieces(rank))
        out.owners = (
            f"whole matrices: {sum(len(layout.numels) for layout in owned)}, {mine:,} elements on this rank; "
            f"Newton-Schulz cost per rank max/mean {max(costs) / (sum(costs) / world or 1):.3f}"
        )
    state_kinds = list(dict.fromkeys(k for g in state.groups for k in g.rule.kind_names))  # each once, master first
    alloc: dict[str, int] = dict.fromkeys(("params", "grads", *state_kinds, "grad_shard"), 0)
    where: dict[str, str] = {}
    for group in state.groups:
        for key, t in group.tensors().items():
            kind = key.split(".")[0]  # "landing.0" -> "landing"
            alloc[kind] = alloc.get(kind, 0) + t.numel() * t.element_size()
        where.update(group.state.where())
        disk = group.state.disk_bytes()
        if disk:
            kinds = [k for k in group.rule.kinds if group.state.where().get(k.name) == "disk"]  # not a remainder
            for kind, nbytes in group.state.disk_bytes_by_kind().items():  # one file per kind, in its dtype
                out.on_disk[kind] = out.on_disk.get(kind, 0) + nbytes
            out.padding += disk - sum(k.itemsize for k in kinds) * group.layout.shard_numel  # the files' last block
        pw = group.dtype.itemsize
        gw = pw  # the formula's gradients have the param dtype
        sw = group.rule.bytes_per_element(master_copy=group.state.master_copy)
        psi, full = group.layout.real_numel, group.layout.numel
        owned, shard = group.layout.owned_real_numel(rank), group.layout.shard_numel
        out.num_params += psi
        out.owned_numel += owned
        # stage 3's chunk: the slices of layout ranks first .. first + replicas - 1 (this rank's own in 1-D)
        first = rank - rank % replicas
        chunk = sum(group.layout.owned_real_numel(k) for k in range(first, first + replicas))
        out.formula += (pw * psi if stage < 3 else pw * chunk) + (gw * psi if stage == 1 else gw * owned) + sw * owned
        buffer_width = group.grad_buffer.element_size() if group.grad_buffer is not None else 0  # stage 1
        shard_bytes = sw + 4  # fp32 optimizer states + fp32 grad shard
        out.padding += buffer_width * (full - psi) + shard_bytes * (shard - owned)
        kept = "params" in group.flat_params.tensors()  # stage 3 with the master on the device casts it instead
        if stage < 3:
            out.padding += pw * (full - psi)
        elif kept:
            out.padding += pw * (shard * replicas - chunk)
        else:
            out.param_shard_not_kept += pw * owned
        # fp32 gradients beyond the formula's param-dtype ones: the grad shard, and an fp32 stage-1 buffer.
        out.grad_shard_fp32 += 4 * owned - (0 if stage == 1 else gw * owned)
        out.grad_shard_fp32 += (buffer_width - gw) * psi if buffer_width > gw else 0
        out.widths = {"param_bytes": pw, "grad_bytes": gw, "optimizer_state_bytes": sw}
    # int8 moments' scales make the per-element width fractional (4/64 byte): the sums are whole bytes again (a shard
    # is whole blocks), the formula's share of the real parameters need not be
    out.formula, out.padding = _number(out.formula), _number(out.padding)
    out.widths = {k: _number(v) for k, v in out.widths.items()}
    out.staging = staging.nbytes if staging is not None else 0
    if window is not None:  # stage 3: bytes of gathered storages (param_gather.ParamGather.window_bound)
        out.window_bound = window.window_bound
        out.window_peak = window.peak_bytes
    alloc["staging"] = out.staging
    out.allocated = {k: v for k, v in alloc.items() if v or k not in state_kinds}
    out.where = {k: where.get(k, "device") for k in list(out.allocated) + list(out.on_disk)}
    out.offload_buffers = sum(alloc.get(k, 0) for k in OFFLOAD_BUFFER_KINDS)
    out.bucket_limit = max((g.layout.bucket_limit for g in state.groups), default=0)
    out.buffers = _buffers(state, staging, alloc, out.bucket_limit)
    return out


def _number(x) -> int | float:
    """A byte count as an int where it is whole, else a float (exact for multiples of 1/64)."""
    return int(x) if x == int(x) else float(x)


def _buffers(state: "ShardedState", pool, alloc: dict[str, int], limit: int) -> dict[str, Buffer]:
    """Each transient buffer with its bound: entries or slots times the largest bucket (of at most ``limit``
    elements) in the buffer's bytes per element, or the nvme window's byte budget."""
    out = {}
    if pool is not None and pool.entries:
        largest = max((b.numel for _, b in state.buckets()), default=0)
        per_send = -(-pool.send_bytes // max(largest, 1))  # bytes per element of a bucket, as it was sized
        per_work = -(-pool.workspace_bytes // max(largest, 1))
        n = len(pool.entries)
        out["staging send"] = Buffer(
            n * pool.send_bytes, n * limit * per_send, f"{n} entries x a bucket in the wire dtype"
        )
        out["staging workspace"] = Buffer(
            n * pool.workspace_bytes, n * limit * per_work, f"{n} entries x the communicator's receive buffer"
        )
    ring, twins, param_out, window = 0, 0, 0, 0
    for group in state.groups:
        tensors = group.state.tensors()
        shard_limit = limit // state.world_size
        ring += len(tensors.get("landing", ())) * shard_limit * 4
        twins += len(tensors.get("landing_host", ())) * shard_limit * 4
        param_out += len(tensors.get("param_out", ())) * shard_limit * group.dtype.itemsize
        window += getattr(group.state, "window_budget", 0)
    for name, bound, why in (
        ("landing", ring, "slots x a bucket's fp32 shard"),
        ("landing_host", twins, "pinned twins of the landing slots"),
        ("param_out", param_out, "2 slots x a bucket's shard in the param dtype"),
        ("window", window, "offload_window: a byte budget"),
    ):
        if alloc.get(name, 0):
            out[name] = Buffer(alloc[name], bound, why)
    return out


OFFLOAD_BUFFER_KINDS = ("landing", "landing_host", "param_out", "window")
