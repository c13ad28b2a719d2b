"""``offload_states()`` / ``reload_states()``: the optimizer's device memory handed back between training phases (RL
colocation: the trainer sleeps while an inference engine on the same GPUs generates), DeepSpeed's names and groups.

Groups (``include=``), each what the optimizer owns *on the device*:

- ``"optim_states"``: every kind of the update rule's state (the fp32 master, the moments, amsgrad's maximum, int8
  scales, the remainder), for a placement that keeps them on the device;
- ``"grads"``: the fp32 grad shard, stage 1's flat gradient buffer, the gradient staging pool and offload's landing
  ring (the buffers gradients pass through);
- ``"params"``: the flat parameter buffer (stages 1 and 2: the full parameters, every ``param.data`` a view of it;
  stage 3: this rank's shard, where one is kept: with the master on the device a stage-3 gather rounds the master
  instead, so its parameters are in ``"optim_states"``).

What an ``offload=`` placement keeps in host memory or on disk already is not a device byte: it stays where it is and
is never copied twice (``states_device()`` says ``"host"`` / ``"disk"`` for it). The bytes move storage by storage
(``placement/parking.py``): every view of a buffer stays the same object and sees the same bits after the reload, so
training goes on bitwise as if nothing happened. A few device scalars (step counts, the norm) stay: under 1 KiB.

While anything is parked, every call that would read or write a parked byte is refused with an error naming
``reload_states()``, before anything changed: ``step()``, ``clip_grad_norm_()``, ``zero_grad()``, ``finish_sync()``,
``gathered_params()``, ``state_dict()`` / ``load_state_dict()``, ``opt.state[p]``, ``add_param_group()``,
``zero_ext.checkpoint.save`` / ``load``, a backward reaching the optimizer's gradient hooks, a stage-3 forward whose
gathers would read a parked shard, and (with ``module=``) a stage-1/2 forward while the parameters are parked. ``step()``
and ``clip_grad_norm_()`` tell the other ranks through the step's own agreement, so they raise too (not hang) when
only some ranks offloaded; the other refusals are local, as offloading is: call both on every rank. ``.grad`` is set
aside while parked (None) and given back by the reload, so that a refused backward cannot write a parked buffer
through it. Stages 1-2 parameters point at their host copy while parked (their device view would hold no bytes).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from ..placement.parking import ParkingLot, storage_key
from ..state.params import FullParams
from ..state.sharded_state import ShardedState

GROUPS = ("optim_states", "grads", "params")
_GRAD_KINDS = ("grad_shard", "landing")  # a placement's kinds that are gradient buffers (the rest: rule state)

# every sleeping optimizer's Sleep, by its sharded state: the engine's hooks and the checkpoint ask here (the
# gradient hooks test membership themselves: a call per gradient into this module only to find nothing)
ASLEEP: "weakref.WeakKeyDictionary[ShardedState, Sleep]" = weakref.WeakKeyDictionary()


def asleep(state: ShardedState) -> Optional["Sleep"]:
    """The optimizer's :class:`Sleep` while some of its states are parked, else None."""
    return ASLEEP.get(state)


def refuse_if_asleep(state: ShardedState, what: str) -> None:
    """Raise the offload error for ``what`` while some of ``state``'s groups are parked."""
    sleep = ASLEEP.get(state)
    if sleep is not None:
        raise sleep.refusal(what)


def check_include(include, optimizer: str = "zero_ext.ZeroAdamW") -> tuple[str, ...]:
    """``include`` as group names (None: all): strings, or enum members whose ``value`` is one (DeepSpeed's
    ``OffloadStateTypeEnum.optim_states``); anything else raises, naming the parameter (and ``optimizer``, the
    optimizer's name)."""
    if include is None:
        return GROUPS
    items = [include] if isinstance(include, str) else include
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            f"{optimizer}.offload_states: `include` must be None, a group name or a list of them "
            f"({', '.join(map(repr, GROUPS))}), got {type(include).__name__}"
        ) from None
    names = []
    for item in items:
        name = getattr(item, "value", item)
        if not isinstance(name, str):
            raise TypeError(
                f"{optimizer}.offload_states: `include` holds {item!r} ({type(item).__name__}); it takes group "
                f"names: {', '.join(map(repr, GROUPS))}"
            )
        if name not in GROUPS:
            raise ValueError(
                f"{optimizer}.offload_states: `include` names an unknown group {name!r}; the groups are "
                f"{', '.join(map(repr, GROUPS))}"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{optimizer}.offload_states: `include` is empty (None offloads every group)")
    return tuple(names)


def check_flag(what: str, name: str, value, optimizer: str = "zero_ext.ZeroAdamW") -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{optimizer}.{what}: `{name}` must be True or False, got {value!r}")
    return value


class Sleep:
    """One optimizer's parked groups. ``engine``: its engine (the sharded state, bucket runtimes, gradient and parameter
    syncs, the stage)."""

    def __init__(self, engine):
        self.engine = engine
        self.state: ShardedState = engine.state
        self.lot = ParkingLot(self.state.device)
        self.parked: list[str] = []  # the groups offloaded, in the order they were
        self._grads: Optional[list[tuple[torch.Tensor, Optional[torch.Tensor]]]] = None  # .grad set aside
        self._hook = None  # stages 1-2 with module=: the forward refused while the parameters are parked

    # ---------------------------------------------------------------- what the optimizer owns, where
    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the optimizer keeps on the device now (not offload=cpu/nvme's host and disk ones), by group."""
        out: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
        for group in self.state.groups:
            out["params"] += list(group.flat_params.tensors().values())
            where = group.state.where()
            for kind, t in group.state.tensors().items():
                if where.get(kind, "device") != "device":
                    continue
                target = out["grads"] if kind in _GRAD_KINDS else out["optim_states"]
                target += [t] if isinstance(t, torch.Tensor) else list(t)
            if group.grad_buffer is not None:
                out["grads"].append(group.grad_buffer)
        out["grads"] += self.engine.runtimes.staging.tensors()
        return out

    def where(self) -> dict[str, str]:
        """Each group's medium now: ``"host"`` while parked, ``"device"`` while some byte of it is on the device, else
        where ``offload=`` keeps it: ``"host"`` (``"cpu"``) or ``"disk"`` (``"nvme"``'s files; its window is host
        memory). A group with no byte of its own (stage 3's parameters cast from the master) is ``"device"``."""
        on_device = self.tensors()
        media = {g: set() for g in GROUPS}
        for group in self.state.groups:
            for kind, medium in group.state.where().items():
                if medium != "device":
                    name = "grads" if kind in _GRAD_KINDS else "optim_states"
                    if kind not in ("param_out", "window", "landing_host"):  # offload's host buffers, not states
                        media[name].add(medium)
        out = {}
        for g in GROUPS:
            if any(self.lot.is_parked(t) for t in on_device[g]):
                out[g] = "host"
            elif any(_nbytes(t) for t in on_device[g]):
                out[g] = "device"
            elif "disk" in media[g]:
                out[g] = "disk"
            elif media[g]:
                out[g] = "host"
            else:
                out[g] = "device"
        return out

    def device_bytes(self) -> dict[str, int]:
        """Bytes each group holds on the device now (its live storages, each counted once)."""
        seen: set[int] = set()
        out = {}
        for g, ts in self.tensors().items():
            total = 0
            for t in ts:
                key = storage_key(t)
                if key not in seen:
                    seen.add(key)
                    total += _nbytes(t)
            out[g] = total
        return out

    # ---------------------------------------------------------------- the two calls
    def offload(self, groups: Iterable[str], pin_memory: bool, non_blocking: bool) -> int:
        """Park ``groups`` (those parked already stay). Returns the bytes freed on the device."""
        engine = self.engine
        new = [g for g in groups if g not in self.parked]
        if not new:
            return 0
        if not self.parked:  # the first group: nothing in flight, nothing owed, then .grad set aside
            busy = engine.stage.busy(engine.runtimes)
            if busy is not None:
                raise RuntimeError(f"{self.state.optimizer_name}.offload_states: {busy}")
            engine.param_sync.settle()
            # Local waits only: the reductions every rank launched in backward. Gradients accumulated under no_sync()
            # and not reduced yet stay so (parked with "grads"; the next step reduces them): finish_grad_sync()
            # would launch that reduction here, a collective.
            engine.grad_sync.wait_inflight()
            if self.state.param_edits is not None:  # the shards follow parameters changed in place (stages 1, 2)
                self.state.param_edits.adopt(checked=False)
            self._set_grads_aside()
        owned = self.tensors()
        self.lot.forget_except({storage_key(t) for ts in owned.values() for t in ts})
        freed = self.lot.park([t for g in new for t in owned[g]], pin_memory, non_blocking)
        self.parked += new
        ASLEEP[self.state] = self
        if "params" in new:
            self._point_params(at_host=True)
        if self.lot.cuda and not non_blocking:
            # The blocks just freed go back to the driver, so that another process (the inference engine) can
            # allocate them: memory_reserved() drops. (Non-blocking: the copies may still read them; the next
            # blocking call, or torch.cuda.empty_cache() after a synchronize, releases them.)
            torch.cuda.empty_cache()
        return freed

    def reload(self, non_blocking: bool) -> int:
        """Every parked group back on the device. Returns the bytes brought back."""
        if not self.parked:
            return 0
        brought = self.lot.unpark(non_blocking)
        if "params" in self.parked:
            self._point_params(at_host=False)
        self._give_grads_back()
        self.parked = []
        ASLEEP.pop(self.state, None)
        return brought

    # ---------------------------------------------------------------- refusals
    def refusal(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"{self.state.optimizer_name}: {what} while the optimizer's states are offloaded (offload_states(): "
            f"{', '.join(self.parked)} in host memory); call opt.reload_states() first. Nothing was changed"
        )

    def refuse_step(self, what: str, is_step: bool) -> None:
        """``step()`` / ``clip_grad_norm_()`` while parked: the other ranks learn it in the step's agreement (one
        collective, the flags of :meth:`zero_ext.engine.step.Stepper.agree`, this rank's marked failed) and raise
        too; then this rank raises. A ``step()`` counts as one for the divergence check, as on the other ranks."""
        state = self.state
        position = state.comm.position
        try:
            if state.comm.communicates:
                position.at("step")
                flags = torch.zeros(2 + len(state.step_counts.indices), dtype=torch.float32)
                flags[0] = 1.0
                state.comm.reduce_step_stats(flags, torch.zeros(2, dtype=torch.float32, device=state.update_device))
        finally:
            if is_step:  # (Stepper.step counts every call, failed or not)
                position.step += 1
                position.at("after step")
        raise self.refusal(what)

    def blocks_forward(self) -> bool:
        """Whether a forward would read a parked byte: stages 1-2, the parameters; stage 3, a gather's source (the
        kept shard, or the master it rounds)."""
        if "params" in self.parked:
            return True
        return "optim_states" in self.parked and any(
            group.flat_params.shards_params and group.flat_params.tensors() == {} for group in self.state.groups
        )

    # ---------------------------------------------------------------- what moves with the bytes
    def _set_grads_aside(self) -> None:
        """``.grad`` of every trainable parameter set aside (None while parked): stage 1's is a view of the flat
        gradient buffer, stages 2-3's a placeholder reading the grad shard."""
        self._grads = []
        with torch._C.DisableTorchFunctionSubclass():
            for _, _, p in self.state.members():
                self._grads.append((p, p.grad))
                p.grad = None

    def _give_grads_back(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for p, grad in self._grads or ():
                p.grad = grad
        self._grads = None

    def _point_params(self, at_host: bool) -> None:
        """Stages 1-2: every ``param.data`` a view of its host copy (while parked: its device view holds no bytes) or
        of the flat buffer again."""
        for group in self.state.groups:
            params = group.flat_params
            if not isinstance(params, FullParams):
                continue
            # (no view of a parked buffer can be made: its storage holds no bytes; its host copy's can)
            host = self.lot.host_view(params.buffer, wait=False) if at_host else None
            for i, p in enumerate(group.params):
                p.data = (
                    group.layout.slots[i].param_range.of(host).view(p.shape) if at_host else params.view(i, p.shape)
                )
        model = self.state.model
        if at_host and model is not None and self._hook is None and not self.engine.stage.shards_params:
            self._hook = model.module.register_forward_pre_hook(_ForwardRefusal(self))
        elif not at_host and self._hook is not None:
            self._hook.remove()
            self._hook = None


class _ForwardRefusal:
    """A forward pre-hook refusing the model's forward while its (stage 1-2) parameters are parked."""

    def __init__(self, sleep: Sleep):
        self.sleep = weakref.ref(sleep)

    def __call__(self, module, args):
        sleep = self.sleep()
        if sleep is not None and sleep.parked:
            raise sleep.refusal("the model's forward")


def _nbytes(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().nbytes()
