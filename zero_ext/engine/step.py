"""One optimizer step: agree, measure, clip, update, gather.

1. *Agree* (host): every rank validates its hyperparameters and looks for gradients it should not have; every
   rank lists the parameters that got a gradient, and whether its parameters were changed in place since the last
   step (stages 1 and 2, :class:`zero_ext.state.params.ParamEdits`). One collective sums these flags (on gloo it is the norm's own
   all-reduce; on NCCL a gloo group of the same ranks carries them), so every rank learns, without reading the
   device, whether some rank failed or changed its parameters alone (then all raise, before anything changed)
   and which parameters update. Then the master follows the changed parameters.
2. *Measure* (device): the global gradient norm and non-finite flag from every grad shard, all-reduced.
3. *Clip*: ``max_norm / (norm + 1e-6)``, at most 1 (torch.nn.utils.clip_grad_norm_'s coefficient), a device
   scalar fed to the kernel as ``grad_scale``; ``found_inf`` makes the kernel a no-op.
4. *Update*: per bucket, the runs of this rank's shard whose parameters update (``step_counts.update_runs``).
5. *Gather*: each bucket's all-gather starts as soon as its update is queued.

``clip_grad_norm_`` runs steps 1-3 early and returns the norm, as torch's function does; the step that follows
reuses them while no new gradient arrived.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import ops
from ..layout import Range
from ..state.sharded_state import ShardedState
from ..state.step_counts import update_runs
from ..update.protocol import PARAMETERS
from ..update.registry import rule_for_group
from .param_sync import ParamSync
from .reducer import GradSync


class Stepper:
    def __init__(self, state: ShardedState, grad_sync: GradSync, param_sync: ParamSync, max_grad_norm):
        self.state, self.grad_sync, self.param_sync = state, grad_sync, param_sync
        self.max_grad_norm = max_grad_norm
        scalar = dict(dtype=torch.float32, device=state.update_device)  # where the update runs
        self.found_inf = torch.zeros((), **scalar)
        self.grad_norm = torch.zeros((), **scalar)
        self.clip_coef = torch.ones((), **scalar)
        self.not_skipped = torch.ones((), **scalar)
        self._norm_stats = torch.zeros(2, **scalar)
        self._flag_of = {gidx: i for i, gidx in enumerate(state.step_counts.indices)}
        self._agreed: Optional[tuple[int, set[int], list]] = None  # (gradient epoch, active, scalars)
        self._clip_to: Optional[float] = None  # clip_grad_norm_'s max_norm for the step of the same epoch

    def extend(self) -> None:
        """``add_param_group`` added parameters: a flag each in the agreement, which is made again. The last norm and a
        ``clip_grad_norm_`` owed to the next step stay (the added parameters have no gradient yet: the same norm)."""
        self._flag_of = {gidx: i for i, gidx in enumerate(self.state.step_counts.indices)}
        self._agreed = None

    # ---------------------------------------------------------------- 1-3
    def agree(self, param_groups: Sequence[dict]) -> tuple[set[int], list]:
        """Steps 1 and 2 (cached while no gradient changes): the parameters that update, the scalars per group."""
        epoch = self.grad_sync.epoch
        self.state.comm.position.at("step")
        if self._agreed is not None and self._agreed[0] == epoch:
            return self._agreed[1], self._agreed[2]
        state = self.state
        error, scalars, edited, hand = None, None, False, {}
        try:
            scalars = resolve_scalars(state, param_groups)
            self.grad_sync.strategy.check_no_foreign_grads()
            hand = self.grad_sync.find_hand_grads()
            check_params_in_place(state)
            check_still_frozen(state)
            edited = state.param_edits is not None and state.param_edits.changed()
        except (ValueError, RuntimeError) as e:  # raised below, once every rank knows
            error = e
        self.grad_sync.finish_grad_sync()
        # built on the host, one tensor (not one index per parameter): failed, parameters edited, and per parameter
        # got a gradient (1) plus, assigned by hand (reducer.py), `hand` (world + 1: the sum over the ranks tells
        # both counts apart, exactly in fp32, in the same elements)
        hand_unit = float(state.world_size + 1)
        values = [0.0] * (2 + len(self._flag_of))
        values[0] = float(error is not None)
        # parameters edited in place (1) plus, reduced gradients dropped (`model.zero_grad()`, `p.grad = None` or a
        # `.grad` replaced between backward and step: grad_placeholders.py), `hand_unit`: both rank counts in one
        values[1] = float(edited) + hand_unit * float(self.grad_sync.placeholders.dropped)
        for gidx in self.grad_sync.got_grads():
            values[2 + self._flag_of[gidx]] = 1.0
        for group_index, slot_index in hand:
            values[2 + self._flag_of[state.groups[group_index].param_indices[slot_index]]] += hand_unit
        agreed = state.comm.reduce_step_stats(torch.tensor(values, dtype=torch.float32), self._measure())
        if error is not None:
            raise error
        if agreed[0] > 0:
            raise ValueError(
                f"{state.optimizer_name}.step: failed on {int(agreed[0])} other rank(s) (see their errors); nothing was "
                "changed on any rank"
            )
        summed = agreed.tolist()  # one host read, not one tensor index per parameter
        dropped = int(summed[1] // hand_unit)
        summed[1] -= dropped * hand_unit
        if 0 < dropped < state.world_size:
            raise ValueError(
                f"{state.optimizer_name}.step: gradients of the last backward were dropped on {dropped} of "
                f"{state.world_size} ranks only (`model.zero_grad()`, `p.grad = None` or a `.grad` replaced between "
                "backward and step): the mean gradient is sharded, so each of those ranks dropped only its own piece "
                "of it and the ranks would update differently. Drop or replace gradients on every rank, or on none. "
                "Nothing was changed by this step; `opt.zero_grad()` on every rank starts clean"
            )
        if 0 < summed[1] < state.world_size:
            raise ValueError(
                f"{state.optimizer_name}.step: parameters were changed in place on {int(summed[1])} of "
                f"{state.world_size} ranks since the last step (e.g. `model.load_state_dict` on one rank only); the "
                "fp32 master would follow them in those ranks' shards only. Change them on every rank, or inside "
                "`with opt.gathered_params(modifier_rank=r):`. Nothing was changed on any rank"
            )
        active = {gidx for gidx, i in self._flag_of.items() if summed[2 + i] > 0}
        by_hand = {gidx for gidx, i in self._flag_of.items() if summed[2 + i] >= hand_unit}
        if by_hand:  # every rank, the same buckets: then the norm again, of the shards that now hold them
            self.grad_sync.reduce_hand_grads(hand, by_hand)
            state.comm.reduce_step_stats(torch.zeros(1), self._measure())
            active |= by_hand
        stats = self._norm_stats
        torch.sqrt(stats[0], out=self.grad_norm)
        torch.clamp(stats[1], max=1.0, out=self.found_inf)
        self._agreed = (epoch, active, scalars)
        return active, scalars

    def _measure(self) -> torch.Tensor:
        """This rank's part of the norm: the sum of squares and the non-finite count of its grad shards."""
        stats = self._norm_stats
        stats.zero_()
        for group in self.state.groups:
            sumsq, nonfinite = ops.sum_squares(group.state.grad)
            stats[0] += sumsq
            stats[1] += nonfinite
        return stats

    def clip_grad_norm_(self, param_groups: Sequence[dict], max_norm: float) -> torch.Tensor:
        self.grad_sync.placeholders.settle(defer=False)  # after torch's clipping: the norm of the clipped gradients
        self.agree(param_groups)
        self._clip_to = float(max_norm)
        return self.grad_norm

    def _grad_scale(self):
        max_norm = self._clip_to if self._clip_to is not None else self.max_grad_norm
        if max_norm is None:
            return 1.0
        # torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1.
        torch.add(self.grad_norm, 1e-6, out=self.clip_coef)
        torch.div(max_norm, self.clip_coef, out=self.clip_coef)
        return self.clip_coef.clamp_(max=1.0)

    # ---------------------------------------------------------------- 4-5
    def step(self, param_groups: Sequence[dict]) -> bool:
        """One step; False when no parameter had a gradient on any rank (torch then does nothing)."""
        try:
            return self._step(param_groups)
        finally:  # the step count the divergence check names (divergence.py): one per call, on every rank
            self.state.comm.position.step += 1
            self.state.comm.position.at("after step")

    def _step(self, param_groups: Sequence[dict]) -> bool:
        state = self.state
        # torch.nn.utils.clip_grad_norm_ on the .grad placeholders: its coefficient, when it scaled every gradient
        # alike and the engine does not clip too, is the kernel's grad_scale (else it was applied to the shards)
        clipped = self.grad_sync.placeholders.settle(defer=self._clip_to is None and self.max_grad_norm is None)
        active, scalars = self.agree(param_groups)
        grad_scale = clipped if clipped is not None else self._grad_scale()
        self._agreed, self._clip_to = None, None
        if state.param_edits is not None:  # the master follows parameters changed in place since the last step
            state.param_edits.adopt(checked=True)
        if not active:
            return False
        torch.sub(1.0, self.found_inf, out=self.not_skipped)
        state.step_counts.advance(active, self.not_skipped)
        state.step_count.add_(self.not_skipped)
        state.skipped.add_(self.found_inf)
        # Unit by unit (a bucket, or a chunk of a shard on disk), each bucket's all-gather starting once its last
        # unit is queued. A bucket none of whose parameters updates anywhere is not updated nor gathered.
        # Where the update runs on the host (CPU tensors, offload), a skipped step is known without a device sync:
        # no kernel runs and nothing is copied back (the kernel's no-op would leave offload's parameter staging
        # unwritten). On a GPU the kernels read found_inf themselves.
        skipped = self.found_inf.device.type == "cpu" and bool(self.found_inf.item())
        for group in state.groups:
            s = scalars[group.index]
            if state.step_counts.uniform(active):
                moving = {b.index for b in group.layout.buckets}
            else:
                moving = {
                    b.index for b in group.layout.buckets if any(group.param_indices[i] in active for i in b.slots)
                }
            for unit in group.state.units(group.layout.buckets):
                update = unit.bucket.index in moving and not skipped
                updated = self._update(group, unit, s, active, grad_scale) if update else []
                group.state.unit_done(unit, updated)
                if unit.last and unit.bucket.index in moving:
                    self.param_sync.bucket_updated(group, unit.bucket)
            group.state.step_done()
        self.grad_sync.after_step()
        return True

    def _update(self, group, unit, s, active: set[int], grad_scale) -> list:
        """The group's update rule (one fused kernel) on every run of ``unit`` whose parameters update (one step
        counter per run); returns those runs, in the unit's coordinates."""
        if group.rule.unit == PARAMETERS:
            return self._update_parameters(group, unit, s, active, grad_scale)
        state, updated = self.state, []
        # the canonical index of the bucket slice's first element (bf16 moments' rounding: layout.py)
        canonical = group.layout.canonical_start(unit.bucket, group.rank)
        block = group.rule.block
        for run, cls in update_runs(
            group.pieces_by_bucket[unit.bucket.index], group.param_indices, unit.bucket, active, state.step_counts
        ):
            if block > 1:  # int8 moments: whole blocks (a run starts a parameter, 64-aligned; the rest is padding)
                run = Range(run.start, min(run.end + -run.end % block, unit.bucket.shard_numel))
            part = run.intersect(unit.rows)
            if not part.numel:
                continue
            r = part.shifted(-unit.rows.start)  # in the unit's own coordinates
            updated.append(r)
            v = unit.views.run(r)
            group.rule.apply(v.state, v.grad, v.param_out, s, state.step_counts.steps[cls], grad_scale, self.found_inf,
                             element_offset=canonical + part.start)  # fmt: skip
        return updated

    def _update_parameters(self, group, unit, s, active: set[int], grad_scale) -> list:
        """A rule of whole parameters (owner layout: each of this rank's pieces is a whole parameter) on every
        parameter of ``unit`` that updates, one at a time, its views shaped as the parameter."""
        updated = []
        for piece in group.pieces_by_bucket[unit.bucket.index]:
            gidx = group.param_indices[piece.index]
            if gidx not in active:
                continue
            whole = piece.shard_range.shifted(-unit.bucket.shard_offset)
            part = whole.intersect(unit.rows)
            if not part.numel:
                continue
            if part != whole:  # placements cut units at parameter boundaries for such rules (disk.py)
                raise RuntimeError(f"zero_ext: a unit of the step cuts parameter {group.names[piece.index]!r}")
            r = part.shifted(-unit.rows.start)
            updated.append(r)
            v = unit.views.run(r)
            shape = group.params[piece.index].shape
            views = {k: t.view(shape) for k, t in v.state.items()}
            out = None if v.param_out is None else v.param_out.view(shape)
            group.rule.apply_parameter(views, v.grad.view(shape), out, s, self.state.step_counts.step_of(gidx),
                                       grad_scale, self.found_inf, element_offset=group.layout.canonical[piece.index])  # fmt: skip
        return updated


def resolve_scalars(state: ShardedState, param_groups: Sequence[dict]) -> list:
    """Every flat group's scalars from its param group, checked by its rule (no device sync); every param group is
    checked, those without trainable parameters too. Raises before anything is changed."""
    rules = {group.group_index: group.rule for group in state.groups}
    for gi, g in enumerate(param_groups):
        rule = rules.get(gi) or rule_for_group(torch.float32, g, group_index=gi, default=state.default_rule)
        rule.check_group(f"{state.optimizer_name}: param group {gi}", g, state.update_device, read_device_values=False)
    return [group.rule.scalars(param_groups[group.group_index]) for group in state.groups]


def check_still_frozen(state: ShardedState) -> None:
    """A parameter frozen when the optimizer was built has no shard, state or hook: made trainable since (gradual
    unfreezing), it would get gradients that nothing reduces and never be updated, where torch's AdamW, given it,
    would update it. (Gradual unfreezing adds the parameters in a new group instead: ``add_param_group``.)"""
    for name, p in state.frozen:
        if p.requires_grad:
            raise ValueError(
                f"{state.optimizer_name}: parameter {name!r} had requires_grad=False when the optimizer was built and is "
                "trainable now; the optimizer shards and updates only the parameters trainable when it is built, so it "
                "would never update this one. Build the optimizer from the trainable parameters only and add this "
                "one when it is unfrozen, with opt.add_param_group({'params': [...]}) (or set requires_grad back to "
                "False)"
            )


def check_params_in_place(state: ShardedState) -> None:
    """Every parameter still lives where the optimizer put it; else the model was moved, cast or given new tensors
    after the optimizer was built, and the optimizer would update buffers the model no longer reads."""
    for group in state.groups:
        index = group.flat_params.misplaced(group.params)
        if index is not None:
            p = group.params[index]
            raise RuntimeError(
                f"{state.optimizer_name}: parameter {group.names[index]!r} ({p.dtype}, {p.device}) no longer lives in the "
                f"optimizer's flat buffer ({group.dtype}, {group.device}): the model was moved, cast or given new "
                "tensors after the optimizer was built. Move or cast the model first, then build the optimizer."
            )
