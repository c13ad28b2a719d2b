"""``zero_ext.comm_time``: the public name (docs/hsdp.md, bench/) of the communication-time model, which lives beside
the memory formula as :mod:`zero_ext.memory.comm_time` (the alpha-beta model of a step's collectives) and
:mod:`zero_ext.memory.link_load` (the bytes they put on the links between nodes, by algorithm, and the step time
that predicts). Every public name of both modules is re-exported here, the same objects (tests/package/
test_imports.py checks that none is missing)."""

from .memory.comm_time import FACTOR as FACTOR
from .memory.comm_time import GBIT, GBYTE, Cluster, Collective, Link, StepComm, estimate_step, step_collectives
from .memory.comm_time import mesh_groups as mesh_groups
from .memory.link_load import (
    ALGORITHMS,
    Crossing,
    StepLinkLoad,
    collective_seconds,
    crossing_bytes,
    overlapped_step_seconds,
    predict_step_seconds,
    step_link_load,
)

__all__ = ["Link", "Cluster", "Collective", "StepComm", "step_collectives", "estimate_step", "GBIT", "GBYTE",
           "ALGORITHMS", "Crossing", "StepLinkLoad", "crossing_bytes", "step_link_load", "collective_seconds",
           "predict_step_seconds", "overlapped_step_seconds"]  # fmt: skip
