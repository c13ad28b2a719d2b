"""Model-state memory, and the step's communication beside it: what a configuration costs before it is built, and
what a built one holds.

- :mod:`.formula`: the ZeRO formula per rank (:func:`estimate`, :func:`estimate_breakdown`), the state's bytes per
  element, the mesh's divisors, where ZeroMuon's matrices go (:func:`muon_owner_bytes`);
- :mod:`.ledger`: :func:`report`, every byte a rank's sharded state holds, by kind, set against the formula;
- :mod:`.memory_report`: :class:`MemoryReport` (what ``ZeroAdamW.memory_report()`` returns) and its table;
- :mod:`.comm_time`: the alpha-beta model of a step's collectives (public as ``zero_ext.comm_time``);
- :mod:`.link_load`: the bytes those collectives put on the links between nodes, by algorithm (ring, gloo, NCCL),
  and the step time they predict (also public as ``zero_ext.comm_time``).

The names below are this package's public face (``zero_ext.memory.estimate``, ...), as they were when it was one
module.
"""

# ``X as X``: re-exported attributes of the one module before the split that __all__ never listed
from . import comm_time as comm_time  # also public as zero_ext.comm_time (which re-exports its names)
from . import link_load as link_load  # the same
from .formula import GRAD_SHARD_BYTES as GRAD_SHARD_BYTES
from .formula import (
    INT8_BLOCK,
    MUON_STATE_BYTES,
    estimate,
    estimate_breakdown,
    mesh_divisors,
    moment_bytes,
    muon_owner_bytes,
    state_bytes_per_element,
)
from .ledger import OFFLOAD_BUFFER_KINDS as OFFLOAD_BUFFER_KINDS
from .ledger import report
from .memory_report import Buffer as Buffer
from .memory_report import MemoryReport, human_bytes

__all__ = [
    "estimate", "estimate_breakdown", "state_bytes_per_element", "moment_bytes", "INT8_BLOCK", "MemoryReport",
    "report", "human_bytes", "muon_owner_bytes", "MUON_STATE_BYTES", "mesh_divisors",
]  # fmt: skip
