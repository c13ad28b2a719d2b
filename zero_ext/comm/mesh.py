"""The data-parallel mesh as data, and the ``mesh=`` option made into communicators.

:class:`Mesh` is what the sharded state holds: the layout's communicator and, for a 2-D mesh, its shard group (a
node's ranks) and replicate group (one rank per node) (``hsdp.MeshCommunicator``). A 1-D run is the mesh with one
replica.

``ZeroAdamW(mesh=...)`` takes a 2-D ``torch.distributed.device_mesh.DeviceMesh`` with dims
``("replicate", "shard")`` (FSDP2's HSDP convention), a 1-D DeviceMesh (its group: the 1-D layout), or ``"auto"``
(torchrun's ``LOCAL_WORLD_SIZE`` ranks per node: the ``(nodes, ranks per node)`` mesh, said on rank 0).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .base import Communicator
from .compress import check_inter_node_reduce_dtype, inter_node_dtype
from .hsdp import MeshCommunicator

WHERE = "zero_ext.ZeroAdamW"
DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class Mesh:
    """``comm``: the communicator every collective of the layout goes through (a :class:`MeshCommunicator` for a
    2-D mesh)."""

    comm: Communicator

    @property
    def shard(self) -> Communicator:
        """The shard group's communicator (the layout's own in 1-D)."""
        return self.comm.shard if isinstance(self.comm, MeshCommunicator) else self.comm

    @property
    def replicate(self) -> Optional[Communicator]:
        """The replicate group's communicator, or None for a single replica."""
        return self.comm.replicate if isinstance(self.comm, MeshCommunicator) else None

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.replicate.world_size

    @property
    def world_size(self) -> int:
        """Every rank of the mesh: shard ranks times replicas."""
        return self.shard.world_size * self.replicate_size

    @property
    def shape(self) -> tuple[int, int]:
        """``(replicas, shard ranks)``."""
        return self.replicate_size, self.shard.world_size

    @property
    def replicate_state(self) -> bool:
        return isinstance(self.comm, MeshCommunicator) and self.comm.replicate_state


def _is_device_mesh(mesh) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover (torch without distributed)
        return False
    return isinstance(mesh, DeviceMesh)


def check_mesh(
    mesh, process_group, communicator, replicate_state, where: str = WHERE, inter_node_reduce_dtype=None
) -> None:
    """The local checks of ``mesh=``, ``replicate_state=`` and ``inter_node_reduce_dtype=`` (before anything is
    built): a clear ValueError."""
    if not isinstance(replicate_state, bool):
        raise ValueError(f"{where}: `replicate_state` must be True or False, got {replicate_state!r}")
    check_inter_node_reduce_dtype(inter_node_reduce_dtype, mesh, replicate_state, where)
    if mesh is None:
        if replicate_state:
            raise ValueError(f"{where}: `replicate_state=True` is for a 2-D `mesh` (its replicas); no mesh was given")
        return
    if process_group is not None or communicator is not None:
        raise ValueError(f"{where}: give `mesh` or `process_group`/`communicator`, not both (a mesh has its groups)")
    if isinstance(mesh, str):
        if mesh != "auto":
            raise ValueError(f"{where}: `mesh` must be a DeviceMesh, 'auto' or None, got {mesh!r}")
        if not dist.is_initialized():
            raise ValueError(f"{where}: mesh='auto' needs torch.distributed initialised (torchrun) first")
        return
    if not _is_device_mesh(mesh):
        raise ValueError(
            f"{where}: `mesh` must be a torch.distributed.device_mesh.DeviceMesh (init_device_mesh(device, (R, S), "
            f"mesh_dim_names=('replicate', 'shard'))), 'auto' or None, got {type(mesh).__name__}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{where}: `mesh` must have 1 or 2 dimensions, got {mesh.ndim}: {tuple(mesh.shape)}")
    if mesh.ndim == 2 and tuple(mesh.mesh_dim_names or ()) != DIMS:
        raise ValueError(
            f"{where}: a 2-D `mesh` must name its dimensions ('replicate', 'shard') (FSDP2's HSDP convention: "
            f"replicate across nodes, shard within one), got mesh_dim_names={mesh.mesh_dim_names}"
        )
    if mesh.ndim == 1 and replicate_state:
        raise ValueError(f"{where}: `replicate_state=True` needs a 2-D mesh; this one is 1-D")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise ValueError(
            f"{where}: `mesh` must cover every rank of the job: it has {mesh.size()} ranks "
            f"{tuple(mesh.shape)}, the world has {world}"
        )


def auto_mesh(device: torch.device):
    """mesh='auto': ``(nodes, LOCAL_WORLD_SIZE)`` from torchrun's environment; None when there is one node."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1:
        raise ValueError(
            f"{WHERE}: mesh='auto' reads the ranks per node from torchrun's LOCAL_WORLD_SIZE, which is not set; "
            "launch with torchrun or pass a DeviceMesh"
        )
    per_node = int(local)
    if world % per_node:
        raise ValueError(f"{WHERE}: mesh='auto': LOCAL_WORLD_SIZE={per_node} does not divide the world of {world}")
    shape = (world // per_node, per_node)
    if dist.get_rank() == 0:
        print(
            f"zero_ext: mesh='auto' -> {shape[0]} node(s) x {shape[1]} rank(s) per node, dims ('replicate', 'shard')"
            + ("" if shape[0] > 1 else ": one node, the 1-D layout"),
            file=sys.stderr,
        )
    if shape[0] == 1:
        return None
    return init_device_mesh(device.type, shape, mesh_dim_names=DIMS)


def grid_of(mesh) -> list[list[int]]:
    """The global ranks of a 2-D mesh, ``[replica][shard rank]``."""
    return mesh.mesh.tolist()


def mesh_communicator(
    mesh, replicate_state: bool, device: torch.device, communicator_for, inter_node_reduce_dtype=None
) -> Communicator:
    """The communicator of ``mesh`` (checked by :func:`check_mesh`) for tensors on ``device``; a mesh of one
    replica is the 1-D layout (``inter_node_reduce_dtype`` has nothing to compress there)."""
    if isinstance(mesh, str):
        mesh = auto_mesh(device)
        if mesh is None:
            return communicator_for(None, device)
    if mesh.ndim == 1:
        return communicator_for(mesh.get_group(), device)
    if mesh.size(0) == 1:  # one replica: the 1-D layout of the shard group
        return communicator_for(mesh.get_group("shard"), device)
    shard = communicator_for(mesh.get_group("shard"), device)
    replicate = communicator_for(mesh.get_group("replicate"), device)
    world = communicator_for(None, device)
    return MeshCommunicator(
        shard, replicate, world, replicate_state, grid_of(mesh), inter_node_dtype(inter_node_reduce_dtype)
    )
