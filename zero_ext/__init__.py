"""zero_ext: ZeRO stages 1, 2 and 3 for PyTorch: a sharded AdamW, with its state optionally in host memory or on disk.

``zero_ext.ZeroAdamW`` replaces ``DDP(model)`` + ``torch.optim.AdamW``; ``zero_ext.ZeroMuon`` ``torch.optim.Muon`` (with
AdamW for the non-matrix parameters), each matrix updated whole on one owner rank; ``zero_ext.ops`` holds the fused
kernels; ``zero_ext.checkpoint`` saves and reshards; ``zero_ext.memory`` estimates and accounts memory;
``zero_ext.placement.offload`` keeps the optimizer state in host memory or on NVMe.
"""

from . import ops  # noqa: I001  (first: registers torch.ops.zero_ext.*)
from . import checkpoint, memory
from .comm.divergence import RanksDiverged
from .zero_muon import ZeroMuon
from .optimizer import ZeroAdamW

__all__ = ["RanksDiverged", "ZeroAdamW", "ZeroMuon", "checkpoint", "memory", "ops"]
__version__ = "0.1.0"
