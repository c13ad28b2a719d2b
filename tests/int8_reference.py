"""The plain-torch reference of ``ZeroAdamW(moment_dtype=torch.int8)``: one process, no sharding, no zero_ext
kernel. Per parameter an fp32 master and its int8 moments (codes and one fp32 scale per 64 elements of the
parameter, the last block short), stepped by ``zero_ext.update.blockwise_int8.fused_adamw_int8_reference`` (dequantize,
the fp32 AdamW arithmetic, requantize with the new block absmax) on the mean of the ranks' gradients.

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

from zero_ext.update import blockwise_int8 as q8


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
        q8.fused_adamw_int8_reference(
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
