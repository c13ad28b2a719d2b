"""The flat-tensor collectives, named once for every module of comm/ (the communicators and the divergence watch's
own phase check).

torch 2.13 renamed them (*_into_tensor / *_tensor -> *_single); older releases (the GPU machines' torch 2.11) only
have the old names. Same arguments, same semantics.
"""

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
