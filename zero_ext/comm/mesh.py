"""The data-parallel mesh as data: the group a rank's optimizer state is sharded over and the group its shards are
replicated over (HSDP: shard within a node, replicate across nodes).

One dimension today: every rank of the process group shards, and the replicate group is a single rank (no
replication). The engine reduces and gathers on :attr:`Mesh.shard`; a later replicate dimension adds one all-reduce
of each reduced shard over :attr:`Mesh.replicate` without changing the layout, which depends on the shard group
alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import Communicator


@dataclass(frozen=True)
class Mesh:
    """``shard``: the communicator of the shard group (this rank's layout and collectives); ``replicate``: the
    communicator of the replicate group, or None for a single replica."""

    shard: Communicator
    replicate: Optional[Communicator] = None

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.replicate.world_size

    @property
    def world_size(self) -> int:
        """Every rank of the mesh: shard ranks times replicas."""
        return self.shard.world_size * self.replicate_size
