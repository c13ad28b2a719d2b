"""Model-state memory: the ZeRO formula, and the per-rank ledger of what the engine actually allocated.

ZeRO (Rajbhandari et al., 2019) counts mixed-precision Adam as 2 (fp16/bf16 params) + 2 (grads) + K bytes per
parameter, K the optimizer state: the update rule's bytes per element (:mod:`zero_ext.update.adamw`; AdamW's fp32 master
and two moments: K = 12). Per rank, with N ranks and Psi parameters, for K = 12:

    stage 0 (DDP)  16 Psi              stage 2   2 Psi + 14 Psi / N
    stage 1         4 Psi + 12 Psi / N  stage 3   16 Psi / N

The precision settings change K (:func:`state_bytes_per_element`): ``param_remainders`` stores an int16 remainder
instead of the fp32 master (K - 2), ``moment_dtype=torch.bfloat16`` two bytes per moment (K - 4), ``torch.int8``
one byte per moment plus an fp32 scale per block of :data:`INT8_BLOCK` elements (K - 5.875). ``engine=True`` counts
the gradients and the stage-3 parameter shard as ZeroAdamW keeps them (an fp32 gradient shard on every rank; no
bf16 parameter shard at stage 3 unless it is half of the master, with ``param_remainders``): what
:func:`report` measures, padding and the bounded staging pool aside.

A 2-D ``mesh=(R, S)`` (HSDP: R replicas of a shard group of S ranks, N = R x S) shards the optimizer state and the
reduced gradients (stages 2, 3) over D ranks: all R x S by default (the shard group's reduce-scatter, then the
replicas'), or the S of a shard group, replicated R times, with ``replicate_state=True`` (FSDP2's HSDP); stage 3's
parameters are sharded over the S ranks of a shard group only (each rank keeps its 1/S chunk: forward's and
backward's gathers never leave the node). For K = 12, per rank:

    stage 1   4 Psi + 12 Psi / D      stage 2   2 Psi + 14 Psi / D      stage 3   2 Psi / S + 14 Psi / D

``mesh=(1, N)`` is the 1-D layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Optional, Union

import torch

from ..owner_layout import OwnerLayout, newton_schulz_cost
from ..update import blockwise_int8
from ..update.adamw import MOMENT_DTYPES, AdamW
from ..update.muon import Muon

if TYPE_CHECKING:  # a type only: buffers.py never imports this module back
    from ..state.sharded_state import ShardedState

__all__ = [
    "estimate", "estimate_breakdown", "state_bytes_per_element", "moment_bytes", "INT8_BLOCK", "MemoryReport",
    "report", "human_bytes", "muon_owner_bytes", "MUON_STATE_BYTES", "mesh_divisors",
]  # fmt: skip

# Elements per fp32 scale of int8 moments: the int8 kernels' block, chosen by measurement
# (bench/investigations/int8_moments.md: median update error 1.13 % at 64 against 1.41 % at torchao's 256 and 2.01 %
# at Dettmers et al.'s 2048; 64 also never straddles a shard slice). The scale adds 4/64 byte per element.
INT8_BLOCK = blockwise_int8.BLOCK
MUON_STATE_BYTES = Muon(torch.bfloat16).bytes_per_element()  # fp32 master + fp32 momentum buffer: 8
GRAD_SHARD_BYTES = 4  # ZeroAdamW reduces every gradient into an fp32 shard (exact averaging, fp32 accumulation)


def _rule(moment_dtype: torch.dtype, **kw) -> AdamW:
    """The AdamW rule of bf16 parameters with ``moment_dtype`` moments: the widths below are its kinds'."""
    if not any(moment_dtype is d for d in MOMENT_DTYPES):
        raise ValueError(f"moment_dtype must be torch.float32, torch.bfloat16 or torch.int8, got {moment_dtype!r}")
    return AdamW(torch.bfloat16, moment_dtype=moment_dtype, **kw)


def moment_bytes(moment_dtype: torch.dtype = torch.float32) -> Fraction:
    """Bytes per element of one moment (exp_avg or exp_avg_sq) stored as ``moment_dtype``: 4 (fp32), 2 (bf16), or
    1 + 4 / :data:`INT8_BLOCK` (int8 codes and their fp32 block scales)."""
    rule = _rule(moment_dtype)
    return rule.bytes_per_element(master_copy=False) / len(rule.moment_names)


def state_bytes_per_element(
    *, param_remainders: bool = False, moment_dtype: torch.dtype = torch.float32, amsgrad: bool = False
) -> Fraction:
    """Optimizer-state bytes per element of a rank's shard for bf16 parameters (ZeRO's K): the AdamW rule's
    kinds, the stored master (fp32, or the int16 remainder with ``param_remainders``) and each moment (exp_avg,
    exp_avg_sq, and max_exp_avg_sq with ``amsgrad``) at :func:`moment_bytes` of ``moment_dtype``."""
    return _rule(moment_dtype, amsgrad=amsgrad, param_remainders=param_remainders).bytes_per_element()


def mesh_divisors(
    world_size: Optional[int], mesh: Optional[tuple[int, int]] = None, replicate_state: bool = False
) -> tuple[int, int]:
    """``(shard, state)``: how many ranks share stage 3's parameters (a shard group's S; N without a mesh) and how
    many share the optimizer state and the reduced gradients (R x S by default, S with ``replicate_state``; N
    without a mesh). ``mesh`` is ``(R, S)``, replicas x shard-group size; ``world_size``, if given, must be R x S."""
    if mesh is None:
        if replicate_state:
            raise ValueError("replicate_state=True describes a 2-D mesh: give mesh=(R, S)")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        return world_size, world_size
    if len(mesh) != 2 or not all(isinstance(d, int) and d >= 1 for d in mesh):
        raise ValueError(f"mesh must be (replicas, shard group size), two ints >= 1, got {mesh!r}")
    replicas, shard = mesh
    if world_size is not None and world_size != replicas * shard:
        raise ValueError(f"world_size {world_size} is not the mesh's {replicas} x {shard} = {replicas * shard}")
    return shard, shard if replicate_state else replicas * shard


def estimate_breakdown(
    num_params: int,
    world_size: Optional[int],
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_state_bytes: Optional[Union[int, Fraction]] = None,
    param_remainders: bool = False,
    moment_dtype: torch.dtype = torch.float32,
    engine: bool = False,
    muon_params: int = 0,
    mesh: Optional[tuple[int, int]] = None,
    replicate_state: bool = False,
) -> dict[str, Fraction]:
    """Per-rank bytes of params, grads and optimizer states under ZeRO ``stage`` (exact fractions).

    The defaults are the paper's mixed-precision Adam (``optimizer_state_bytes``: the AdamW rule's bytes per
    element, 12; :func:`state_bytes_per_element` of ``param_remainders`` and ``moment_dtype`` otherwise, e.g. 10
    with ``param_remainders``, whose int16 remainder replaces the fp32 master; an explicit
    ``optimizer_state_bytes`` wins over ``param_remainders``); fp32 training with the params as their own master is
    ``param_bytes=4, grad_bytes=4, optimizer_state_bytes=8``.

    ``engine=True`` (stages 1-3): the gradients and the parameters as ZeroAdamW keeps them, instead of the paper's
    ``grad_bytes``-wide gradients sharded like the stage: an fp32 gradient shard (4 Psi / N) at every stage, plus
    stage 1's full ``grad_bytes``-wide gradient buffer; at stage 3 with bf16/fp16 params no parameter shard (each
    gather rounds the fp32 master) unless ``param_remainders`` (the bf16 shard is half of the master).

    ``muon_params`` (``zero_ext.ZeroMuon``): how many of the ``num_params`` are Muon matrices; their state is the Muon
    rule's (:data:`MUON_STATE_BYTES`: an fp32 master and an fp32 momentum buffer, 8 bytes), the rest AdamW's. The
    matrices are owned whole, so a rank's share is the average here; :func:`muon_owner_bytes` gives each rank's.

    ``mesh=(R, S)`` (``world_size`` R x S, or None): stage 3's parameters sharded over the S ranks of a shard group,
    the optimizer state and the reduced gradients over R x S (or over S with ``replicate_state=True``):
    :func:`mesh_divisors`. With ``engine=True`` and the state sharded over R x S, stage 3 keeps the param-dtype
    chunk of the S-way split (the shard group's gathers start from it; the master is 1/R of it, so it cannot be
    rounded from the master at each gather).
    """
    if not isinstance(muon_params, int) or not 0 <= muon_params <= num_params:
        raise ValueError(f"muon_params must be an int in [0, num_params], got {muon_params!r}")
    if optimizer_state_bytes is None:
        optimizer_state_bytes = state_bytes_per_element(param_remainders=param_remainders, moment_dtype=moment_dtype)
    elif moment_dtype != torch.float32:
        raise ValueError(
            "optimizer_state_bytes is the whole optimizer state per element, moments included: give it or "
            f"moment_dtype, not both (got moment_dtype={moment_dtype!r})"
        )
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an int >= 0, got {num_params!r}")
    shard, state_ranks = mesh_divisors(world_size, mesh, replicate_state)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if engine and stage == 0:
        raise ValueError("engine=True describes ZeroAdamW: stage must be 1, 2 or 3, got 0 (DDP)")
    # The documented formula is arithmetic on the stage number (the paper's table: stage >= k shards the k-th kind),
    # so it compares numbers on purpose; the engine's layers ask the stage object (engine/stages.py) instead.
    psi, n = Fraction(num_params), state_ranks  # n: the ranks one copy of the state and the gradients spreads over
    params = psi * param_bytes / (shard if stage >= 3 else 1)
    grads = psi * grad_bytes / (n if stage >= 2 else 1)
    states = ((psi - muon_params) * Fraction(optimizer_state_bytes) + muon_params * MUON_STATE_BYTES) / (
        state_ranks if stage >= 1 else 1
    )
    if engine:
        grads = (psi * grad_bytes if stage == 1 else 0) + psi * GRAD_SHARD_BYTES / n
        if stage == 3 and param_bytes < 4 and not param_remainders and shard == n:
            params = Fraction(0)  # the fp32 master is the shard: each gather rounds it
    return {"params": params, "grads": grads, "optimizer_states": states}


def estimate(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_remainders: bool = False,
    moment_dtype: torch.dtype = torch.float32,
    engine: bool = False,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_state_bytes: Optional[Union[int, Fraction]] = None,
    muon_params: int = 0,
    mesh: Optional[tuple[int, int]] = None,
    replicate_state: bool = False,
) -> float:
    """The ZeRO model-state bytes per rank for ``stage`` 0 (plain DDP), 1, 2 or 3 (see module docstring); the
    keywords are :func:`estimate_breakdown`'s (``mesh=(R, S)``: HSDP, ``world_size`` R x S or None).

    >>> round(estimate(7_500_000_000, 64, 2) / 1e9, 1)   # ZeRO paper, Table 1
    16.6
    >>> estimate(1000, 8, 3, param_remainders=True, moment_dtype=torch.int8, engine=True) / 1000  # B/param
    1.265625
    >>> estimate(1000, 64, 3, mesh=(8, 8)) / 1000, estimate(1000, 64, 3, mesh=(8, 8), replicate_state=True) / 1000
    (0.46875, 2.0)
    """
    parts = estimate_breakdown(num_params, world_size, stage, param_remainders=param_remainders,
                               moment_dtype=moment_dtype, engine=engine, param_bytes=param_bytes,
                               grad_bytes=grad_bytes, optimizer_state_bytes=optimizer_state_bytes,
                               muon_params=muon_params, mesh=mesh, replicate_state=replicate_state)  # fmt: skip
    return float(sum(parts.values()))


def muon_owner_bytes(shapes, world_size: int, bucket_size: int = 2**22) -> dict:
    """Where ZeroMuon's matrices of ``shapes`` go on ``world_size`` ranks (the owner layout it builds, at
    ``bucket_size`` elements per bucket): each rank's Muon state bytes (:data:`MUON_STATE_BYTES` per owned element,
    padding included), its Newton-Schulz cost, max / mean of both, and the matrices larger than the per-rank
    average (each bounds the balance: its owner holds at least it)."""
    layout = OwnerLayout([math.prod(s) for s in shapes], world_size, bucket_size,
                         costs=[newton_schulz_cost(s) for s in shapes])  # fmt: skip
    owned = [sum(p.numel for p in layout.owned_pieces(r)) for r in range(world_size)]
    state = [int(MUON_STATE_BYTES * layout.shard_numel)] * world_size  # every rank's shard has the padded size
    average = sum(owned) / world_size
    return {
        "state_bytes_per_rank": state,
        "owned_elements_per_rank": owned,
        "cost_per_rank": list(layout.rank_costs),
        "cost_max_over_mean": layout.balance(),
        "elements_max_over_mean": max(owned) / average if average else 1.0,
        "larger_than_average": [tuple(s) for s in shapes if math.prod(s) > average],
    }


@dataclass(frozen=True)
class Buffer:
    """A transient buffer in the ledger: ``nbytes`` allocated, at most ``bound`` by construction, because ``why``."""

    nbytes: int
    bound: int
    why: str


@dataclass
class MemoryReport:
    """Every persistent byte one rank of a ZeroAdamW holds, by kind, and how it relates to the formula.

    ``allocated`` maps each kind (params, grads, each state kind of the update rule, grad_shard, staging) to the
    bytes of the tensors of that kind: the whole allocation, padding included. ``padding`` is how many of
    those bytes hold padding (bucket tails and alignment gaps), ``staging`` the gradient staging pool.
    ``grad_shard_fp32`` is what keeping the reduced gradient shard in fp32 (exact averaging and fp32
    accumulation) costs beyond the formula's ``grad_bytes``-wide gradients.

    Exact identity, checked by the tests: ``total + sum(on_disk.values()) == formula + padding + staging +
    grad_shard_fp32 + offload_buffers - param_shard_not_kept`` (the last: stage 3 with bf16/fp16 params and the
    master in device memory keeps no param-dtype shard; each gather rounds the fp32 master instead),
    where ``formula`` is :func:`estimate` for this rank's share of the real parameters (the formula's
    ``Psi / N`` is the average over ranks of ``owned_numel``). ``total`` counts memory only; ``where`` says for
    each kind whether it is on the device, in host memory (``offload="cpu"``) or, in ``on_disk``, in files
    (``offload="nvme"``), and :meth:`bytes_on` sums one medium.
    """

    stage: int
    world_size: int
    num_params: int  # real (unpadded) trainable parameters, all ranks together
    owned_numel: int  # real parameter elements in this rank's shard
    allocated: dict[str, int] = field(default_factory=dict)
    padding: int = 0
    staging: int = 0
    grad_shard_fp32: int = 0
    formula: int = 0
    widths: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    window_bound: int = 0  # stage 3: bytes of gathered buckets the window may hold at once (not persistent)
    window_peak: int = 0  # stage 3: the most bytes the gathered storages held at once so far (measured on them)
    where: dict[str, str] = field(default_factory=dict)  # kind -> "device", "host" or "disk"
    on_disk: dict[str, int] = field(default_factory=dict)  # offload="nvme": bytes of state files, by kind
    offload_buffers: int = 0  # offload: the landing ring, parameter staging and disk window (bounded)
    # Every transient buffer (the staging pool's send buffers and communicator workspace, offload's landing ring and
    # its host twins, parameter staging, the nvme window): its bytes and its bound, the bytes of a few buckets of
    # ``bucket_limit`` elements or an explicit budget, never a parameter's size.
    buffers: dict[str, "Buffer"] = field(default_factory=dict)
    bucket_limit: int = 0  # the most elements a bucket holds (bucket_size in whole granules): what bounds them
    param_shard_not_kept: int = 0  # stage 3: the formula's param-dtype shard, not kept (the master is cast instead)
    optimizer: str = "ZeroAdamW"  # the optimizer's class (its title line)
    owners: str = ""  # ZeroMuon: how its matrices are spread over the ranks (owner layouts)
    muon_numel: int = 0  # ZeroMuon: real elements of its Muon matrices, all ranks together
    # HSDP (a 2-D mesh): (replicas R, shard group size S), world_size = R x S; None for the 1-D layout. The state is
    # sharded over R x S ranks, or over S and replicated R times with ``replicate_state``.
    mesh: Optional[tuple[int, int]] = None
    replicate_state: bool = False

    def bytes_on(self, medium: str) -> int:
        """Bytes on ``medium``: "device" (the parameters' device; the host when that is the CPU), "host" (host
        memory the optimizer keeps apart from the device's, with offload) or "disk"."""
        if medium == "disk":
            return sum(self.on_disk.values())
        return sum(n for kind, n in self.allocated.items() if self.where.get(kind, "device") == medium)

    @property
    def total(self) -> int:
        return sum(self.allocated.values())

    @property
    def estimate(self) -> float:
        """:func:`estimate` for this run (the average rank). Meaningful when every trainable param has one dtype:
        ``widths`` are those of the param dtype (``formula`` is exact for mixed dtypes too)."""
        return estimate(self.num_params, self.world_size, self.stage, muon_params=self.muon_numel, mesh=self.mesh,
                        replicate_state=self.replicate_state, **self.widths)  # fmt: skip

    def layout_line(self) -> str:
        """How the ranks share the model state: "N ranks" (1-D) or the mesh, and what each dimension shards."""
        if self.mesh is None:
            return f"{self.world_size} ranks"
        r, s = self.mesh
        d = f"{s}, replicated {r}x" if self.replicate_state else f"all {r * s}"
        return f"mesh {r} x {s} (replicate x shard): state and gradients sharded over {d}, stage 3's params over {s}"

    def table(self) -> str:
        """A readable ledger: every allocation, then the identity that splits the total into the ZeRO formula and
        the named extras, each in bytes and in bytes per parameter of the model."""
        psi = max(self.num_params, 1)

        def row(label: str, nbytes: float, note: str = "", mark: str = " ") -> str:
            return f"  {mark} {label:<32}{human_bytes(nbytes):>11}{nbytes / psi:>9.2f}  {note}".rstrip()

        def located(kind: str) -> str:
            return f"({self.where[kind]})" if self.where.get(kind, "device") != "device" else ""

        w = self.widths
        p, g = w.get("param_bytes", 2), w.get("grad_bytes", 2)
        o = w.get("optimizer_state_bytes", state_bytes_per_element())
        if self.mesh is None:
            formula = {1: f"{p} + {g} + {o}/N", 2: f"{p} + ({g} + {o})/N", 3: f"({p} + {g} + {o})/N"}
        else:  # parameters and gradients over the shard group S, the state over D (R x S, or S when replicated)
            d = "S" if self.replicate_state else "(R x S)"
            formula = {1: f"{p} + {g} + {o}/{d}", 2: f"{p} + ({g} + {o})/{d}", 3: f"{p}/S + ({g} + {o})/{d}"}
        formula = formula.get(self.stage, "") + " B/param"
        lines = [
            f"{self.optimizer} model state, rank {self.rank} of {self.world_size}, stage {self.stage}: "
            f"{self.num_params:,} parameters, {self.owned_numel:,} in this rank's shard",
            *([f"  {self.layout_line()}"] if self.mesh is not None else []),
            f"  {'':<34}{'bytes':>11}{'B/param':>9}",
        ]
        lines += [f"  {self.owners}"] if self.owners else []
        lines += [row(kind, nbytes, located(kind)) for kind, nbytes in self.allocated.items() if nbytes]
        lines += [row(kind, nbytes, "(disk)") for kind, nbytes in self.on_disk.items() if nbytes]
        media = [m for m in ("device", "host", "disk") if self.bytes_on(m)]
        split = ", ".join(f"{m} {human_bytes(self.bytes_on(m))}" for m in media) if len(media) > 1 else ""
        lines += [
            row("total", self.total + sum(self.on_disk.values()), split),
            row("ZeRO formula", self.formula, f"({formula}, this rank's share)", "="),
            row("fp32 gradients beyond it", self.grad_shard_fp32, "(the fp32 grad shard: an exact mean)", "+"),
            row("staging pool", self.staging, "(buckets in flight; bounded, not per parameter)", "+"),
            row("padding", self.padding, "(bucket tails, alignment)", "+"),
            *(
                [row("offload buffers", self.offload_buffers, "(landing ring, parameter staging, disk window)", "+")]
                if self.offload_buffers
                else []
            ),
            *(
                [row("param shard not kept", self.param_shard_not_kept, "(each gather rounds the fp32 master)", "-")]
                if self.param_shard_not_kept
                else []
            ),
            *(
                [f"  bounded buffers (each a few buckets of at most {self.bucket_limit:,} elements, or a budget):"]
                if self.buffers
                else []
            ),
            *(
                row(f"  {name}", b.nbytes, f"(<= {human_bytes(b.bound)}: {b.why})")
                for name, b in self.buffers.items()
                if b.nbytes
            ),
            *(
                [
                    row(
                        "gathered window (bound)",
                        self.window_bound,
                        f"(stage 3, not persistent; peak so far {human_bytes(self.window_peak)})",
                    )
                ]
                if self.stage == 3
                else []
            ),
            row(
                "DDP + AdamW, for comparison",
                estimate(self.num_params, self.world_size, 0, **_fp32_training),
                "(fp32 params: 16 B/param + DDP's gradient buckets)",
            ),  # fmt: skip
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_fp32_training = {"param_bytes": 4, "grad_bytes": 4, "optimizer_state_bytes": 8}


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def report(
    state: "ShardedState",
    staging=None,
    window=None,
    *,
    mesh: Optional[tuple[int, int]] = None,
    replicate_state: bool = False,
) -> MemoryReport:
    """Every persistent byte ``state`` holds on this rank, by kind, and how it relates to the formula. ``staging``:
    the engine's gradient staging pool (``engine.staging.StagingPool``), bounded, not per parameter; ``window``:
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
