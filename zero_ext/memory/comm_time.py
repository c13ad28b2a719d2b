"""The communication time of one training step on a cluster: the alpha-beta model of ZeroAdamW's collectives.

A collective over a group of g ranks, on a link of bandwidth beta (bytes/s per rank) and latency alpha (s per
message step), moving a tensor of ``nbytes`` (a reduce-scatter's input, an all-gather's output, an all-reduce's
buffer) costs, by the ring algorithm:

    reduce-scatter, all-gather   (g - 1) / g * nbytes / beta  +  (g - 1) * alpha
    all-reduce                 2 (g - 1) / g * nbytes / beta  + 2 (g - 1) * alpha   (a reduce-scatter + an all-gather)

A group whose ranks span nodes runs at the inter-node link's beta and alpha, one inside a node at the intra-node
link's (NVLink). A rank's inter-node bandwidth is its share of its node's NICs: ``nics_per_node`` links of
``inter.bandwidth`` each, shared by the node's ranks that cross at the same time (every rank of a node runs the same
collective: H100 nodes have a 400 Gb/s NIC per GPU; the emulated cluster of ``bench/bench_hsdp_cluster.py`` one veth
for two ranks). ``wire bytes`` are the ``(g - 1) / g`` (x 2 for an all-reduce) of ``nbytes`` one rank sends: what
``comm_stats()`` counts as ``intra_node_bytes`` / ``inter_node_bytes``.

The step's collectives (:func:`step_collectives`), Psi parameters in ``buckets`` equal buckets, gradients reduced in
``grad_bytes`` per element and parameters gathered in ``param_bytes``:

- 1-D over N = nodes x ranks per node: reduce-scatter Psi gradients, all-gather Psi parameters (stages 1, 2); stage 3
  gathers twice (forward and backward; once with ``reshard_after_forward=False``) and not after the step.
- mesh (R, S) (R replicas of a shard group of S ranks, the shard group inside a node): reduce-scatter Psi over S; then
  the replicas reduce-scatter the shard (Psi / S) among themselves, update 1/(R x S), and all-gather the updated
  parameter shard (Psi / S) among themselves (the default, state sharded over R x S), or all-reduce the gradient shard
  (``replicate_state=True``, FSDP2's HSDP); the shard group all-gathers Psi (twice at stage 3, within the node).

Times add up: nothing here overlaps communication with compute or one collective with another, so the total is the
step's communication when exposed, an upper bound on what it adds to a step that overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Link", "Cluster", "Collective", "StepComm", "step_collectives", "estimate_step", "GBIT", "GBYTE"]

GBIT = 1e9 / 8  # bytes/s in one Gbit/s
GBYTE = 1e9
FACTOR = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}  # ring passes: wire bytes and latency steps


@dataclass(frozen=True)
class Link:
    """A link: ``bandwidth`` in bytes/s (one direction), ``latency`` (alpha) in seconds per message step."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks; ``intra`` links inside a node, ``inter`` between nodes (per NIC); a node
    has ``nics_per_node`` NICs (default: one per rank)."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    nics_per_node: Optional[int] = None

    def __post_init__(self):
        if self.nodes < 1 or self.ranks_per_node < 1 or (self.nics_per_node is not None and self.nics_per_node < 1):
            raise ValueError(f"nodes, ranks_per_node and nics_per_node must be >= 1: {self}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, inter_node: bool) -> Link:
        """The link a group's collective runs on; between nodes, a rank's share of its node's NICs."""
        if not inter_node:
            return self.intra
        nics = self.ranks_per_node if self.nics_per_node is None else self.nics_per_node
        return Link(self.inter.bandwidth * min(1.0, nics / self.ranks_per_node), self.inter.latency)


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of ``kind`` on groups of ``size`` ranks (the mesh dimension ``group``), each over a
    tensor of ``nbytes``; ``inter_node``: the group spans nodes."""

    kind: str
    group: str
    size: int
    nbytes: float
    calls: int
    inter_node: bool
    why: str = ""

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends over all the calls: (g - 1) / g of each tensor, twice for an all-reduce."""
        return self.calls * FACTOR[self.kind] * (self.size - 1) / self.size * self.nbytes

    @property
    def latency_steps(self) -> int:
        """Message steps of all the calls: (g - 1) per ring pass."""
        return self.calls * FACTOR[self.kind] * (self.size - 1)

    def time(self, link: Link) -> float:
        return self.wire_bytes / link.bandwidth + self.latency_steps * link.latency


@dataclass
class StepComm:
    """The step's collectives, each with its seconds, and their sums."""

    cluster: Cluster
    layout: str
    collectives: list[Collective] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(self.times)

    def bytes_on(self, inter_node: bool) -> float:
        """Wire bytes one rank sends per step inside its node (False) or between nodes (True)."""
        return sum(c.wire_bytes for c in self.collectives if c.inter_node == inter_node)

    def seconds_on(self, inter_node: bool) -> float:
        return sum(t for c, t in zip(self.collectives, self.times) if c.inter_node == inter_node)

    def latency_steps_on(self, inter_node: bool) -> int:
        return sum(c.latency_steps for c in self.collectives if c.inter_node == inter_node)

    def rows(self) -> list[dict]:
        return [{"kind": c.kind, "group": c.group, "size": c.size, "calls": c.calls, "nbytes_per_call": c.nbytes,
                 "wire_bytes": c.wire_bytes, "scope": "inter" if c.inter_node else "intra", "seconds": t,
                 "why": c.why} for c, t in zip(self.collectives, self.times)]  # fmt: skip

    def table(self) -> str:
        lines = [f"{self.layout}: {self.total_s * 1e3:.2f} ms of communication per step"]
        for c, t in zip(self.collectives, self.times):
            scope = "inter" if c.inter_node else "intra"
            lines.append(f"  {c.kind:<15}{c.group:>10} x{c.size:<3}{scope:>6}{c.wire_bytes / 2**20:>12.1f} MiB"
                         f"{t * 1e3:>10.2f} ms  {c.why}")  # fmt: skip
        return "\n".join(lines)


def _spans_nodes(cluster: Cluster, groups: list[list[int]]) -> bool:
    return any(len({cluster.node(r) for r in g}) > 1 for g in groups)


def mesh_groups(world: int, mesh: tuple[int, int]) -> tuple[list[list[int]], list[list[int]]]:
    """The shard groups (rows: S consecutive ranks) and replicate groups (columns) of a (R, S) mesh over ranks
    0..world-1, laid out as ``init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard"))`` lays them."""
    r, s = mesh
    if r * s != world:
        raise ValueError(f"mesh {mesh} has {r * s} ranks, the cluster {world}")
    return [list(range(i * s, (i + 1) * s)) for i in range(r)], [list(range(j, world, s)) for j in range(s)]


def step_collectives(
    num_params: int,
    cluster: Cluster,
    stage: int,
    *,
    mesh: Optional[tuple[int, int]] = None,
    replicate_state: bool = False,
    param_bytes: float = 2,
    grad_bytes: float = 4,
    buckets: int = 1,
    reshard_after_forward: bool = True,
    replica_grad_bytes: Optional[float] = None,
    kept_buckets: int = 0,
    flat_reduce_scatter: bool = False,
) -> list[Collective]:
    """The collectives one rank runs in a step (see the module docstring). ``mesh`` None: 1-D over every rank;
    ``(R, S)``: HSDP, ranks laid out as ``init_device_mesh`` lays them (the shard group: S consecutive ranks).
    ``replica_grad_bytes``: bytes per element of the gradient shard the replicas reduce (default ``grad_bytes``;
    4 on gloo, whose shard-group reduce-scatter sends bf16 gradients as they are and sums them in fp32).
    ``kept_buckets``: stage 3 with ``reshard_after_forward``: buckets backward finds still gathered from forward and
    does not gather again (ZeroAdamW keeps the first ``prefetch + 1`` backward needs; default 0).
    ``flat_reduce_scatter``: a mesh with its state over every rank reduce-scatters the gradients once over every
    rank instead of in two levels (ZeroAdamW on gloo when ``grad_bytes x S <= replica_grad_bytes``: bf16 gradients
    summed in fp32 on nodes of 2 ranks; ``MeshCommunicator.flat_reduce_scatter``)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if buckets < 1 or num_params < 0:
        raise ValueError(f"buckets must be >= 1 and num_params >= 0, got {buckets}, {num_params}")
    if not 0 <= kept_buckets <= buckets or int(kept_buckets) != kept_buckets:
        raise ValueError(f"kept_buckets must be a whole number in [0, buckets={buckets}], got {kept_buckets!r}")
    if replicate_state and mesh is None:
        raise ValueError("replicate_state=True describes a 2-D mesh: give mesh=(R, S)")
    if flat_reduce_scatter and (mesh is None or replicate_state):
        raise ValueError("flat_reduce_scatter=True describes a 2-D mesh with its state over every rank")
    world = cluster.world_size
    grads, params = num_params * grad_bytes / buckets, num_params * param_bytes / buckets
    gathers = (2 if reshard_after_forward else 1) if stage == 3 else 1
    when = "forward + backward" if gathers == 2 else ("forward" if stage == 3 else "after the step")
    gather_calls = gathers * buckets - (kept_buckets if gathers == 2 else 0)
    if mesh is None or mesh[0] == 1:
        inter = _spans_nodes(cluster, [list(range(world))])
        gather = Collective("all_gather", "world", world, params, gather_calls, inter, f"parameters, {when}")
        return [Collective("reduce_scatter", "world", world, grads, buckets, inter, "gradients"), gather]
    shard_groups, replica_groups = mesh_groups(world, mesh)
    r, s = mesh
    shard_inter, replica_inter = _spans_nodes(cluster, shard_groups), _spans_nodes(cluster, replica_groups)
    if flat_reduce_scatter:
        out = [Collective("reduce_scatter", "world", world, grads, buckets, shard_inter or replica_inter,
                          "gradients, one all-to-all over every rank")]  # fmt: skip
    else:
        out = [Collective("reduce_scatter", "shard", s, grads, buckets, shard_inter, "gradients")]
    shard = num_params * (grad_bytes if replica_grad_bytes is None else replica_grad_bytes) / buckets / s
    if flat_reduce_scatter:
        out.append(Collective("all_gather", "replicate", r, params / s, buckets, replica_inter, "updated shard"))
    elif replicate_state:
        out.append(Collective("all_reduce", "replicate", r, shard, buckets, replica_inter, "gradient shard"))
    else:
        out += [Collective("reduce_scatter", "replicate", r, shard, buckets, replica_inter, "gradient shard"),
                Collective("all_gather", "replicate", r, params / s, buckets, replica_inter, "updated shard")]  # fmt: skip
    out.append(Collective("all_gather", "shard", s, params, gather_calls, shard_inter, f"parameters, {when}"))
    return [c for c in out if c.size > 1]


def estimate_step(num_params: int, cluster: Cluster, stage: int, **kw) -> StepComm:
    """:func:`step_collectives` with each one's time on its link, and the total (:class:`StepComm`)."""
    mesh = kw.get("mesh")
    layout = f"1-D over {cluster.world_size}" if mesh is None else f"mesh {mesh[0]} x {mesh[1]}"
    if kw.get("replicate_state"):
        layout += ", replicated state"
    out = StepComm(cluster, f"{layout}, stage {stage}")
    for c in step_collectives(num_params, cluster, stage, **kw):
        out.collectives.append(c)
        out.times.append(c.time(cluster.link(c.inter_node)))
    return out
