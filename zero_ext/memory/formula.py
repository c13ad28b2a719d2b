"""The ZeRO formula of model-state memory per rank, before anything is built (the ledger of what the engine
actually allocated: :mod:`.ledger`).

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
:func:`zero_ext.memory.ledger.report` measures, padding and the bounded staging pool aside.

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
from fractions import Fraction
from typing import Optional, Union

import torch

from ..owner_layout import OwnerLayout, newton_schulz_cost
from ..update import blockwise_int8
from ..update.adamw import MOMENT_DTYPES, AdamW
from ..update.muon import Muon

__all__ = [
    "estimate", "estimate_breakdown", "state_bytes_per_element", "moment_bytes", "INT8_BLOCK", "muon_owner_bytes",
    "MUON_STATE_BYTES", "GRAD_SHARD_BYTES", "mesh_divisors",
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
