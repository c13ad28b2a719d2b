"""Every keyword option of ZeroAdamW in one frozen object, checked once, before anything is built or any rank is
waited for (a clear ValueError naming the option): the builder, ``add_param_group`` and the engine read it, and
nothing changes it afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..comm.mesh import check_mesh
from ..placement.offload import check_offload_options
from ..update.adamw import check_flag, check_moment_dtype
from ..update.registry import DEFAULT_RULE
from .gather_units import check_gather_units
from .options import check_collective_timeout, check_options, check_process_group, check_stage3_options
from .stages import Stage, stage_for


@dataclass(frozen=True)
class EngineConfig:
    """The options that shape the sharded state and its engine (ZeroAdamW's keywords, by the same names)."""

    stage: int
    process_group: Optional[dist.ProcessGroup] = None
    communicator: Optional[Communicator] = None
    mesh: Any = None  # a DeviceMesh (2-D: ("replicate", "shard")), "auto" or None (comm/mesh.py)
    replicate_state: bool = False  # with a 2-D mesh: FSDP2's replicated optimizer state instead of sharded everywhere
    inter_node_reduce_dtype: Optional[torch.dtype] = None  # 2-D mesh: bf16/int8 sums across nodes (comm/compress)
    bucket_size: Optional[int] = None
    reduce_dtype: torch.dtype = torch.float32
    grad_accum_dtype: Optional[torch.dtype] = None
    max_grad_norm: Optional[float] = None
    module: Optional[torch.nn.Module] = None  # the model (or defer_all_gather_to's, when only that is given)
    sync_module_states: bool = True
    reshard_after_forward: bool = True
    prefetch: int = 1
    gather_units: Any = "auto"  # stage 3: the modules that gather (gather_units.py)
    param_init: Optional[Callable] = None
    param_device: Optional[torch.device] = None
    defer_all_gather_to: Optional[torch.nn.Module] = None
    staging_buffers: int = 2
    offload: Optional[str] = None
    offload_dir: Optional[str] = None
    offload_window: Optional[int] = None
    param_remainders: bool = False
    moment_dtype: torch.dtype = torch.float32
    collective_timeout: Optional[float] = 300.0
    default_rule: str = DEFAULT_RULE  # the update rule of a param group that names none (update.registry)
    name: str = "zero_ext.ZeroAdamW"  # the optimizer class, as the messages raised from the model's hooks name it

    @classmethod
    def checked(cls, defaults: Mapping[str, Any], **options) -> "EngineConfig":
        """The configuration of ``options``, every one checked (``defaults``: the param-group defaults, checked by the
        update rule); raises the first problem found, in the order the options are documented."""
        o = cls(**options)
        check_offload_options(o.offload, o.offload_dir, o.offload_window)
        check_flag("zero_ext.ZeroAdamW", "param_remainders", o.param_remainders)
        check_moment_dtype("zero_ext.ZeroAdamW", o.moment_dtype)
        check_options(o.stage, defaults, o.max_grad_norm, o.bucket_size, o.staging_buffers, o.reduce_dtype,
                      o.grad_accum_dtype, o.default_rule)  # fmt: skip
        check_stage3_options(stage_for(o.stage), o.module, o.reshard_after_forward, o.prefetch, o.defer_all_gather_to)
        check_gather_units(o.gather_units)
        check_process_group(o.process_group, o.communicator)
        check_mesh(o.mesh, o.process_group, o.communicator, o.replicate_state, o.inter_node_reduce_dtype)
        check_collective_timeout(o.collective_timeout)
        if o.defer_all_gather_to is not None and o.module is not None and o.defer_all_gather_to is not o.module:
            raise ValueError("zero_ext.ZeroAdamW: `defer_all_gather_to` and `module` must be the same model")
        if o.module is None and o.defer_all_gather_to is not None:
            object.__setattr__(o, "module", o.defer_all_gather_to)  # (still being made: frozen from here on)
        return o

    @property
    def strategy(self) -> Stage:
        """The stage object: every stage-dependent choice of the builder and the engine."""
        return stage_for(self.stage)
