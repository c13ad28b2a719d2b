"""How the ranks of a checkpoint call agree: every rank learns whether every rank succeeded before anything is
published or written, and a call that some ranks never make fails on the others after a timeout."""

from __future__ import annotations

from ..comm import CollectiveTimeout, Communicator
from ..state.sharded_state import ShardedState
from .format import CheckpointError


def sharded_state_of(optimizer, what: str) -> ShardedState:
    state = getattr(optimizer, "sharded_state", None)
    if not isinstance(state, ShardedState):
        raise TypeError(f"zero_ext.checkpoint.{what}: `optimizer` must be a zero_ext.ZeroAdamW, got "
                        f"{type(optimizer).__name__}")  # fmt: skip
    return state


DEFAULT_TIMEOUT = 300.0  # seconds, where the optimizer has no collective_timeout (None: never check)


def arrive(comm: Communicator, value: int, timeout: float | None, what: str) -> list[int]:
    """Collective with a deadline: every rank's ``value``, or a CheckpointError when not every rank calls.
    ``timeout`` None: the optimizer's ``collective_timeout`` (a rank-0-only save fails as soon as a rank-0-only
    ``step()`` would), else 300 s."""
    if timeout is None:
        timeout = comm.watch.timeout if comm.watch is not None else DEFAULT_TIMEOUT
    try:
        return comm.agree(value, timeout=timeout)
    except CollectiveTimeout as e:
        raise CheckpointError(
            f"{what}: {e}. zero_ext.checkpoint.save/load are collective: call them on every rank (not only on rank "
            "0), at the same point of the program. The process group cannot be used after this error."
        ) from None


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
    """Collective: every rank learns whether every rank succeeded; failing ranks re-raise their own error."""
    flags = comm.agree(0 if error is None else 1)
    if error is not None:
        raise error
    if any(flags):
        raise CheckpointError(f"{what} failed on rank(s) {[r for r, f in enumerate(flags) if f]} (see their errors)")
