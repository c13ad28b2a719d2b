"""A collective of two levels (a mesh's, ``hsdp.py``): the second reads what the first wrote, so it is issued when
the first finished. On CUDA both are queued at once, the second on its group's stream behind an event of the first
(no host wait); on CPU (gloo, which cannot queue a dependency) the second is issued when the caller next needs it:
:meth:`TwoLevel.launch`, called by the mesh before its next collective and by :meth:`TwoLevel.wait`.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import DONE, Pending


class TwoLevel(Pending):
    """A collective of two levels: ``first`` in flight, ``then()`` starts the second (its Pending)."""

    __slots__ = ("_first", "_then", "_second", "_cuda_stream")

    def __init__(self, first: Pending, then: Callable[[], Pending], second_stream=None):
        super().__init__()
        self._done = False
        self._first, self._then, self._second = first, then, None
        if second_stream is not None:  # CUDA: queue the second level now, behind the first's event
            first.wait_on(second_stream)
            self._second = then()

    @property
    def launched(self) -> bool:
        return self._second is not None

    def launch(self) -> None:
        """CPU: wait for the first level (its epilogue runs) and start the second."""
        if not self._done and self._second is None:
            self._first.wait()
            self._second = self._then()

    def wait(self) -> None:
        if self._done:
            return
        self.launch()
        self._first.wait()  # CUDA: the current stream waits for both (also what keeps the first's tensors alive)
        self._second.wait()
        self._done = True
        self._first = self._second = self._then = None

    def wait_on(self, stream) -> None:
        self.launch()
        self._second.wait_on(stream)


def local_work(stream, fn: Callable[[], None], tensors) -> Pending:
    """Run ``fn`` (local tensor work) after what ``stream`` queued: on CPU now, on CUDA queued on ``stream``."""
    if stream is None:
        fn()
        return DONE
    with torch.cuda.stream(stream):
        fn()
        event = torch.cuda.Event()
        event.record(stream)
    return Pending(None, event, stream.device, None, tensors)


__all__ = ["TwoLevel", "local_work"]
