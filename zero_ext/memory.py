"""Model-state memory: the ZeRO formula, and the per-rank ledger of what the engine actually allocated.

ZeRO (Rajbhandari et al., 2019) counts mixed-precision Adam as 2 (fp16/bf16 params) + 2 (grads) + 12
(fp32 master, exp_avg, exp_avg_sq) bytes per parameter. Per rank, with N ranks and Psi parameters:

    stage 0 (DDP)  16 Psi              stage 2   2 Psi + 14 Psi / N
    stage 1         4 Psi + 12 Psi / N  stage 3   16 Psi / N
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

__all__ = ["estimate", "estimate_breakdown", "MemoryReport"]


def estimate_breakdown(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_state_bytes: int = 12,
) -> dict[str, Fraction]:
    """Per-rank bytes of params, grads and optimizer states under ZeRO ``stage`` (exact fractions).

    The defaults are the paper's mixed-precision Adam; fp32 training with the params as their own master
    is ``param_bytes=4, grad_bytes=4, optimizer_state_bytes=8``.
    """
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an int >= 0, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    psi, n = Fraction(num_params), world_size
    params = psi * param_bytes / (n if stage >= 3 else 1)
    grads = psi * grad_bytes / (n if stage >= 2 else 1)
    states = psi * optimizer_state_bytes / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer_states": states}


def estimate(num_params: int, world_size: int, stage: int, **widths: int) -> float:
    """The ZeRO model-state bytes per rank for ``stage`` 0 (plain DDP), 1, 2 or 3 (see module docstring).

    >>> round(estimate(7_500_000_000, 64, 2) / 1e9, 1)   # ZeRO paper, Table 1
    16.6
    """
    return float(sum(estimate_breakdown(num_params, world_size, stage, **widths).values()))


@dataclass
class MemoryReport:
    """Every persistent byte one rank of a ZeroAdamW holds, by kind, and how it relates to the formula.

    ``allocated`` maps each kind (params, grads, master, exp_avg, exp_avg_sq, grad_shard, staging) to the
    bytes of the tensors of that kind: the whole allocation, padding included. ``padding`` is how many of
    those bytes hold padding (bucket tails and alignment gaps), ``staging`` the gradient staging pool.
    ``grad_shard_fp32`` is what keeping the reduced gradient shard in fp32 (exact averaging and fp32
    accumulation) costs beyond the formula's ``grad_bytes``-wide gradients.

    Exact identity, checked by the tests:  ``total == formula + padding + staging + grad_shard_fp32``,
    where ``formula`` is :func:`estimate` for this rank's share of the real parameters (the formula's
    ``Psi / N`` is the average over ranks of ``owned_numel``).
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

    @property
    def total(self) -> int:
        return sum(self.allocated.values())

    @property
    def estimate(self) -> float:
        """:func:`estimate` for this run (the average rank). Meaningful when every trainable param has one dtype:
        ``widths`` are those of the param dtype (``formula`` is exact for mixed dtypes too)."""
        return estimate(self.num_params, self.world_size, self.stage, **self.widths)

    def table(self) -> str:
        rows = [f"{k:<12}{v / 2**20:>12.2f} MiB" for k, v in self.allocated.items()]
        rows += [
            f"{'total':<12}{self.total / 2**20:>12.2f} MiB",
            f"{'formula':<12}{self.formula / 2**20:>12.2f} MiB  (estimate for this rank's share)",
            f"{'padding':<12}{self.padding / 2**20:>12.2f} MiB",
            f"{'staging':<12}{self.staging / 2**20:>12.2f} MiB",
            f"{'fp32 grads':<12}{self.grad_shard_fp32 / 2**20:>12.2f} MiB  (fp32 grad shard beyond the formula)",
        ]
        return "\n".join(rows)
