"""The memory report: what :func:`zero_ext.memory.ledger.report` counted on one rank (:class:`MemoryReport`, the
object ``ZeroAdamW.memory_report()`` returns), its bounded buffers, and the readable table it prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .formula import estimate, state_bytes_per_element

__all__ = ["Buffer", "MemoryReport", "human_bytes"]


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
