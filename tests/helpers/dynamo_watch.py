"""What dynamo did during a run, from its own counters and logs: graphs compiled, graph breaks, and the
"hit config.recompile_limit" warnings (after which a function runs eagerly for good)."""

from __future__ import annotations

import contextlib
import logging


class RecompileLimit(logging.Handler):
    """Catches dynamo's recompile-limit warning."""

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.hits.append(record.getMessage())


@contextlib.contextmanager
def watching_dynamo():
    """Resets dynamo and its counters; yields a dict filled on exit: ``graphs`` (unique graphs compiled), ``breaks``
    (graph breaks reported) and ``limit_hits`` (recompile-limit warnings)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    catch = RecompileLimit()
    log = logging.getLogger("torch._dynamo.convert_frame")
    log.addHandler(catch)
    seen: dict = {}
    try:
        yield seen
    finally:
        log.removeHandler(catch)
        seen.update(graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()),
                    limit_hits=catch.hits)  # fmt: skip
