"""The load a step's collectives put on the links between nodes, by collective algorithm, and the step time it
predicts.

:mod:`.comm_time` counts the bytes one rank sends (``(g - 1) / g`` of each tensor); what a link between nodes
carries depends on which rank sends to which, that is on the algorithm and on where the group's ranks live. A node's
*load* is the bytes that leave it for other nodes (``out``) and arrive from them (``into``) in one collective on
every group of a mesh dimension; the link's load is the busiest direction of the busiest node. Algorithm sets
(:data:`ALGORITHMS`):

- ``"ring"`` (the default; :mod:`.comm_time`'s model, whose numbers it keeps): when a group spans nodes, every
  member's ``(g - 1) / g`` (twice for an all-reduce) counts as leaving its node and as much as arriving. Exact where
  each rank's ring neighbours are on other nodes (a replicate group), an upper bound elsewhere;
- ``"gloo"``, what torch's ProcessGroupGloo runs on CPU (checked in gloo's sources: ``gloo/allgather.cc``,
  ``gloo/allreduce.cc``, whose default algorithm is its ring) and ZeroAdamW's gloo communicator calls: a
  reduce-scatter is one all-to-all (member i sends ``nbytes / g`` to each other member, then sums locally); an
  all-gather is a ring in group-rank order (member i sends to i + 1; each edge carries ``(g - 1) / g`` of the
  output); an all-reduce is a ring (member i sends to i - 1) of two passes, reduce-scatter then all-gather, each
  edge carrying ``2 (g - 1) / g`` of the buffer;
- ``"nccl"``: every collective a ring in group-rank order (an all-reduce two passes), NCCL's ring algorithm. NCCL
  splits a collective over channels, rings that leave a node through different NICs, so the node's load is one
  ring's and its NICs share it (:func:`collective_seconds`).

Group members are global ranks in group-rank order (``comm_time.mesh_groups`` gives a mesh's); ``node_of`` maps a
global rank to its node (``Cluster.node``).

- :func:`crossing_bytes`: one collective on one group: :class:`Crossing` (bytes per node out and in; the most one
  rank sends to a rank of its own node);
- :func:`step_link_load`: every collective of a step (``comm_time.step_collectives``) on every group it runs on:
  :class:`StepLinkLoad`, with :attr:`StepLinkLoad.per_direction`, the link's load;
- :func:`collective_seconds`: a collective's time when the node's inter-node bytes share its NICs and the busiest
  rank's bytes inside the node go over the intra-node link, concurrently (a ring's edges all move at once), plus
  its latency steps;
- :func:`predict_step_seconds`: a measured machine's step at a shaped link: ``T = local_s + max(0, link_bytes /
  (rate * efficiency) - overlap_s)``, ``local_s`` its step on the unshaped link (compute and the collectives' fixed
  costs), ``efficiency`` the share of the nominal rate that reaches the payload, ``overlap_s`` the link seconds that
  hide under compute;
- :func:`overlapped_step_seconds`: a step at scale: compute, plus the gradient reduction beyond what
  ``hide_fraction`` of the compute (backward's share) hides, plus what runs after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .comm_time import FACTOR, Cluster, Collective, mesh_groups, step_collectives

__all__ = ["ALGORITHMS", "Crossing", "StepLinkLoad", "crossing_bytes", "step_link_load", "collective_seconds",
           "predict_step_seconds", "overlapped_step_seconds"]  # fmt: skip

ALGORITHMS = ("ring", "gloo", "nccl")
# the shape of each collective per algorithm: "flat" (every member's wire bytes cross), "all_to_all", or a ring
# whose members send to the next (+1) or previous (-1) member
_SHAPE = {
    "ring": {"reduce_scatter": "flat", "all_gather": "flat", "all_reduce": "flat"},
    "gloo": {"reduce_scatter": "all_to_all", "all_gather": +1, "all_reduce": -1},
    "nccl": {"reduce_scatter": +1, "all_gather": +1, "all_reduce": +1},
}


@dataclass
class Crossing:
    """Bytes of one collective (or a sum of them): per node, leaving it for other nodes (``out``) and arriving
    (``into``); ``intra_rank_max``, the most one rank sends to ranks of its own node."""

    out: dict[int, float] = field(default_factory=dict)
    into: dict[int, float] = field(default_factory=dict)
    intra_rank_max: float = 0.0

    def add(self, other: "Crossing", times: float = 1.0) -> None:
        for mine, theirs in ((self.out, other.out), (self.into, other.into)):
            for node, b in theirs.items():
                mine[node] = mine.get(node, 0.0) + times * b
        self.intra_rank_max += times * other.intra_rank_max

    @property
    def per_direction(self) -> float:
        """The busiest direction of the busiest node's link."""
        return max([0.0, *self.out.values(), *self.into.values()])


def _check_members(members: Sequence[int]) -> list[int]:
    members = list(members)
    if not members or len(set(members)) != len(members) or any(int(r) != r or r < 0 for r in members):
        raise ValueError(f"members must be distinct ranks >= 0, at least one, got {members!r}")
    return members


def crossing_bytes(kind: str, members: Sequence[int], nbytes: float, node_of: Callable[[int], int],
                   algorithm: str = "ring") -> Crossing:  # fmt: skip
    """The bytes one ``kind`` collective (``"reduce_scatter"``: ``nbytes`` its input; ``"all_gather"``: its output;
    ``"all_reduce"``: the buffer) on the group ``members`` (global ranks in group-rank order) moves between nodes,
    by ``algorithm`` (:data:`ALGORITHMS`)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if kind not in FACTOR:
        raise ValueError(f"kind must be one of {tuple(FACTOR)}, got {kind!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    members = _check_members(members)
    nodes = [node_of(r) for r in members]
    out = Crossing({n: 0.0 for n in nodes}, {n: 0.0 for n in nodes})
    g = len(members)
    if g == 1:
        return out
    sent_intra = [0.0] * g
    shape = _SHAPE[algorithm][kind]
    if shape == "flat":
        wire = FACTOR[kind] * (g - 1) / g * nbytes
        spans = len(set(nodes)) > 1
        for i, n in enumerate(nodes):
            if spans:
                out.out[n] += wire
                out.into[n] += wire
            else:
                sent_intra[i] = wire
    elif shape == "all_to_all":
        piece = nbytes / g
        for i, a in enumerate(nodes):
            for j, b in enumerate(nodes):
                if i == j:
                    continue
                if a != b:
                    out.out[a] += piece
                    out.into[b] += piece
                else:
                    sent_intra[i] += piece
    else:  # a ring: each edge carries (g - 1) / g of the tensor per pass
        edge = FACTOR[kind] * (g - 1) / g * nbytes
        for i, a in enumerate(nodes):
            b = nodes[(i + shape) % g]
            if a != b:
                out.out[a] += edge
                out.into[b] += edge
            else:
                sent_intra[i] = edge
    out.intra_rank_max = max(sent_intra)
    return out


@dataclass
class StepLinkLoad:
    """A step's collectives (``comm_time.step_collectives``), each with its :class:`Crossing` summed over the
    groups it runs on and its calls."""

    algorithm: str
    collectives: list[Collective] = field(default_factory=list)
    crossings: list[Crossing] = field(default_factory=list)

    @property
    def total(self) -> Crossing:
        out = Crossing()
        for c in self.crossings:
            out.add(c)
        return out

    @property
    def per_direction(self) -> float:
        """The link's load per step: the busiest direction of the busiest node (bytes)."""
        return self.total.per_direction

    def rows(self) -> list[dict]:
        return [{"kind": c.kind, "group": c.group, "size": c.size, "calls": c.calls, "nbytes_per_call": c.nbytes,
                 "per_direction": x.per_direction, "intra_rank_max": x.intra_rank_max, "why": c.why}
                for c, x in zip(self.collectives, self.crossings)]  # fmt: skip


def step_link_load(num_params: int, cluster: Cluster, stage: int, *, algorithm: str = "ring", **kw) -> StepLinkLoad:
    """Every collective of a step (``comm_time.step_collectives(num_params, cluster, stage, **kw)``) on every group
    of its mesh dimension (all of them run it at once), in ``algorithm``'s bytes (:data:`ALGORITHMS`)."""
    world = cluster.world_size
    mesh = kw.get("mesh")
    shard, replicate = mesh_groups(world, mesh) if mesh is not None else ([], [])
    groups = {"world": [list(range(world))], "shard": shard, "replicate": replicate}
    load = StepLinkLoad(algorithm)
    for c in step_collectives(num_params, cluster, stage, **kw):
        total = Crossing()
        for members in groups[c.group]:
            x = crossing_bytes(c.kind, members, c.nbytes, cluster.node, algorithm)
            total.add(Crossing(x.out, x.into), c.calls)
            total.intra_rank_max = max(total.intra_rank_max, c.calls * x.intra_rank_max)  # groups run side by side
        load.collectives.append(c)
        load.crossings.append(total)
    return load


def collective_seconds(c: Collective, crossing: Crossing, cluster: Cluster) -> float:
    """``c``'s time (all its calls) when its inter-node bytes (``crossing``, summed over its groups) share each node's
    NICs (``nics_per_node`` x ``inter.bandwidth``) and its busiest rank's bytes inside the node go over ``intra``,
    both at once; plus ``c.latency_steps`` of the link's alpha (the inter-node one where the group spans nodes)."""
    nics = cluster.ranks_per_node if cluster.nics_per_node is None else cluster.nics_per_node
    inter_s = crossing.per_direction / (nics * cluster.inter.bandwidth)
    intra_s = crossing.intra_rank_max / cluster.intra.bandwidth
    alpha = cluster.inter.latency if c.inter_node else cluster.intra.latency
    return max(inter_s, intra_s) + c.latency_steps * alpha


def predict_step_seconds(local_s: float, link_bytes: float, rate: float, efficiency: float,
                         overlap_s: float) -> float:  # fmt: skip
    """A measured machine's step at a shaped link: ``local_s + max(0, link_bytes / (rate * efficiency) -
    overlap_s)``; ``local_s`` (s) its step on the unshaped link, ``link_bytes`` the link's load per step (the busiest
    direction), ``rate`` the link's nominal bytes/s, ``efficiency`` in (0, 1], ``overlap_s`` >= 0 (s)."""
    for name, value, ok in (("local_s", local_s, local_s >= 0), ("link_bytes", link_bytes, link_bytes >= 0),
                            ("rate", rate, rate > 0), ("efficiency", efficiency, 0 < efficiency <= 1),
                            ("overlap_s", overlap_s, overlap_s >= 0)):  # fmt: skip
        if not ok:  # also NaN
            raise ValueError(f"predict_step_seconds: {name} out of range, got {value!r}")
    return local_s + max(0.0, link_bytes / (rate * efficiency) - overlap_s)


def overlapped_step_seconds(compute_s: float, hideable_s: float, exposed_s: float,
                            hide_fraction: float = 2 / 3) -> float:  # fmt: skip
    """A step at scale: ``compute_s`` + the part of ``hideable_s`` (the gradient reduction, issued during backward)
    beyond ``hide_fraction`` of the compute (backward's share: 2/3 of 6 Psi flops per token) + ``exposed_s`` (what
    runs after backward: the parameter all-gather)."""
    for name, value, ok in (("compute_s", compute_s, compute_s >= 0), ("hideable_s", hideable_s, hideable_s >= 0),
                            ("exposed_s", exposed_s, exposed_s >= 0),
                            ("hide_fraction", hide_fraction, 0 <= hide_fraction <= 1)):  # fmt: skip
        if not ok:
            raise ValueError(f"overlapped_step_seconds: {name} out of range, got {value!r}")
    return compute_s + max(0.0, hideable_s - hide_fraction * compute_s) + exposed_s
