"""The plain-torch references of int8 moments: :func:`fused_adamw_int8_reference`, what the fused kernel
``zero_ext.ops.int8.fused_adamw_int8_`` computes on one tensor, and :class:`Int8Reference`, ``ZeroAdamW(moment_dtype=
torch.int8)`` in one process, no sharding, no zero_ext kernel: per parameter an fp32 master and its int8 moments
(codes and one fp32 scale per 64 elements of the parameter, the last block short), stepped by
:func:`fused_adamw_int8_reference` (dequantize, the fp32 AdamW arithmetic, requantize with the new block absmax) on
the mean of the ranks' gradients.

Why the engine can be bitwise this: its flat buffers start every parameter at a multiple of 64 elements, so its
blocks are the parameter's 64-element blocks whatever the world size, stage, bucket size or offload; a parameter's
last block also holds zero padding, whose exp_avg stays 0 and whose exp_avg_sq decodes to the map's smallest value
(5.5e-7) times the block's scale, always below the block's largest real element (which decodes to the scale itself),
so the padding never changes a scale.
"""

from __future__ import annotations

from typing import Optional

import torch
from moment_reference import SRReference

from zero_ext import ops
from zero_ext.update import blockwise_int8 as q8
from zero_ext.update import master_split


def fused_adamw_int8_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    grad_scale: float = 1.0,
    param_out: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    maximize: bool = False,
    remainder: Optional[torch.Tensor] = None,
    block: int = q8.BLOCK,
    max_codes: Optional[torch.Tensor] = None,
    max_scales: Optional[torch.Tensor] = None,
) -> None:
    """What ``zero_ext.ops.int8.fused_adamw_int8_`` does, in place, one tensor at a time: dequantize exp_avg
    (``m_codes``, ``m_scales``, ``q8.EXP_AVG_MAP``) and exp_avg_sq (``v_codes``, ``v_scales``, ``q8.EXP_AVG_SQ_MAP``),
    one fp32 AdamW update (the fp32 op ``zero_ext.ops.fused_adamw_`` on the dequantized copies: csrc/adamw_math.h's
    formula, so the arithmetic is the kernel's by construction), requantize both with the new block absmax, write the
    master (fp32, or with ``remainder`` the bf16 ``master`` + int16 remainder + the tie bit in bit 7 of ``v_codes``,
    SPEC A) and ``param_out`` (bf16/fp16, round to nearest even).

    amsgrad: ``max_codes`` (int8) and ``max_scales`` (fp32, one per block) hold max_exp_avg_sq with
    ``q8.EXP_AVG_SQ_MAP``; its dequantized copy goes to the fp32 op as ``max_exp_avg_sq`` (so it becomes
    ``maximum(old max, new exp_avg_sq)``, NaN-propagating, and divides), then is requantized with its own new block
    absmax. Bit 7 of ``max_codes`` is ignored when read and written 0 (the tie bit lives in ``v_codes`` only)."""
    if (max_codes is None) != (max_scales is None):
        raise ValueError("fused_adamw_int8_reference: `max_codes` and `max_scales` must be given together (amsgrad)")
    if found_inf is not None and float(found_inf) != 0.0:
        return
    n = master.numel()
    m = q8.dequantize(m_codes, m_scales, block, q8.EXP_AVG_MAP)
    v = q8.dequantize(v_codes, v_scales, block, q8.EXP_AVG_SQ_MAP)
    v_max = q8.dequantize(max_codes, max_scales, block, q8.EXP_AVG_SQ_MAP) if max_codes is not None else None
    p = master_split.join(master, remainder, master_split.tie_of(v_codes)) if remainder is not None else master.clone()
    out = param_out.clone() if param_out is not None else None
    ops.fused_adamw_(p, grad, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     step=step, grad_scale=grad_scale, param_out=out, maximize=maximize,
                     max_exp_avg_sq=v_max)  # fmt: skip
    new_m_codes, new_m_scales = q8.quantize(m, block, q8.EXP_AVG_MAP)
    new_v_codes, new_v_scales = q8.quantize(v, block, q8.EXP_AVG_SQ_MAP)
    if remainder is not None:
        param, rem, tie = master_split.split(p)
        master.copy_(param)
        remainder.copy_(rem)
        new_v_codes = master_split.with_tie(new_v_codes, tie)
    else:
        master.copy_(p)
    if out is not None:
        param_out.copy_(out)
    m_codes.view(-1).copy_(new_m_codes[:n])
    m_scales.copy_(new_m_scales)
    v_codes.view(-1).copy_(new_v_codes[:n])
    v_scales.copy_(new_v_scales)
    if v_max is not None:
        new_max_codes, new_max_scales = q8.quantize(v_max, block, q8.EXP_AVG_SQ_MAP)
        max_codes.view(-1).copy_(new_max_codes[:n])
        max_scales.copy_(new_max_scales)


class Int8Param:
    def __init__(self, name: str, p: torch.Tensor, amsgrad: bool):
        self.name, self.amsgrad = name, amsgrad
        self.master = p.detach().float().clone().reshape(-1)
        n, blocks = self.master.numel(), q8.num_blocks(self.master.numel())
        self.codes = {k: torch.zeros(n, dtype=torch.int8) for k in self.kinds()}
        self.scales = {k: torch.zeros(blocks, dtype=torch.float32) for k in self.kinds()}
        self.step = 0
        self.torch_param = self.master.clone().requires_grad_()

    def kinds(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def moments(self) -> dict[str, torch.Tensor]:
        """The moments dequantized (what a state dict holds)."""
        qmap = {"exp_avg": q8.EXP_AVG_MAP}
        return {
            k: q8.dequantize(self.codes[k], self.scales[k], q8.BLOCK, qmap.get(k, q8.EXP_AVG_SQ_MAP))
            for k in self.kinds()
        }

    def update(self, g: torch.Tensor, group: dict, grad_scale: Optional[torch.Tensor]) -> None:
        self.step += 1
        beta1, beta2 = group["betas"]
        amsgrad = (
            {"max_codes": self.codes["max_exp_avg_sq"], "max_scales": self.scales["max_exp_avg_sq"]}
            if self.amsgrad
            else {}
        )
        fused_adamw_int8_reference(
            self.master, g.reshape(-1).float(), self.codes["exp_avg"], self.scales["exp_avg"],
            self.codes["exp_avg_sq"], self.scales["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], step=float(self.step),
            grad_scale=1.0 if grad_scale is None else float(grad_scale), maximize=group.get("maximize", False),
            **amsgrad,
        )  # fmt: skip


class Int8Reference(SRReference):
    """:class:`moment_reference.SRReference`'s driver and checks with int8 moments per parameter."""

    def make_params(self, names: list[str], group: dict, gi: int) -> dict[str, Int8Param]:
        return {n: Int8Param(n, self.by_name[n], group["amsgrad"]) for n in names}
