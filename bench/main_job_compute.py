"""How the main job's bf16-autocast matmuls run on a CPU: as bf16 GEMMs, or as fp32 GEMMs on bf16-rounded operands.

Every recipe of the main job runs its forward under bf16 autocast: the matmuls (``linear``, attention) take bf16
operands. A CPU without bf16 instructions (AVX2 only: the usual CI machine) has no fast path for a bf16 GEMM; torch
falls back to a slow loop, ~40x slower than an fp32 GEMM of the same shape (below), and the job took 1123 s
instead of ~1 minute. :class:`Fp32Matmuls` computes those same matmuls as fp32 GEMMs: each operand is
rounded to bf16 (what autocast would give the GEMM), then widened to fp32, multiplied with fp32 accumulation (what a
bf16 GEMM does too: a product of two bf16 numbers is exact in fp32) and the result rounded to bf16 (autocast's
output dtype). The gradients flow back through the same roundings, so a weight's gradient is rounded to bf16 as
under autocast. Parameters, gradients, optimizer state and every other op are untouched: the engines, their memory
and the checks are the same; only the summation order inside a GEMM (and, in attention, the softmax probabilities
kept in fp32 instead of bf16) can differ in the last bits.

:func:`probe` decides at run time, from a measurement: it times one of the job's GEMMs (tokens per rank x d_model
x 4 d_model, the MLP's first layer) both ways, interleaved, with the threads each rank gets, and picks fp32 GEMMs
when the bf16 GEMM is more than :data:`SLOWER` times slower. ``--matmul bf16|fp32`` overrides the decision.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# Pick fp32 GEMMs only when bf16 ones are clearly slower: near a tie the recipe's own bf16 path is kept (and the
# decision does not flip with machine noise). The probe at the default size (1024 x 256 x 1024, 1 thread): 6.23 ms bf16
# vs 3.76 ms fp32 on the AVX-512-BF16 Xeon (1.7x, bench/results/main_job.md: bf16 kept; 3.2x under a load of 13),
# 283 vs 6.75 ms with AVX2 only emulated on it (42x, bench/results/main_job_no_bf16.md: fp32 GEMMs).
SLOWER = 4.0
# The matmuls bf16 autocast runs in bf16 that this GPT calls (nn.Linear, attention, and the plain matmul ops).
LOW_PRECISION = {F.linear, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm, torch.Tensor.__matmul__}


def _as_fp32(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.bfloat16).float()  # the bf16 operand autocast would pass, widened exactly
    return x


class Fp32Matmuls(TorchFunctionMode):
    """Inside this mode (and a CPU bf16 autocast), the matmuls of :data:`LOW_PRECISION` run as fp32 GEMMs on
    bf16-rounded operands and return bf16, as autocast's bf16 GEMMs do; everything else runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in LOW_PRECISION or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        args, kwargs = tree_map(_as_fp32, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            out = func(*args, **kwargs)
        return out.to(torch.bfloat16)


def matmul_context(matmul: str):
    """The context the recipes' forward runs in: ``"fp32"`` -> :class:`Fp32Matmuls`, ``"bf16"`` -> none."""
    return Fp32Matmuls() if matmul == "fp32" else contextlib.nullcontext()


def probe(tokens: int, d_model: int, threads: int, reps: int = 5, budget_s: float = 3.0) -> dict:
    """Time a (tokens x d_model) @ (d_model x 4 d_model) GEMM with bf16 operands as a bf16 GEMM and as an fp32 one
    (rounding included), interleaved, best of ``reps`` (fewer once ``budget_s`` is spent: a bf16 GEMM without a fast
    path takes ~0.3 s at the default size), on ``threads`` threads; returns the times and the decision."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(tokens, d_model, generator=g).bfloat16()
        b = torch.randn(d_model, 4 * d_model, generator=g).bfloat16()
        ways = {"bf16": lambda: a @ b, "fp32": lambda: (a.float() @ b.float()).bfloat16()}
        best = {}
        start = time.perf_counter()
        for rep in range(reps + 1):  # round 0 is warm-up (first-call set-up), not timed
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                if rep:
                    best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if rep and time.perf_counter() - start > budget_s:
                break
    finally:
        torch.set_num_threads(before)
    ratio = best["bf16"] / best["fp32"]
    return {
        "shape": [tokens, d_model, 4 * d_model],
        "threads": threads,
        "bf16_gemm_ms": round(best["bf16"] * 1e3, 3),
        "fp32_gemm_ms": round(best["fp32"] * 1e3, 3),
        "bf16_over_fp32": round(ratio, 2),
        "threshold": SLOWER,
        "matmul": "fp32" if ratio > SLOWER else "bf16",
        "decided_by": "probe",
    }


def describe(matmul: str) -> str:
    if matmul == "fp32":
        return "bf16 autocast, its matmuls computed as fp32 GEMMs on bf16-rounded operands (bf16 results)"
    return "bf16 autocast, its matmuls computed as bf16 GEMMs"
