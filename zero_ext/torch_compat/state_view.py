"""``opt.state``: torch.optim's per-parameter state, read from the sharded state, as a read-only mapping.

``opt.state[p]`` is this rank's piece of parameter ``p``'s state, under the names of the local state dict
(:mod:`zero_ext.checkpoint.local_state_dict`, whose entries it equals): ``"step"`` (the parameter's own count, a
0-d fp32 tensor as torch.optim.AdamW keeps it), every kind of its update rule (AdamW: ``"exp_avg"``,
``"exp_avg_sq"``, with amsgrad ``"max_exp_avg_sq"``; bf16/fp16 parameters also ``"master"``, the fp32 master copy),
each a 1-D fp32 tensor, and the elements of the flattened (row-major) parameter the piece covers:
``"shard_range"`` = (start, end), or ``"shard_ranges"``, a list of them, when this rank holds runs that are not
adjacent (a parameter split across buckets); the tensors hold those runs one after the other. ``piece.param_ranges``
is that list in every case.

A parameter is in ``opt.state`` as in torch: once it has been updated (its own step count above 0; never for a
parameter of which this rank holds no element). For any other key ``opt.state[key]`` is an empty read-only mapping
(torch's defaultdict gives ``{}``) and ``key in opt.state`` stays False, so ``len``, iteration and ``in`` agree; the
keys come in param-group order.

Nothing is copied until read: each read of a kind decodes this rank's piece of it into a new fp32 tensor (a copy
for fp32 moments, bf16 widened, int8 dequantized block by block, read from host memory or the ``offload="nvme"``
files), finishing the communication in flight first (``opt.finish_sync()``); membership reads the step counts (one
small device-to-host copy). The tensors are snapshots: changing them changes nothing in the optimizer. Writing
(``opt.state[p][k] = v``, ``opt.state[p] = {}``, ``del``, ``opt.state = ...``) raises: the state is changed by
loading it (``opt.load_state_dict``, ``zero_ext.checkpoint.load``) and moved by ``offload=``.

Keys that are not tensors are the user's, as torch.optim keeps them (its own tests write ``opt.state["test"] = 1``
in a state-dict hook): ``opt.state[key] = value`` keeps them on this rank, after the parameters' entries in
iteration; ``del``, ``pop``, ``setdefault`` and ``update`` work on them. ``state_dict()`` puts them in its
``"state"`` under their own keys, and ``load_state_dict()`` replaces them with the dict's keys that are no saved
parameter's id (torch's rule: "state that is not assigned to params is copied as is"), once the load succeeded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ..checkpoint.local_state_dict import owned_runs, ranges_record, read_piece

_READ_ONLY = (
    "zero_ext.ZeroAdamW.state is a read-only view of this rank's shard of the optimizer state (its tensors are "
    "copies); it cannot be {what}. Change the state by loading it, on every rank: opt.load_state_dict(sd) (a dict "
    "from opt.state_dict(), edited) or zero_ext.checkpoint.load(path, opt); to keep it in host memory or on disk "
    "build the optimizer with offload='cpu' or 'nvme'"
)


def _refuse(what: str):
    def refuse(self, *args, **kwargs):
        raise TypeError(_READ_ONLY.format(what=what))

    return refuse


class _ReadOnly(Mapping):
    """The mutating methods of a dict, each raising the same clear error."""

    __setitem__ = _refuse("assigned to")
    __delitem__ = _refuse("deleted from")
    clear = _refuse("cleared")
    pop = _refuse("popped from")
    popitem = _refuse("popped from")
    setdefault = _refuse("assigned to (setdefault)")
    update = _refuse("updated")


class _Empty(_ReadOnly):
    """``opt.state[key]`` for a key this rank holds no state of."""

    param_ranges: list = []

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __repr__(self):
        return "{}"


EMPTY = _Empty()


class ParamState(_ReadOnly):
    """This rank's piece of one parameter's state; each kind is read (decoded) when asked for."""

    def __init__(self, view: "ShardState", gidx: int, ref, runs):
        self._view, self._gidx, self._ref, self._runs = view, gidx, ref, runs
        self._ranges = ranges_record(runs)
        self._kinds = ref.group.rule.state_dict_names()

    @property
    def param_ranges(self) -> list[tuple[int, int]]:
        """The (start, end) element ranges of the flattened parameter this piece holds, in order."""
        return [tuple(r) for r, _ in self._runs]

    def __iter__(self) -> Iterator[str]:
        return iter(("step", *self._ranges, *self._kinds))

    def __len__(self) -> int:
        return 1 + len(self._ranges) + len(self._kinds)

    def __getitem__(self, key: str) -> Any:
        if key in self._ranges:
            return self._ranges[key]
        if key == "step":
            return torch.tensor(self._view.step_of(self._gidx), dtype=torch.float32)
        if key in self._kinds:
            self._view.settle()
            return read_piece(self._ref, self._runs, key)
        raise KeyError(key)

    def __repr__(self) -> str:
        return f"<this rank's piece of {self._ref.name!r}: {list(self)}, elements {self.param_ranges}>"


_TENSOR_KEY = (
    "zero_ext.ZeroAdamW.state: a tensor key is a parameter's entry, a read-only view of this rank's shard of its "
    "state; it cannot be {what}. Change the state by loading it, on every rank: opt.load_state_dict(sd) (a dict "
    "from opt.state_dict(), edited) or zero_ext.checkpoint.load(path, opt). Keys that are not tensors (strings, "
    "numbers) are yours to set"
)


def _user_key(key, what: str):
    """``key`` if it is one of the user's (not a tensor), else the clear error."""
    if isinstance(key, torch.Tensor):
        raise TypeError(_TENSOR_KEY.format(what=what))
    return key


class ShardState(_ReadOnly):
    """``opt.state`` (see the module docstring). ``optimizer``: anything with ``sharded_state``, ``param_groups``
    and ``finish_sync()``."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self._user: dict[Any, Any] = {}  # keys that are not tensors: the user's, this rank's, kept as given
        self._built_for = None  # the sharded state the index below was made from (add_param_group makes another)
        self._index: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) -> (param, global index), held ones
        self._runs: dict[int, tuple[Any, list]] = {}

    def settle(self) -> None:
        self._optimizer.finish_sync()

    def _held(self) -> dict[int, tuple[torch.Tensor, int]]:
        state = self._optimizer.sharded_state
        if state is not self._built_for:
            self._runs = owned_runs(state)
            params = {gidx: p for _, gidx, p in state.members()}
            self._index = {id(params[gidx]): (params[gidx], gidx) for gidx in sorted(self._runs)}
            self._built_for = state
        return self._index

    def step_of(self, gidx: int) -> float:
        return self._optimizer.sharded_state.step_counts.values([gidx])[gidx]

    def _updated(self) -> list[tuple[torch.Tensor, int]]:
        held = self._held()
        if not held:
            return []
        steps = self._optimizer.sharded_state.step_counts.values([g for _, g in held.values()])
        return [(p, gidx) for p, gidx in held.values() if steps[gidx] > 0]

    def _lookup(self, key) -> int | None:
        found = self._held().get(id(key))
        if found is None or found[0] is not key or self.step_of(found[1]) <= 0:
            return None
        return found[1]

    def __contains__(self, key) -> bool:
        if not isinstance(key, torch.Tensor):
            return key in self._user
        return self._lookup(key) is not None

    def __getitem__(self, key) -> Any:
        if not isinstance(key, torch.Tensor):
            return self._user.get(key, EMPTY)
        gidx = self._lookup(key)
        if gidx is None:
            return EMPTY  # torch's defaultdict(dict) gives {} (and we do not insert it)
        ref, runs = self._runs[gidx]
        return ParamState(self, gidx, ref, runs)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[Any]:
        return iter([p for p, _ in self._updated()] + list(self._user))

    def __len__(self) -> int:
        return len(self._updated()) + len(self._user)

    # ---------------------------------------------------------------- the user's keys (not tensors)
    def __setitem__(self, key, value) -> None:
        self._user[_user_key(key, "assigned to")] = value

    def __delitem__(self, key) -> None:
        del self._user[_user_key(key, "deleted from")]

    def pop(self, key, *default):
        return self._user.pop(_user_key(key, "popped from"), *default)

    def setdefault(self, key, default=None):
        return self._user.setdefault(_user_key(key, "assigned to (setdefault)"), default)

    def update(self, other=(), **kwargs) -> None:
        items = dict(other, **kwargs)
        for key in items:
            _user_key(key, "updated")
        self._user.update(items)

    def user_entries(self) -> dict[Any, Any]:
        """The user's keys and values (``state_dict()`` saves them)."""
        return dict(self._user)

    def load_user_entries(self, entries: Mapping) -> None:
        """Replace the user's keys (``load_state_dict()``, once the load succeeded)."""
        self._user = dict(entries)

    def __repr__(self) -> str:
        return f"<zero_ext.ZeroAdamW.state: this rank's pieces of {len(self)} parameter(s), read-only>"


class StateAttribute:
    """The optimizer's ``state`` attribute: a :class:`ShardState` made at first use. torch.optim.Optimizer's
    constructor assigns ``self.state = defaultdict(dict)`` before the sharded state exists: that empty mapping is
    dropped; any later assignment raises."""

    def __init__(self, make: Callable[[Any], ShardState] = ShardState):
        self._make = make

    def __set_name__(self, owner, name):
        self._slot = f"_{name}_view"

    def __get__(self, optimizer, owner=None):
        if optimizer is None:
            return self
        view = optimizer.__dict__.get(self._slot)
        if view is None:
            view = optimizer.__dict__[self._slot] = self._make(optimizer)
        return view

    def __set__(self, optimizer, value):
        if self._slot not in optimizer.__dict__ and isinstance(value, Mapping) and not value:
            try:
                optimizer.sharded_state
            except AttributeError:
                return  # torch.optim.Optimizer.__init__'s empty defaultdict, before the sharded state is built
        raise TypeError(_READ_ONLY.format(what="replaced"))

    def __delete__(self, optimizer):
        raise TypeError(_READ_ONLY.format(what="deleted"))
