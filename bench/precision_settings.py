"""The precision settings of the fused step as benchmarks time them: for each, the bytes per element it must move and
issue 37's target (its step time over the default step's), and one step of the kernel the engine calls for it, on any
device.

- default: fp32 master, exp_avg, exp_avg_sq; bf16 grad read and bf16 param written (28 B/element)
- remainders: bf16 param + int16 remainder as the master (``param_remainders=True``)
- bf16_moments, remainders_bf16: bf16 moments with stochastic rounding (``moment_dtype=torch.bfloat16``)
- int8_moments, int8_remainders: int8 codes + one fp32 scale per 64 elements (``moment_dtype=torch.int8``)

Used by ``bench_fused_adamw.py --precision`` (CPU and CUDA rows against the copy bandwidth) and by
``investigations/precision_kernel_cost.py`` (CPU, per-round ratios, before/after).
"""

from __future__ import annotations

from typing import Callable

import torch

# Bytes each setting must move per element: bf16 grad read (2); master read+write (fp32 8, or bf16 param 4 +
# int16 remainder 4); exp_avg and exp_avg_sq read+write (fp32 8 each, bf16 4 each, int8 codes 2 each + one fp32
# scale per 64 elements read+write, 0.125 each); bf16 param_out write (2) unless the param is the master's half.
BYTES = {"default": 28, "remainders": 26, "bf16_moments": 20, "remainders_bf16": 18, "int8_moments": 16.25,
         "int8_remainders": 14.25}  # fmt: skip
# Issue 37: each setting's step time / the default's (median of per-round ratios) at most this.
TARGETS = {"int8_moments": 0.75, "int8_remainders": 0.8, "bf16_moments": 0.8, "remainders": 1.0}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# Bytes per element each setting's own buffers hold (the grad is shared; int8's scales are 1/64 of an fp32)
HELD_BYTES = {"default": 4 + 8 + 2, "remainders": 2 + 8 + 2, "bf16_moments": 4 + 4 + 2, "remainders_bf16": 2 + 4 + 2,
              "int8_moments": 4 + 2 + 2, "int8_remainders": 2 + 2 + 2}  # fmt: skip


def steps(master: torch.Tensor, grad: torch.Tensor, names=tuple(BYTES)) -> dict[str, Callable[[float], None]]:
    """name -> one fused step at step number ``s`` (each setting owns its buffers, made here from the fp32 ``master``
    and the bf16 ``grad`` on their device; the moments start at zero)."""
    from zero_ext import ops
    from zero_ext.ops import int8 as ops_int8
    from zero_ext.update import blockwise_int8

    n, device = master.numel(), master.device
    blocks = blockwise_int8.num_blocks(n)

    def zeros(dtype):
        return torch.zeros(n, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device)

    def param():
        return master.to(torch.bfloat16)

    def remainder():
        return torch.zeros(n, dtype=torch.int16, device=device)

    def scales():
        return torch.zeros(blocks, device=device), torch.zeros(blocks, device=device)

    def default():
        mst, (m, v), p = master.clone(), zeros(torch.float32), param()
        return lambda s: ops.fused_adamw_(mst, grad, m, v, step=s, param_out=p, **HYPER)

    def remainders():
        p, (m, v), r = param(), zeros(torch.float32), remainder()
        return lambda s: ops.fused_adamw_(p, grad, m, v, step=s, remainder=r, **HYPER)

    def bf16_moments():
        mst, (m, v), p = master.clone(), zeros(torch.bfloat16), param()
        return lambda s: ops.fused_adamw_(mst, grad, m, v, step=s, param_out=p, rounding_seed=7, element_offset=0,
                                          **HYPER)  # fmt: skip

    def remainders_bf16():
        p, (m, v), r = param(), zeros(torch.bfloat16), remainder()
        return lambda s: ops.fused_adamw_(p, grad, m, v, step=s, remainder=r, rounding_seed=7, element_offset=0,
                                          **HYPER)  # fmt: skip

    def int8_moments():
        mst, (m, v), (sm, sv), p = master.clone(), zeros(torch.int8), scales(), param()
        return lambda s: ops_int8.fused_adamw_int8_(mst, grad, m, sm, v, sv, step=s, param_out=p, **HYPER)

    def int8_remainders():
        p, (m, v), (sm, sv), r = param(), zeros(torch.int8), scales(), remainder()
        return lambda s: ops_int8.fused_adamw_int8_(p, grad, m, sm, v, sv, step=s, remainder=r, **HYPER)

    makers = {"default": default, "remainders": remainders, "bf16_moments": bf16_moments,
              "remainders_bf16": remainders_bf16, "int8_moments": int8_moments, "int8_remainders": int8_remainders}  # fmt: skip
    return {name: makers[name]() for name in names}
