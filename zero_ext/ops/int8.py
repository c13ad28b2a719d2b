"""The fused AdamW step with int8 block-quantized moments: a thin documented wrapper over
``torch.ops.zero_ext.fused_adamw_int8_`` and its fake (meta) impl. The maps, the block layout and the plain-torch
reference of the same arithmetic are in :mod:`zero_ext.update.blockwise_int8` and tests/helpers/int8_reference.py.

How the engine uses it (``ZeroAdamW(moment_dtype=torch.int8)``; zero_ext/update/adamw.py):

- State per flat group shard of ``n`` elements: ``exp_avg_codes`` / ``exp_avg_sq_codes`` int8 ``[n]``, and
  ``exp_avg_scales`` / ``exp_avg_sq_scales`` fp32 ``[ceil(n / 64)]``; zero-initialised (codes 0, scales 0) is the
  zero moment. 1 + 4/64 = 1.0625 bytes per element per moment.
- Blocks are aligned to the first element of each call: a call over shard elements ``[a, b)`` passes
  ``codes[a:b]`` and ``scales[a // 64 : ceil(b / 64)]`` and needs ``a % 64 == 0``; only the call that ends at the
  shard's end may end mid-block (its short last block). Bucket shard slices are multiples of 64 elements, so
  per-bucket calls qualify; offload windows and fragments must be cut at multiples of 64 too. A range that must
  start or end inside a block would need the kernel widened to the whole blocks, with the elements outside the
  update range dequantized and re-encoded with the block's new scale but not updated (not implemented: the engine
  never needs it, below).
- Bitwise across world sizes and stages only if a block holds the same elements everywhere: an int8 flat group
  places every parameter at a multiple of 64 elements, so a block is 64 elements of one parameter in every layout,
  every update run starts on a block and the step widens its end to the block's (the rest is padding: zero grad,
  zero master, exp_avg 0, exp_avg_sq decoding below any real element's, so no scale changes).
- Checkpoints: ``blockwise_int8.dequantize`` (bit 7 of exp_avg_sq's codes ignored) gives the fp32 moments to
  save; loading quantizes the fp32 moments with the target's block grid (``blockwise_int8.quantize``), which is
  deterministic but not lossless for a checkpoint saved from fp32 moments.
- param_remainders: ``remainder=`` and the tie bit in bit 7 of ``exp_avg_sq_codes``; serialisers read the master
  with ``master_split.join(param, remainder, master_split.tie_of(codes))`` and must keep bit 7 when writing the codes.
- amsgrad: ``max_exp_avg_sq_codes`` int8 ``[n]`` and ``max_exp_avg_sq_scales`` fp32 ``[ceil(n / 64)]``, quantized
  as exp_avg_sq is (its map, its own block absmax), zero-initialised, sliced per call like the moments; bit 7 of its
  codes is always 0 (the tie bit is exp_avg_sq's only). Checkpoints dequantize it with ``EXP_AVG_SQ_MAP``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import (
    _ADAMW_SCALARS,
    _C,  # noqa: F401  (loads the library that registers torch.ops.zero_ext.*)
    _FLOATS,
    Scalar,
    _check_dense,
    _check_scalar_tensor,
    split_scalar,
)

__all__ = ["fused_adamw_int8_", "MAX_BLOCK"]

MAX_BLOCK = 4096
# The elements one fp32 scale covers (the engine's block: zero_ext.update.blockwise_int8 quantizes with it too).
BLOCK = 64


def num_blocks(numel: int, block: int = BLOCK) -> int:
    """Scales a tensor of ``numel`` elements needs (the last block may be short)."""
    return -(-numel // block)


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
    max_exp_avg_sq_codes: Optional[torch.Tensor] = None,
    max_exp_avg_sq_scales: Optional[torch.Tensor] = None,
) -> None:
    """One fused AdamW update of a contiguous shard whose moments are int8 codes with one fp32 scale per ``block``
    elements (:mod:`zero_ext.update.blockwise_int8`), in place.

    ``exp_avg_codes`` / ``exp_avg_sq_codes`` are int8 with ``master``'s numel; ``exp_avg_scales`` /
    ``exp_avg_sq_scales`` fp32 with ``ceil(numel / block)`` entries (the last block may be short). Per block: the
    moments are dequantized with the old scales, updated with ``zero_ext.ops.fused_adamw_``'s fp32 arithmetic, and
    requantized with the block's new absmax. ``master``, ``grad``, ``param_out``, ``found_inf``, ``maximize``, the
    scalars and their checks are as in :func:`zero_ext.ops.fused_adamw_`. With ``remainder`` (int16), ``master`` is
    the bf16 parameter and the fp32 master is (param, remainder, tie) with the tie bit in bit 7 of
    ``exp_avg_sq_codes`` (SPEC A: the param is the master rounded to nearest even). ``block`` is a multiple of 16
    in [16, 4096].

    amsgrad: ``max_exp_avg_sq_codes`` (int8, ``master``'s numel) and ``max_exp_avg_sq_scales`` (fp32, one per
    block), both or neither, hold max_exp_avg_sq quantized as exp_avg_sq is. Per block it is dequantized, becomes
    ``maximum(max_exp_avg_sq, new exp_avg_sq)`` (NaN-propagating; torch.optim.AdamW's amsgrad, as
    :func:`zero_ext.ops.fused_adamw_`'s ``max_exp_avg_sq``), divides instead of exp_avg_sq, and is requantized with
    its own new block absmax; bit 7 of its codes is ignored when read and written 0. On the CPU the result is
    bitwise tests/helpers/int8_reference.py's ``fused_adamw_int8_reference``.
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
        max_exp_avg_sq_codes=max_exp_avg_sq_codes,
        max_exp_avg_sq_scales=max_exp_avg_sq_scales,
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
    max_codes, max_scales = kw.get("max_exp_avg_sq_codes"), kw.get("max_exp_avg_sq_scales")
    torch._check(
        (max_codes is None) == (max_scales is None),
        lambda: (
            f"zero_ext.{_OP}: `max_exp_avg_sq_codes` and `max_exp_avg_sq_scales` must be given together (amsgrad)"
            " or both be None"
        ),
    )
    if max_codes is not None:
        expected += [("max_exp_avg_sq_codes", max_codes, (torch.int8,), n),
                     ("max_exp_avg_sq_scales", max_scales, (torch.float32,), blocks)]  # fmt: skip
    for name, t, dtypes, numel in expected:
        _check_dense(_OP, name, t, "master", master, dtypes)
        torch._check(t.numel() == numel, lambda: f"zero_ext.{_OP}: `{name}` must have {numel} elements")
    _check_scalar_tensor("found_inf", kw.get("found_inf"), master)
    for name in _ADAMW_SCALARS:
        _check_scalar_tensor(name, kw.get(f"{name}_tensor"), master)
