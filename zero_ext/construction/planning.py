"""From torch param groups to flat groups: validation, naming, the default bucket size, and the agreement of every
rank on the plan before anything is allocated or any parameter re-pointed (a failed construction leaves the model
untouched, and fails on every rank together instead of leaving some waiting in a collective)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..comm import Communicator
from ..layout import fingerprint

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Plan:
    """What every rank must agree on before building its flat groups."""

    names: dict[int, str] = field(default_factory=dict)  # global index -> name, every parameter
    device: Optional[torch.device] = None
    # (param group index, [(global index, parameter)]) per flat group, in build order
    groups: list[tuple[int, list[tuple[int, torch.nn.Parameter]]]] = field(default_factory=list)
    error: Optional[str] = None


def plan_groups(param_groups: Sequence[dict]) -> Plan:
    """Name every parameter, check devices, dtypes and duplicates, and split each param group by dtype. A local
    error is recorded in ``plan.error`` (not raised), so that every rank reaches the agreement."""
    plan = Plan()
    seen: dict[int, str] = {}
    devices: set = set()
    index = 0
    for gi, group in enumerate(param_groups):
        names = group.get("param_names")
        group_devices = set()
        for i, p in enumerate(group["params"]):
            name = names[i] if names else f"param_groups[{gi}].params[{i}]"
            plan.names[index] = name
            index += 1
            if plan.error:
                continue
            if id(p) in seen:
                plan.error = f"parameter {name!r} is listed twice (also as {seen[id(p)]!r})"
            elif p.requires_grad and p.dtype not in SUPPORTED_DTYPES:
                plan.error = f"parameter {name!r} has dtype {p.dtype}; expected float32, bfloat16 or float16"
            elif p.requires_grad and p.is_sparse:
                plan.error = f"parameter {name!r} is sparse; only dense parameters are supported"
            elif p.requires_grad:
                group_devices.add(p.device)
            seen[id(p)] = name
        if not plan.error and len(group_devices) > 1:
            plan.error = f"param group {gi} has parameters on different devices {sorted(map(str, group_devices))}"
        devices |= group_devices
    if not plan.error and len(devices) > 1:
        plan.error = f"parameters are on different devices {sorted(map(str, devices))}; all must be on one device"
    if plan.error:
        return plan
    # with no trainable parameter (torch builds such an optimizer, and its step() is a no-op) there is no flat
    # group: the device is the first parameter's, for the communicator and the step's scalars
    everything = [p for group in param_groups for p in group["params"]]
    plan.device = devices.pop() if devices else everything[0].device if everything else None
    base = 0
    for gi, group in enumerate(param_groups):
        for dtype in SUPPORTED_DTYPES:
            members = [(base + i, p) for i, p in enumerate(group["params"]) if p.requires_grad and p.dtype == dtype]
            if members:
                plan.groups.append((gi, members))
        base += len(group["params"])
    return plan


def name_by_model(plan: Plan, model) -> None:
    """Name every parameter after the model (its state_dict key); an optimized parameter not in the model is an
    error."""
    error = model.check_params((plan.names[i], p) for _, members in plan.groups for i, p in members)
    if error:
        raise ValueError(error)
    by_id = {id(p): i for _, members in plan.groups for i, p in members}
    for p_id, index in by_id.items():
        keys = model.keys_of.get(p_id)
        if keys:
            plan.names[index] = keys[0]


def default_bucket_size(trainable: int, comm: Communicator) -> int:
    """``comm.buckets_per_model`` buckets per model, so that backward hides all but the last reduction, clamped to
    [N * 2**14, max(2**22, N * 2**18)] elements.

    The upper bound keeps large models' collectives at 16 MiB (fp32) and at least 1 MiB per rank, and bounds the
    staging pool (two buckets in flight) by a size that depends on N and the dtypes, never on the model. The lower
    bound keeps every rank's slice of a bucket at >= 16K elements; it is low enough that a small model's staging
    pool stays a small fraction of its state (at N * 2**16 a 1M-parameter model at N = 8 had more staging than
    stage 2 saves on gradients, so stage 2 used more memory than stage 1)."""
    world = comm.world_size
    return min(max(2**22, world * 2**18), max(world * 2**14, -(-trainable // comm.buckets_per_model)))


def agree_on_plan(comm: Communicator, plan: Plan, settings: str, where: str = "zero_ext.ZeroAdamW") -> None:
    """Collective: every rank learns whether every rank's plan is valid, then compares plans and settings; raises
    on every rank if any rank failed or differs."""
    failed = [r for r, f in enumerate(comm.agree(int(plan.error is not None))) if f]
    if plan.error is not None:
        raise ValueError(f"{where}: {plan.error}")
    if failed:
        raise ValueError(f"{where}: construction failed on rank(s) {failed} (see their errors)")
    descriptions = [settings]
    for gi, members in plan.groups:
        descriptions.append(f"group={gi} dtype={members[0][1].dtype} shapes={[tuple(p.shape) for _, p in members]}")
    everyone = comm.agree(fingerprint(descriptions))
    if len(set(everyone)) != 1:
        differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
        raise RuntimeError(
            f"{where}: the model or optimizer settings differ between ranks (layout fingerprints "
            f"{everyone}; ranks {differ} differ from rank 0). Every rank must build the same model with the same "
            "param groups, dtypes, stage, bucket_size and reduce_dtype."
        )
