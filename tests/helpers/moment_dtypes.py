"""The two low-precision moment dtypes of ``ZeroAdamW(moment_dtype=...)``, side by side, for the tests that run one
scenario with either (tests/precision/test_moment_dtype*.py): what differs between bf16 and int8 moments is data
here, so each test has one driver, parametrized over :data:`MOMENT_DTYPES`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from int8_reference import Int8Reference
from moment_reference import SRReference

from zero_ext.update import blockwise_int8 as q8


@dataclass(frozen=True)
class MomentDtype:
    name: str  # the test id
    dtype: torch.dtype
    reference: type  # the plain-torch reference of training (one process), SRReference's driver and checks
    window: int  # offload_window of the nvme runs: small, so that a shard streams in several chunks
    moment_bytes: float  # bytes per moment element (int8: one code and 1/64 of an fp32 scale)
    file_suffix: str  # the moments' state files with offload="nvme": ``<kind>.<suffix>``
    drift_per_step: float  # |master - torch.optim.AdamW's fp32-moment master| per step, in units of the largest lr
    remainders: bool  # the training runs with whole buckets, and the resumed run, use param_remainders

    def kept(self, kind: str, value: torch.Tensor) -> torch.Tensor:
        """What these moments keep of a parameter's fp32 moment ``value`` of ``kind``, widened back to fp32 (what a
        checkpoint or state dict of them holds): bf16 rounded to nearest even; int8 quantized in 64-element blocks
        of the parameter, the block's absmax its scale."""
        if self.dtype == torch.bfloat16:
            return value.to(torch.bfloat16).float()
        qmap = q8.EXP_AVG_MAP if kind == "exp_avg" else q8.EXP_AVG_SQ_MAP
        codes, scales = q8.quantize(value.reshape(-1), q8.BLOCK, qmap)
        return q8.dequantize(codes, scales, q8.BLOCK, qmap).view(value.shape)


BF16 = MomentDtype(
    name="bf16",
    dtype=torch.bfloat16,
    reference=SRReference,
    window=3 * 14 * 2048,
    moment_bytes=2,
    file_suffix="bf16",
    # a bf16 moment is within one bf16 ulp (2^-8 relative) of its fp32 value, so each update lr * m / sqrt(v) moves
    # by about 2^-8 of itself at most, and the drift adds up over the steps (measured 0.012-0.024 lr after 5 updates)
    drift_per_step=2.0**-6,
    remainders=False,  # bf16 moments with param_remainders: tests/precision/test_moment_dtype_remainders.py
)
INT8 = MomentDtype(
    name="int8",
    dtype=torch.int8,
    reference=Int8Reference,
    window=3 * 8 * 4096,  # int8 files: 4096-element granules
    moment_bytes=1.0625,
    file_suffix="i8",
    # an int8 moment is within a few % of its block's absmax (bench/investigations/int8_moments.md: median update
    # error 1.1 %, worst 7.2 %), so each update moves by at most about its own size, and the drift adds up
    drift_per_step=1.0,
    remainders=True,  # the tie bit in bit 7 of exp_avg_sq's codes
)
MOMENT_DTYPES = {md.name: md for md in (BF16, INT8)}
