"""The checks of the keyword options (declared in :mod:`.config`), run before anything is built: a clear ValueError
naming the option and, first, the optimizer (``where``: ``EngineConfig.name``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..update.registry import DEFAULT_RULE, rule_for_group

WHERE = "zero_ext.ZeroAdamW"


def check_options(stage, defaults, max_grad_norm, bucket_size, staging_buffers, reduce_dtype, grad_accum_dtype,
                  default_rule: str = DEFAULT_RULE, where: str = WHERE):  # fmt: skip
    """``defaults``: the param-group defaults (torch.optim.AdamW's keywords), checked by the update rule they name
    (``default_rule`` unless they name one)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"{where}: `stage` must be 1, 2 or 3, got {stage!r}")
    rule_for_group(torch.float32, defaults, default=default_rule).check_group(where, defaults)
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"{where}: `max_grad_norm` must be a number > 0 or None, got {max_grad_norm!r}")
    if bucket_size is not None and not (isinstance(bucket_size, int) and bucket_size > 0):
        raise ValueError(f"{where}: `bucket_size` must be a positive int (elements), got {bucket_size!r}")
    if not (isinstance(staging_buffers, int) and staging_buffers >= 1):
        raise ValueError(f"{where}: `staging_buffers` must be an int >= 1, got {staging_buffers!r}")
    if reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: `reduce_dtype` must be float32, bfloat16 or float16, got {reduce_dtype}")
    if grad_accum_dtype not in (None, torch.float32):
        raise ValueError(f"{where}: `grad_accum_dtype` must be None or torch.float32, got {grad_accum_dtype}")


def check_collective_timeout(collective_timeout, where: str = WHERE) -> None:
    if collective_timeout is None:
        return
    number = isinstance(collective_timeout, (int, float)) and not isinstance(collective_timeout, bool)
    if not (number and 0 < collective_timeout < float("inf")):
        raise ValueError(
            f"{where}: `collective_timeout` must be a number of seconds > 0 (how long a collective may wait before "
            f"the ranks compare where they are) or None (never check), got {collective_timeout!r}"
        )


def check_process_group(process_group, communicator, where: str = WHERE) -> None:
    if communicator is not None and process_group is not None:
        raise ValueError(f"{where}: give `process_group` or `communicator`, not both (a communicator has its group)")
    if communicator is not None and not isinstance(communicator, Communicator):
        raise ValueError(f"{where}: `communicator` must be a zero_ext.comm.Communicator, got {communicator!r}")
    if dist.is_initialized():
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(f"{where}: `process_group` does not include this process (global rank {dist.get_rank()})")
        return
    if process_group is not None:
        raise ValueError(f"{where}: `process_group` given but torch.distributed is not initialised")
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and communicator is None:
        raise RuntimeError(
            f"{where}: WORLD_SIZE={world} (launched by torchrun?) but torch.distributed is not initialised, so this "
            "process would train alone. Call torch.distributed.init_process_group() first (backend 'nccl' for CUDA "
            "parameters, 'gloo' for CPU ones); torchrun provides the rank and address through the environment."
        )


def check_stage3_options(
    stage, module, reshard_after_forward, prefetch, defer_all_gather_to, where: str = WHERE
) -> None:
    """``stage``: the stage object (``engine.stages``, after ``stage`` was checked): one whose parameters are sharded
    between uses gathers them through the model's hooks."""
    if stage.shards_params and module is None:
        raise ValueError(
            f"{where}: stage 3 needs the model: pass `module=model` (its forward hooks gather each bucket of "
            "parameters just before use)"
        )
    if stage.shards_params and defer_all_gather_to is not None:
        raise ValueError(f"{where}: `defer_all_gather_to` is for stages 1 and 2; stage 3 always gathers on use")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"{where}: `reshard_after_forward` must be True or False, got {reshard_after_forward!r}")
    if not (isinstance(prefetch, int) and not isinstance(prefetch, bool) and prefetch >= 0):
        raise ValueError(f"{where}: `prefetch` must be an int >= 0 (buckets gathered ahead), got {prefetch!r}")
