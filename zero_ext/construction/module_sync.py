"""``sync_module_states``: every rank starts from rank 0's parameters and buffers, as DDP does at construction.

A trainer that seeds torch per rank (``torch.manual_seed(seed + rank)``, one call for weights and data) builds a
different model on every rank; DDP hides that by broadcasting rank 0's module states when it wraps the model. The
optimizer does the same before it builds its flat buffers, so that stage 3 shards, and the fp32 master copies, rank
0's values. Ranks that already agree get back the bits they had: nothing changes for them.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm import Communicator

# DDP's bucket for the same broadcast (``broadcast_bucket_size`` in torch/nn/parallel/distributed.py): one collective
# per 250 MiB of one device and dtype, and at most that much extra memory while the optimizer is built.
BUCKET_BYTES = 250 * 2**20


def tensors_to_sync(params: Iterable[torch.Tensor], module: Optional[torch.nn.Module]) -> list[torch.Tensor]:
    """The optimizer's parameters (trainable and frozen), then the model's other parameters and its buffers (all
    of them, as DDP broadcasts ``named_buffers()``), each distinct tensor once: a tied weight stays tied."""
    seen, out = set(), []
    extra = [] if module is None else [*module.parameters(), *module.buffers()]
    for t in [*params, *extra]:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def describe(tensors: list[torch.Tensor]) -> str:
    """What the ranks must agree on before the broadcast (the same tensors, in the same order)."""
    return " ".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)


@torch.no_grad()
def broadcast_from_rank0(comm: Communicator, tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Collective: every tensor becomes rank 0's (rank 0 of ``comm``'s group), in place. One broadcast per bucket
    of up to ``bucket_bytes`` of one device and dtype (a tensor that fills a bucket alone travels in place)."""
    if comm.world_size == 1:  # nothing to send (and no buckets to flatten)
        return
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t.detach())
    for (device, _), same in by_kind.items():
        # Host tensors next to an NCCL group travel over its gloo side group.
        group = comm.cpu_group if device.type == "cpu" else comm.group
        for bucket in _buckets(same, bucket_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                comm.broadcast(bucket[0], 0, group)
                continue
            flat = _flatten_dense_tensors(bucket)
            comm.broadcast(flat, 0, group)
            for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(value)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    out, size = [[]], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return [b for b in out if b]
