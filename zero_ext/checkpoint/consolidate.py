"""``consolidate``: a sharded checkpoint to two safetensors files with no process group and no GPU, parameter by
parameter (memory: one parameter at a time); ``adamw_state_dict``: the consolidated file as a
``torch.optim.AdamW`` state dict."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

import numpy as np
import torch

from ..update.protocol import MASTER, UpdateRule
from ..update.registry import rule_for_saved_group
from .format import FORMAT_NAME, FORMAT_VERSION, as_bytes, decode_value, dtype_of
from .reader import Checkpoint
from .side_files import CONFIG, read_model_extra

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SafetensorsWriter:
    """Writes a .safetensors file tensor by tensor: the header (names, dtypes, shapes, offsets) is fixed up front
    from ``entries`` [(name, dtype, shape)], then ``write(name, tensor)`` must follow the same order."""

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict):
        header: dict[str, Any] = {"__metadata__": metadata}
        self._order: list[tuple[str, int]] = []
        pos = 0
        for name, dtype, shape in entries:
            n = int(np.prod(shape, dtype=np.int64)) * torch.tensor([], dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self._order.append((name, n))
            pos += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = path
        self._file = open(path + ".partial", "wb")
        self._file.write(len(blob).to_bytes(8, "little") + blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, n = self._order[self._next]
        if name != expected or tensor.numel() * tensor.element_size() != n:
            raise AssertionError(f"safetensors writer: got {name!r}, expected {expected!r} ({n} bytes)")
        self._file.write(memoryview(as_bytes(tensor.contiguous())))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise AssertionError(f"safetensors writer: {len(self._order) - self._next} tensors never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.path + ".partial", self.path)


def _read_full(ck: Checkpoint, gidx: int, kind: str, out: torch.Tensor) -> None:
    raw = as_bytes(out)
    ck.execute([(r, off, n, raw[at:]) for r, off, n, at in ck.plan(gidx, kind, 0, out.numel())])


def _rule_of(ck: Checkpoint, e: dict) -> UpdateRule:
    """The update rule parameter ``e`` was saved with (its param group's recorded rule name and hyperparameters)."""
    return rule_for_saved_group(ck.meta["param_groups"][e["group"]])


def _consolidated_name(kind: str) -> str:
    return "param" if kind == MASTER else kind  # the master is the full-precision parameter


def _model_entries(ck: Checkpoint, extras: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(state_dict key, tensor name) for model.safetensors: every key of the model when it was saved with
    ``module=`` (tied weights under each of their names), else every parameter by its name."""
    record = ck.meta.get("model")
    if record is None:
        return [(ck.params[i]["name"], ck.params[i]["name"]) for i in sorted(ck.params)]
    return list(record["aliases"].items())


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write ``out/optimizer.safetensors`` (full fp32 state per parameter name) and ``out/model.safetensors``
    (weights in the param dtype; with ``module=`` every key of the model's state_dict, buffers and frozen and tied
    parameters included, so ``model.load_state_dict(..., strict=True)`` and, with the copied ``config.json``,
    transformers' ``from_pretrained(out)`` load it), one parameter at a time; verifies every block of every
    shard."""
    ck = Checkpoint(path)
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    entries = [ck.params[i] for i in sorted(ck.params)]
    by_name = {e["name"]: e for e in entries}
    extras = read_model_extra(ck.path, ck.crcs) or {}
    step = ck.meta["step"]
    info = {"format": FORMAT_NAME + ".consolidated", "version": str(FORMAT_VERSION), "step": repr(step),
            "param_groups": json.dumps(ck.meta["param_groups"]), "params": json.dumps(entries)}  # fmt: skip
    state_entries = []
    for e in entries:
        shape = tuple(e["shape"])
        state_entries += [
            (f"{_consolidated_name(k.name)}/{e['name']}", k.dtype, shape) for k in _rule_of(ck, e).saved_kinds
        ]
        state_entries.append((f"step/{e['name']}", torch.float32, ()))
    model_keys = _model_entries(ck, extras)
    model_entries = []
    for key, name in model_keys:
        if name in by_name:
            model_entries.append((key, dtype_of(by_name[name]["dtype"], ck.path), tuple(by_name[name]["shape"])))
        else:
            model_entries.append((key, extras[name].dtype, tuple(extras[name].shape)))
    state = SafetensorsWriter(os.path.join(out, "optimizer.safetensors"), state_entries, info)
    model = SafetensorsWriter(os.path.join(out, "model.safetensors"), model_entries, {"format": "pt"})
    try:
        for e in entries:
            numel, name = int(np.prod(e["shape"], dtype=np.int64)), e["name"]
            for kind in _rule_of(ck, e).saved_kinds:  # one kind of one parameter in memory at a time
                buf = torch.empty(numel, dtype=kind.dtype)
                _read_full(ck, e["index"], kind.name, buf)
                state.write(f"{_consolidated_name(kind.name)}/{name}", buf)
                del buf
            state.write(f"step/{name}", torch.tensor(ck.param_step(e), dtype=torch.float32))
        for key, name in model_keys:  # one tensor at a time, in the model's key order
            model.write(key, extras[name] if name in extras else _weights(ck, by_name[name]))
        state.close()
        model.close()
    finally:
        ck.close()
    if CONFIG in ck.crcs:
        shutil.copyfile(os.path.join(ck.path, CONFIG), os.path.join(out, CONFIG))


def _weights(ck: Checkpoint, e: dict) -> torch.Tensor:
    """A parameter's weights in its own dtype (fp32 parameters are their own master)."""
    numel, dtype = int(np.prod(e["shape"], dtype=np.int64)), dtype_of(e["dtype"], ck.path)
    out = torch.empty(numel, dtype=dtype)
    _read_full(ck, e["index"], MASTER if dtype == torch.float32 else "param", out)
    return out


def adamw_state_dict(out: str | os.PathLike) -> dict[str, Any]:
    """A consolidated ``out`` as a ``torch.optim.AdamW`` state dict (for a model whose param groups list the same
    parameters in the same order)."""
    from safetensors import safe_open

    with safe_open(os.path.join(os.fspath(out), "optimizer.safetensors"), framework="pt") as f:
        meta = f.metadata()
        saved_groups = json.loads(meta["param_groups"])
        state = {}
        for e in json.loads(meta["params"]):
            n = e["name"]
            rule = rule_for_saved_group(saved_groups[e["group"]])
            state[e["index"]] = {"step": f.get_tensor(f"step/{n}")}
            state[e["index"]].update({k: f.get_tensor(f"{k}/{n}") for k in rule.moment_names})
    groups, base = [], 0
    for g in saved_groups:
        hyper = {
            k: decode_value(v)
            for k, v in g["hyperparameters"].items()
            if not (isinstance(v, dict) and "unrestorable" in v)
        }
        groups.append({**hyper, "params": list(range(base, base + g["num_params"]))})
        base += g["num_params"]
    return {"state": state, "param_groups": groups}


def torch_state_dicts(out: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """A consolidated ``out`` as one torch.optim state dict per update rule, keyed by the rule's name (ZeroMuon:
    ``"muon"`` for ``torch.optim.Muon``, ``"adamw"`` for ``torch.optim.AdamW``): each holds that rule's param groups,
    in order, with their parameters numbered from 0 in that order, and per parameter the rule's kinds (plus
    ``step`` where the rule counts steps: AdamW's bias correction; torch's Muon keeps none). Build each torch
    optimizer over the same parameters in the same group order, then ``load_state_dict``."""
    from safetensors import safe_open

    with safe_open(os.path.join(os.fspath(out), "optimizer.safetensors"), framework="pt") as f:
        meta = f.metadata()
        saved_groups = json.loads(meta["param_groups"])
        entries = json.loads(meta["params"])
        by_group: dict[int, list[dict]] = {}
        for e in sorted(entries, key=lambda e: e["index"]):
            by_group.setdefault(e["group"], []).append(e)
        dicts: dict[str, dict[str, Any]] = {}
        for gi, g in enumerate(saved_groups):
            rule = rule_for_saved_group(g)
            sd = dicts.setdefault(rule.name, {"state": {}, "param_groups": []})
            base = sum(len(x["params"]) for x in sd["param_groups"])
            hyper = {
                k: decode_value(v)
                for k, v in g["hyperparameters"].items()
                if not (isinstance(v, dict) and "unrestorable" in v)
            }
            members = by_group.get(gi, [])
            for offset, e in enumerate(members):
                n = e["name"]
                entry = {"step": f.get_tensor(f"step/{n}")} if rule.counts_steps else {}
                entry.update({k: f.get_tensor(f"{k}/{n}") for k in rule.moment_names})
                sd["state"][base + offset] = entry
            sd["param_groups"].append({**hyper, "params": list(range(base, base + len(members)))})
    return dicts
