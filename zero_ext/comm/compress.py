"""Compressed inter-node gradient sums (``ZeroAdamW(mesh=..., inter_node_reduce_dtype=torch.bfloat16 | torch.int8)``):
what a mesh's replicas send each other instead of their fp32 node sums, and how they add what arrives.

On a 2-D mesh (``hsdp.py``) the shard group first reduces a bucket inside the node, in fp32 as always, into this
rank's *chunk* (``1/S`` of the bucket: ``R`` slices, one per replica); the replicas then exchange the chunk so that
each gets its slice from every node. With this option each slice is encoded before it leaves the node, one
all-to-all moves the encoded slices (uint8 messages), and each rank decodes the ``R`` messages it received and
adds them **in fp32, in replica order** (then divides by ``R`` where the backend takes exact means: gloo's fp32
path), exactly as the fp32 path adds the fp32 slices. The error model, per element, with ``x_r`` the fp32 node
value replica ``r`` sends:

- ``torch.bfloat16``: ``q(x) = bf16(x)`` (round to nearest, ties to even; what ``Tensor.to`` does). 2 bytes per
  element on the wire instead of 4; ``|q(x) - x| <= 2^-8 |x|``.
- ``torch.int8``: blocks of :data:`BLOCK` (64, the int8 moments' block, ``zero_ext.ops.int8``) consecutive
  elements of a slice, aligned to its first element (a slice is a whole number of blocks: the layout's
  ``BUCKET_ALIGN``). Per block ``step = absmax / 127`` (fp32, one division), ``code = round_half_even(x / step)``
  (fp32 division; ``x / 1`` where ``step == 0``), ``q(x) = code * step`` (fp32 product); the block's fp32 ``step``
  travels with its 64 codes: 1.0625 bytes per element. ``|q(x) - x| <= step / 2`` (plus one fp32 rounding of the
  division) ``~= absmax / 254``. A block holding a NaN or an inf decodes to NaN everywhere (its step is NaN or
  inf), so the engine's non-finite check still sees it.
- the result: ``(((q(x_0) + q(x_1)) + q(x_2)) + ...) [/ R]`` in fp32, the fp32 path's formula with ``x_r`` replaced
  by ``q(x_r)``; every replica of a slice gets the same bits, and so do stages 1, 2 and 3 (they reduce the same
  buckets).

The intra-node level, the parameters' all-gathers and the optimizer state are untouched (checkpoints too).
Where NCCL could sum inside a collective, this path uses an all-to-all and the same local sum, so it runs alike on
both backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.int8 import BLOCK

INTER_NODE_DTYPES = (torch.bfloat16, torch.int8)
WHERE = "zero_ext.ZeroAdamW"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def check_inter_node_reduce_dtype(dtype, mesh, replicate_state: bool, where: str = WHERE) -> None:
    """``inter_node_reduce_dtype``: None (fp32, the default; ``torch.float32`` means the same), ``torch.bfloat16``
    or ``torch.int8``, and only with a 2-D ``mesh`` (or ``"auto"``) whose state is sharded over every rank. A
    2-D mesh of one replica (or ``"auto"`` on one node) sends nothing across nodes: there it changes nothing."""
    if dtype is None or dtype == torch.float32:
        return
    if dtype not in INTER_NODE_DTYPES:
        raise ValueError(
            f"{where}: `inter_node_reduce_dtype` must be None (fp32 sums), torch.bfloat16 or torch.int8, got {dtype!r}"
        )
    if mesh is None or (not isinstance(mesh, str) and getattr(mesh, "ndim", 0) != 2):
        raise ValueError(
            f"{where}: `inter_node_reduce_dtype` compresses the gradient sums that cross nodes on a 2-D `mesh` "
            "(('replicate', 'shard')); without one nothing crosses nodes as a separate level. Pass a 2-D mesh or "
            "leave it None"
        )
    if replicate_state:
        raise ValueError(
            f"{where}: `inter_node_reduce_dtype` is not implemented with `replicate_state=True` (its replicas "
            "all-reduce the node sums, which would need a second quantization of the result); use the default "
            "sharded state or leave it None"
        )


def inter_node_dtype(dtype) -> Optional[torch.dtype]:
    """The codec's dtype, None for fp32 sums."""
    return None if dtype is None or dtype == torch.float32 else dtype


class InterNodeCodec:
    """Encodes ``R`` slices of a chunk into ``R`` uint8 messages and adds decoded messages in fp32."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in INTER_NODE_DTYPES:
            raise ValueError(f"InterNodeCodec: dtype must be one of {INTER_NODE_DTYPES}, got {dtype}")
        self.dtype = dtype

    def message_bytes(self, slice_numel: int) -> int:
        """Bytes one slice of ``slice_numel`` elements travels in."""
        if self.dtype == torch.bfloat16:
            return 2 * slice_numel
        if slice_numel % BLOCK:
            raise ValueError(f"InterNodeCodec: an int8 slice must be a multiple of {BLOCK} elements, got {slice_numel}")
        return slice_numel + 4 * (slice_numel // BLOCK)

    def workspace_bytes(self, chunk_numel: int, replicas: int) -> int:
        """The send and receive messages of a chunk, and two fp32 slices (a decoded message, the sum)."""
        messages = replicas * self.message_bytes(chunk_numel // replicas)
        return 2 * _aligned(messages) + 2 * _aligned(4 * (chunk_numel // replicas))

    def split(self, workspace: torch.Tensor, chunk_numel: int, replicas: int):
        """``(send, received, decoded, total)`` views of ``workspace``: the two ``(R, message)`` uint8 buffers and
        two fp32 slices."""
        n = chunk_numel // replicas
        m = self.message_bytes(n)
        a, f = _aligned(replicas * m), _aligned(4 * n)
        send = workspace[: replicas * m].view(replicas, m)
        received = workspace[a : a + replicas * m].view(replicas, m)
        decoded = workspace[2 * a : 2 * a + 4 * n].view(torch.float32)
        total = workspace[2 * a + f : 2 * a + f + 4 * n].view(torch.float32)
        return send, received, decoded, total

    def encode(self, chunk: torch.Tensor, send: torch.Tensor) -> None:
        """``chunk`` (``R x n`` elements, any float dtype, read as fp32) into the ``(R, message)`` buffer ``send``."""
        R, n = send.shape[0], chunk.numel() // send.shape[0]
        x = chunk.view(R, n)
        if self.dtype == torch.bfloat16:
            send.view(torch.bfloat16).copy_(x)  # round to nearest even
            return
        blocks = x.float().reshape(R, n // BLOCK, BLOCK)
        step = blocks.abs().amax(dim=2).div_(127.0)  # NaN stays NaN (amax propagates it)
        codes = torch.div(blocks, torch.where(step == 0, 1.0, step).unsqueeze(2))
        codes = torch.nan_to_num_(codes, nan=0.0).round_().clamp_(-127.0, 127.0)  # round: half to even
        send[:, :n].view(torch.int8).view(R, n // BLOCK, BLOCK).copy_(codes)
        send[:, n:].view(torch.float32).copy_(step)

    def decode(self, message: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One received message (1-D uint8) decoded into the fp32 slice ``out``."""
        n = out.numel()
        if self.dtype == torch.bfloat16:
            return out.copy_(message.view(torch.bfloat16))
        codes = message[:n].view(torch.int8).view(n // BLOCK, BLOCK)
        step = message[n:].view(torch.float32)
        torch.mul(codes, step.unsqueeze(1), out=out.view(n // BLOCK, BLOCK))
        return out

    def sum_into(self, received: torch.Tensor, decoded: torch.Tensor, total: torch.Tensor, divide: bool) -> None:
        """``total`` = the decoded messages added in replica order (fp32), divided by ``R`` with ``divide``."""
        self.decode(received[0], total)
        for r in range(1, received.shape[0]):
            total.add_(self.decode(received[r], decoded))
        if divide:
            total.div_(received.shape[0])


__all__ = ["BLOCK", "INTER_NODE_DTYPES", "InterNodeCodec", "check_inter_node_reduce_dtype", "inter_node_dtype"]
