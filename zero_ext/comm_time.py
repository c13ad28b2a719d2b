"""``zero_ext.comm_time``: the public name (docs/hsdp.md, bench/) of the communication-time model, which lives beside
the memory formula as :mod:`zero_ext.memory.comm_time`. Every public name of that module is re-exported here, the
same objects (tests/package/test_imports.py checks that none is missing)."""

from .memory.comm_time import FACTOR as FACTOR
from .memory.comm_time import GBIT, GBYTE, Cluster, Collective, Link, StepComm, estimate_step, step_collectives
from .memory.comm_time import mesh_groups as mesh_groups

__all__ = ["Link", "Cluster", "Collective", "StepComm", "step_collectives", "estimate_step", "GBIT", "GBYTE"]
