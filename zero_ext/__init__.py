"""zero_ext: ZeRO stage 1/2 sharded AdamW for PyTorch.

``zero_ext.ZeroAdamW`` replaces ``DDP(model)`` + ``torch.optim.AdamW``; ``zero_ext.ops`` holds the fused
kernels; ``zero_ext.checkpoint`` saves and reshards; ``zero_ext.memory`` estimates and accounts memory.
"""

from . import memory, ops  # noqa: F401  (ops registers torch.ops.zero_ext.*)
from .optimizer import ZeroAdamW

__all__ = ["ZeroAdamW", "memory", "ops"]
__version__ = "0.1.0"
