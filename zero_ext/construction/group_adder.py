"""``opt.add_param_group(...)`` after construction: a new flat group, in the constructor's steps (``state_builder``).

1. *Plan* (local): the group as torch normalises it (a tensor or an iterable of parameters, or of ``(name,
   parameter)`` pairs; the optimizer's defaults filled in as torch fills them), each parameter named (after the
   model with ``module=``) and checked: a tensor, a leaf, trainable, in no group yet, of a supported dtype, dense, on
   the optimizer's device, the model's; the hyperparameters by the group's update rule. A local failure is recorded,
   not raised, so that every rank reaches step 2.
2. *Agree* (collective): every rank learns whether every rank planned successfully, then whether all planned the same
   group (names, shapes, dtypes, hyperparameters); otherwise all raise together, with nothing changed anywhere (the
   param groups, the parameters and the sharded state as they were).
3. *Build*: rank 0's values broadcast (``sync_module_states``, as at construction: at stage 3 the shards are cut from
   them), the group's flat groups built (its parameters re-pointed into flat buffers, or sharded at stage 3; the
   state allocated where ``offload`` puts it), numbered after the existing ones. The optimizer's engine then takes
   them in, in place (``Engine.extend``: the sharded state, the buckets' runtimes, the gradient and parameter syncs
   and the step each gain what the new groups need and keep what they hold).

A parameter keeps one place for good: one frozen when the optimizer was built and given to it stays in its group
untrained (``step()`` refuses it once it is trainable). Build the optimizer from the trainable parameters only, and
add the others with this call when they are unfrozen.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from ..engine.config import EngineConfig
from ..layout import fingerprint
from ..state.sharded_state import FlatGroup, ShardedState
from ..update.registry import rule_for_group
from .layouts import layout_for, shape_error
from .module_sync import broadcast_from_rank0
from .planning import SUPPORTED_DTYPES
from .state_builder import build_flat_groups


class GroupAdder:
    """Steps 1 and 2 run at construction (collective: raises on every rank if any failed or differs); :meth:`build`
    runs step 3."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: ShardedState, options: EngineConfig,
                 param_group: Any, busy: Optional[str]):  # fmt: skip
        self.state, self.options = state, options
        self.where = f"{options.name}.add_param_group"  # how its errors name the call
        self.index = len(optimizer.param_groups)  # the new param group's
        self.group: dict = {}
        self.members: list[tuple[int, torch.nn.Parameter]] = []  # (global index, parameter)
        self.names: dict[int, str] = {}
        self.specs: list = []  # [(param group index, members, layout, rule)] per flat group, by dtype
        error = busy
        if error is None:
            try:
                self._plan(optimizer, param_group)
            except (TypeError, ValueError) as e:
                error = str(e)
        self._agree(error)

    # ---------------------------------------------------------------- 1. plan
    def _plan(self, optimizer, param_group) -> None:
        state, model = self.state, self.state.model
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"`param_group` must be a dict with 'params', got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("'params' is a set, whose order changes between runs; give a list")
        params = [params] if isinstance(params, torch.Tensor) else list(params)  # a generator is read once
        param_group["params"] = params  # (torch.optim normalises the caller's dict too)
        named = [p for p in params if isinstance(p, tuple)]
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        if not tensors:
            raise ValueError(f"param group {self.index} has no parameters")
        base = sum(len(g["params"]) for g in optimizer.param_groups)
        placed: dict[int, int] = {}  # id(parameter) -> its global index, every group's
        where_of: dict[int, int] = {}  # global index -> its param group
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                where_of[len(placed)] = gi
                placed[id(p)] = len(placed)
        used = set(state.names.values())
        for i, p in enumerate(tensors):
            gidx = base + i
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {self.index}: params[{i}] is a {type(p).__name__}, not a tensor")
            name = named[i][0] if named and len(named) == len(tensors) else f"param_groups[{self.index}].params[{i}]"
            keys = model.keys_of.get(id(p)) if model is not None else None
            name = keys[0] if keys else name
            if id(p) in placed:
                other = placed[id(p)]
                raise ValueError(
                    f"parameter {name!r} is already in param group {where_of[other]} (as {state.names[other]!r}); a "
                    "parameter belongs to one group for good (one given frozen at construction stays there, "
                    "untrained): build the optimizer from the trainable parameters only ([p for p in "
                    "model.parameters() if p.requires_grad]) and add the others when they are unfrozen"
                )
            if any(q is p for _, q in self.members):
                raise ValueError(f"parameter {name!r} is listed twice in the new param group")
            if not (p.is_leaf or p.retains_grad):
                raise ValueError(f"parameter {name!r} is not a leaf tensor; only leaves can be optimized")
            if not p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} has requires_grad=False: unfreeze it first (p.requires_grad_(True)), then "
                    "add it (a new group holds parameters to train)"
                )
            if p.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; expected float32, bfloat16 or float16")
            if p.is_sparse:
                raise ValueError(f"parameter {name!r} is sparse; only dense parameters are supported")
            if p.device != state.device:
                raise ValueError(
                    f"parameter {name!r} is on {p.device}, the optimizer's parameters on {state.device}; all must be "
                    "on one device"
                )
            if model is not None and not keys:
                raise ValueError(
                    f"parameter {name!r} is not a parameter of `module` (every optimized parameter must be)"
                )
            if name in used:
                raise ValueError(f"the name {name!r} is already another parameter's")
            used.add(name)
            self.members.append((gidx, p))
            self.names[gidx] = name
        # Named like the existing groups (torch.optim wants all groups with names or all without): a group of plain
        # parameters added to an optimizer built from named_parameters() gets the names found above, and the reverse.
        if named and len(named) != len(tensors):
            raise ValueError(f"param group {self.index}: some parameters have names and others not")
        with_names = any("param_names" in g for g in optimizer.param_groups)
        param_group["params"] = [(self.names[gidx], p) for gidx, p in self.members] if with_names else tensors
        # torch's own normalisation and checks, its defaults filled in (on a copy: nothing is added before step 2)
        scratch = SimpleNamespace(defaults=optimizer.defaults, param_groups=list(optimizer.param_groups))
        torch.optim.Optimizer.add_param_group(scratch, param_group)
        self.group = scratch.param_groups[-1]
        for dtype in SUPPORTED_DTYPES:
            members = [(gidx, p) for gidx, p in self.members if p.dtype == dtype]
            if members:
                # the optimizer's precision options hold for added groups too (param_remainders refuses non-bf16)
                rule = rule_for_group(dtype, self.group, self.options.param_remainders,
                                      moment_dtype=self.options.moment_dtype, group_index=self.index,
                                      default=self.options.default_rule)  # fmt: skip
                rule.check_group(f"param group {self.index}", self.group)
                error = shape_error(rule, f"param group {self.index}", members, self.names)
                if error:
                    raise ValueError(error)
                layout = layout_for(
                    rule, [p for _, p in members], state.world_size, state.bucket_size, self.options.offload
                )
                self.specs.append((self.index, members, layout, rule))

    # ---------------------------------------------------------------- 2. agree
    def _agree(self, error: Optional[str]) -> None:
        comm = self.state.comm
        failed = [r for r, f in enumerate(comm.agree(int(error is not None))) if f]
        if error is not None:
            raise ValueError(f"{self.where}: {error}. Nothing was changed")
        if failed:
            raise ValueError(
                f"{self.where}: failed on rank(s) {failed} (see their errors); nothing was changed on any rank"
            )
        hyper = {k: v for k, v in self.group.items() if k not in ("params", "param_names")}
        parts = [f"{k}={v.tolist() if isinstance(v, torch.Tensor) else v!r}" for k, v in sorted(hyper.items())]
        parts += [f"{self.names[gidx]} {p.dtype} {tuple(p.shape)}" for gidx, p in self.members]
        everyone = comm.agree(fingerprint(parts))
        if len(set(everyone)) != 1:
            differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
            raise ValueError(
                f"{self.where}: the new param group differs between ranks (ranks {differ} differ from rank 0 in its "
                "parameters' names, shapes or dtypes, or its hyperparameters); every rank must add the same group. "
                "Nothing was changed on any rank"
            )

    # ---------------------------------------------------------------- 3. build
    def build(self, directory: Optional[str]) -> list[FlatGroup]:
        """The new flat groups (collective: the broadcast; nvme's file creation is agreed)."""
        o, state = self.options, self.state
        if o.sync_module_states is True:
            broadcast_from_rank0(state.comm, [p for _, p in self.members])
        return build_flat_groups(state.comm, o, directory, self.names, state.device, self.specs, len(state.groups))
