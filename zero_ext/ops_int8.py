"""The fused AdamW step with int8 block-quantized moments: a thin documented wrapper over
``torch.ops.zero_ext.fused_adamw_int8_`` and its fake (meta) impl. The maps, the block layout and the plain-torch
reference of the same arithmetic are in :mod:`zero_ext.blockwise_int8`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.zero_ext.*)
from .blockwise_int8 import BLOCK, num_blocks
from .hyperparams import Scalar, split_scalar
from .ops import _ADAMW_SCALARS, _FLOATS, _check_dense, _check_scalar_tensor

__all__ = ["fused_adamw_int8_", "MAX_BLOCK"]

MAX_BLOCK = 4096
_OP = "fused_adamw_int8_"


def fused_adamw_int8_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    step: Scalar,
    grad_scale: Scalar = 1.0,
    block: int = BLOCK,
    param_out: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    maximize: bool = False,
    remainder: Optional[torch.Tensor] = None,
) -> None:
    """One fused AdamW update of a contiguous shard whose moments are int8 codes with one fp32 scale per ``block``
    elements (:mod:`zero_ext.blockwise_int8`), in place.

    ``exp_avg_codes`` / ``exp_avg_sq_codes`` are int8 with ``master``'s numel; ``exp_avg_scales`` /
    ``exp_avg_sq_scales`` fp32 with ``ceil(numel / block)`` entries (the last block may be short). Per block: the
    moments are dequantized with the old scales, updated with ``zero_ext.ops.fused_adamw_``'s fp32 arithmetic, and
    requantized with the block's new absmax. ``master``, ``grad``, ``param_out``, ``found_inf``, ``maximize``, the
    scalars and their checks are as in :func:`zero_ext.ops.fused_adamw_`. With ``remainder`` (int16), ``master`` is
    the bf16 parameter and the fp32 master is (param, remainder, tie) with the tie bit in bit 7 of
    ``exp_avg_sq_codes`` (SPEC A: the param is the master rounded to nearest even). ``block`` is a multiple of 16
    in [16, 4096]. No amsgrad. On the CPU the result is bitwise
    :func:`zero_ext.blockwise_int8.fused_adamw_int8_reference`'s.
    """
    values = (lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    floats, tensors = zip(*(split_scalar(f"zero_ext.{_OP}", n, v) for n, v in zip(_ADAMW_SCALARS, values)))
    torch.ops.zero_ext.fused_adamw_int8_(
        master,
        grad,
        exp_avg_codes,
        exp_avg_scales,
        exp_avg_sq_codes,
        exp_avg_sq_scales,
        block=int(block),
        **dict(zip(_ADAMW_SCALARS, floats)),
        **{f"{n}_tensor": t for n, t in zip(_ADAMW_SCALARS, tensors)},
        param_out=param_out,
        found_inf=found_inf,
        maximize=bool(maximize),
        remainder=remainder,
    )


@torch.library.register_fake("zero_ext::fused_adamw_int8_")
def _fused_adamw_int8_fake(master, grad, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales, **kw):
    block = kw["block"]
    torch._check(
        16 <= block <= MAX_BLOCK and block % 16 == 0,
        lambda: f"zero_ext.{_OP}: `block` must be a multiple of 16 in [16, {MAX_BLOCK}], got {block}",
    )
    remainder = kw.get("remainder")
    _check_dense(
        _OP, "master", master, "master", master, (torch.bfloat16,) if remainder is not None else (torch.float32,)
    )
    n, blocks = master.numel(), num_blocks(master.numel(), block)
    expected = [("grad", grad, _FLOATS, n), ("exp_avg_codes", exp_avg_codes, (torch.int8,), n),
                ("exp_avg_scales", exp_avg_scales, (torch.float32,), blocks),
                ("exp_avg_sq_codes", exp_avg_sq_codes, (torch.int8,), n),
                ("exp_avg_sq_scales", exp_avg_sq_scales, (torch.float32,), blocks)]  # fmt: skip
    if remainder is not None:
        torch._check(kw.get("param_out") is None, lambda: f"zero_ext.{_OP}: `param_out` must be None with `remainder`")
        expected.append(("remainder", remainder, (torch.int16,), n))
    if kw.get("param_out") is not None:
        expected.append(("param_out", kw["param_out"], (torch.bfloat16, torch.float16), n))
    for name, t, dtypes, numel in expected:
        _check_dense(_OP, name, t, "master", master, dtypes)
        torch._check(t.numel() == numel, lambda: f"zero_ext.{_OP}: `{name}` must have {numel} elements")
    _check_scalar_tensor("found_inf", kw.get("found_inf"), master)
    for name in _ADAMW_SCALARS:
        _check_scalar_tensor(name, kw.get(f"{name}_tensor"), master)
