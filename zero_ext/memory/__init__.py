"""Model-state memory, and the step's communication beside it: the ZeRO formula and the per-rank ledger
(:mod:`.formula`), the alpha-beta model of a step's collectives (:mod:`.comm_time`, public as ``zero_ext.comm_time``).

The names below are this package's public face (``zero_ext.memory.estimate``, ...), as they were when it was one
module.
"""

# ``X as X``: re-exported attributes of the one module before the split that __all__ never listed
from . import comm_time as comm_time  # zero_ext.comm_time is this same module
from .formula import GRAD_SHARD_BYTES as GRAD_SHARD_BYTES
from .formula import (
    INT8_BLOCK,
    MUON_STATE_BYTES,
    MemoryReport,
    estimate,
    estimate_breakdown,
    human_bytes,
    mesh_divisors,
    moment_bytes,
    muon_owner_bytes,
    report,
    state_bytes_per_element,
)
from .formula import OFFLOAD_BUFFER_KINDS as OFFLOAD_BUFFER_KINDS
from .formula import Buffer as Buffer

__all__ = [
    "estimate", "estimate_breakdown", "state_bytes_per_element", "moment_bytes", "INT8_BLOCK", "MemoryReport",
    "report", "human_bytes", "muon_owner_bytes", "MUON_STATE_BYTES", "mesh_divisors",
]  # fmt: skip
