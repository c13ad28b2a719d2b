"""Building a rank's :class:`ShardedState` from torch param groups, in named steps.

1. *Plan* (local): name every parameter (after the model with ``module=``), check dtypes, devices, duplicates and
   the meta-device rules, choose each flat group's update rule (:mod:`zero_ext.update.registry`). A local failure is recorded,
   not raised, so that every rank reaches step 2.
2. *Agree* (collective): every rank learns whether every rank planned successfully and whether all planned the
   same thing (layout, rules, settings); otherwise all raise together. Then, with ``offload="nvme"``, the state
   directory is prepared and its free space agreed.
3. *Build*: rank 0's parameters and buffers are broadcast (``sync_module_states``), the flat groups are built (the
   parameters re-pointed into flat buffers, the placements allocated: files for nvme, whose failure is agreed too)
   and the ShardedState is made from them, finished.

Nothing is changed before step 2 succeeds on every rank: a failed construction leaves the model as it was.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..comm import communicator_for, fallback_device
from ..comm.mesh import Mesh, mesh_communicator
from ..engine.config import EngineConfig
from ..engine.model_state import ModelState
from ..placement.offload import placement_class, placement_factory, prepare_offload
from ..state.sharded_params import ChunkedParams, ShardedParams
from ..state.sharded_state import FlatGroup, ShardedState
from ..update.protocol import UpdateRule
from ..update.registry import rule_for_group
from .layouts import layout_for, shape_error
from .meta_init import default_device
from .module_sync import broadcast_from_rank0, describe, tensors_to_sync
from .planning import Plan, agree_on_plan, default_bucket_size, name_by_model, plan_groups


class StateBuilder:
    """Steps 1 and 2 run at construction (collective); :meth:`build` runs step 3 and returns the finished state."""

    def __init__(self, param_groups: Sequence[dict], options: EngineConfig):
        self.param_groups, self.options = param_groups, options
        self.plan = self._plan()
        if options.communicator is not None:
            self.comm = options.communicator
        elif options.mesh is not None:
            self.comm = mesh_communicator(
                options.mesh, options.replicate_state, self.device, communicator_for, options.inter_node_reduce_dtype
            )
        else:
            self.comm = communicator_for(options.process_group, self.device)
        trainable = sum(p.numel() for _, members in self.plan.groups for _, p in members)
        self.bucket_size = options.bucket_size or default_bucket_size(trainable, self.comm)
        self._agree()

    # ---------------------------------------------------------------- 1. plan
    def _plan(self) -> Plan:
        o = self.options
        plan = plan_groups(self.param_groups)
        self.model = None
        if o.module is not None:
            try:
                self.model = ModelState(o.module, o.name)
                name_by_model(plan, self.model)
            except ValueError as e:
                plan.error = plan.error or str(e).removeprefix(f"{o.name}: ")
        self.on_meta = plan.device is not None and plan.device.type == "meta"
        if self.on_meta:
            if not o.strategy.shards_params or o.param_init is None:
                plan.error = plan.error or (
                    "the parameters are on the meta device: build the optimizer with stage=3 and param_init= (a "
                    "function initialising one module's own parameters), which materialises only this rank's shard"
                )
            plan.device = torch.device(o.param_device) if o.param_device is not None else default_device()
        elif o.param_init is not None:
            plan.error = plan.error or "`param_init` is for a model built on the meta device (stage 3)"
        if not isinstance(o.sync_module_states, bool):
            plan.error = plan.error or f"`sync_module_states` must be True or False, got {o.sync_module_states!r}"
        self.everything = [p for g in self.param_groups for p in g["params"]]
        owned = self.model.module if self.model is not None else None  # None where `module` was refused
        self.to_sync = (
            tensors_to_sync(self.everything, owned) if o.sync_module_states is True and not self.on_meta else []
        )
        self.device = plan.device or fallback_device(o.process_group)
        if o.param_remainders:
            for gi, members in plan.groups:
                if members[0][1].dtype != torch.bfloat16:
                    plan.error = plan.error or (
                        f"`param_remainders=True` keeps the fp32 master as the bfloat16 parameter plus a 16-bit "
                        f"remainder: it needs bfloat16 parameters, but param group {gi} has {members[0][1].dtype} "
                        "ones (use the default param_remainders=False: an fp32 master)"
                    )
        self.rules: list[UpdateRule] = []
        for gi, members in plan.groups:
            dtype = members[0][1].dtype
            remainders = o.param_remainders and dtype == torch.bfloat16
            try:
                rule = rule_for_group(dtype, self.param_groups[gi], remainders, o.moment_dtype, gi, o.default_rule)
            except ValueError as e:  # an unknown or refused rule: every rank raises at the agreement, none hangs
                plan.error = plan.error or str(e).removeprefix("zero_ext: ")
                rule = rule_for_group(dtype, {}, remainders, o.moment_dtype, gi)
            plan.error = plan.error or shape_error(rule, f"param group {gi}", members, plan.names)
            self.rules.append(rule)
        return plan

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for _, members in self.plan.groups for _, p in members]

    # ---------------------------------------------------------------- 2. agree
    def _agree(self) -> None:
        o = self.options
        settings = (
            f"stage={o.stage} mesh={Mesh(self.comm).shape} {getattr(self.comm, 'grid', '')} "
            f"replicate_state={o.replicate_state} inter={o.inter_node_reduce_dtype} reduce={o.reduce_dtype} bucket={self.bucket_size} offload={o.offload} "
            f"{o.offload_window} rules={[r.describe() for r in self.rules]} "
            f"sync_module_states={o.sync_module_states} {describe(self.to_sync)}"  # the broadcast in build() matches
        )
        agree_on_plan(self.comm, self.plan, settings, self.options.name)
        self.layouts = [
            layout_for(rule, [p for _, p in members], self.comm.world_size, self.bucket_size, o.offload)
            for (_, members), rule in zip(self.plan.groups, self.rules)
        ]
        # nvme: the directory and its free space, agreed before anything is built
        self.directory = prepare_offload(
            self.comm, o.offload, o.offload_dir, list(zip(self.layouts, self.rules)), o.name
        )

    # ---------------------------------------------------------------- 3. build
    def build(self) -> ShardedState:
        o, plan, comm = self.options, self.plan, self.comm
        broadcast_from_rank0(comm, self.to_sync)  # after the agreement (a failed one fails every rank), before shards
        specs = [
            (gi, members, layout, rule) for (gi, members), layout, rule in zip(plan.groups, self.layouts, self.rules)
        ]
        groups = build_flat_groups(comm, o, self.directory, plan.names, plan.device, specs, first_index=0)
        frozen = [(plan.names[i], p) for i, p in enumerate(self.everything) if not p.requires_grad]
        return ShardedState(
            Mesh(comm), o.stage, self.bucket_size, groups, plan.names, self.device,
            model=self.model, frozen=frozen, default_rule=o.default_rule,
            update_device=placement_class(o.offload).update_device_on(self.device),
            tracks_param_edits=o.strategy.tracks_param_edits, optimizer_name=o.name,
        )  # fmt: skip


def build_flat_groups(comm, o: EngineConfig, directory, names: dict[int, str], device, specs, first_index: int):
    """The flat groups of ``specs`` ``[(param group index, [(global index, parameter)], layout, rule)]``, numbered
    from ``first_index`` (the parameters re-pointed into flat buffers, the placements allocated). With nvme offload
    a failure to create the files on any rank fails every rank, the files made so far deleted."""
    placement = placement_factory(o.offload, directory, o.offload_window, comm.rank, first_index + len(specs))
    params_cls = o.strategy.params_storage
    mesh = Mesh(comm)
    if params_cls is ShardedParams and mesh.replicate_size > 1 and not mesh.replicate_state:
        params_cls = functools.partial(ChunkedParams, replicas=mesh.replicate_size)  # stage 3: gathers in the node
    groups, error = [], None
    try:
        for fi, (gi, members, layout, rule) in enumerate(specs, start=first_index):
            indices = [i for i, _ in members]
            grads = o.strategy.grad_buffer_dtype(o.grad_accum_dtype, members[0][1].dtype)
            groups.append(FlatGroup(
                fi, gi, [p for _, p in members], indices, [names[i] for i in indices], layout, comm.rank,
                params_cls, device, placement, rule, grads,
            ))  # fmt: skip
    except BaseException as e:
        for group in groups:  # files of the groups built so far
            group.state.close()
        if o.offload != "nvme":
            raise
        error = e
    if o.offload == "nvme":  # a disk that filled up since the check fails every rank, not just this one
        failed = [r for r, f in enumerate(comm.agree(int(error is not None))) if f]
        if error is not None:
            raise error
        if failed:
            for group in groups:
                group.state.close()
            raise RuntimeError(f"{o.name}: creating the offload files failed on rank(s) {failed}")
    return groups
