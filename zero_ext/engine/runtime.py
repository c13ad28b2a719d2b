"""The engine's in-flight state around one :class:`~zero_ext.state.sharded_state.ShardedState`: every bucket's
runtime and the gradient staging pool.

The sharded state is data (layouts, flat buffers, placements, counters) and issues no collective; what travels and
when is the engine's: each :class:`BucketRuntime` owns both directions of its bucket's communication (the gradient
reduce-scatter and the parameter all-gather, each a start / finish pair), and the staging pool lends the buffers a
reduce-scatter in flight needs. Made once per engine and extended in place by ``add_param_group`` (when nothing
is in flight), shared by the reducer, the parameter gathers and stage 3's scheduler.
"""

from __future__ import annotations

from typing import Iterator

from ..state.sharded_state import ShardedState
from .bucket_runtime import BucketRuntime, Key, StagingPool
from .grads import GradStrategy


class BucketRuntimes:
    """``buckets``: every bucket's runtime by (flat group, bucket) key, ``order`` its launch order; ``staging``: the
    gradient staging pool of at most ``staging_buffers`` entries (sized by the reducer, which knows how buckets
    travel)."""

    def __init__(self, state: ShardedState, staging_buffers: int, policy: GradStrategy):
        """``policy``: the stage's gradient policy, which says once how each bucket's gradients travel."""
        self.staging_buffers, self._policy = staging_buffers, policy
        self.buckets: dict[Key, BucketRuntime] = {
            (g.index, b.index): BucketRuntime(g, b, order, policy.travel(g))
            for order, (g, b) in enumerate(state.launch_order())
        }
        self.staging = StagingPool(min(staging_buffers, len(self.buckets)), state.device)

    def extend(self, state: ShardedState) -> None:
        """A runtime for each bucket of the flat groups ``state`` gained (``add_param_group``), and every bucket's
        place in the launch order again (the added ones take theirs in the model's order; the others keep their order
        among themselves). The runtimes already here are the same objects, with what they hold; the staging pool may
        hold more entries (the reducer sizes them)."""
        for order, (g, b) in enumerate(state.launch_order()):
            runtime = self.buckets.get((g.index, b.index))
            if runtime is None:
                self.buckets[(g.index, b.index)] = BucketRuntime(g, b, order, self._policy.travel(g))
            else:
                runtime.reorder(order)
        self.staging.capacity = min(self.staging_buffers, len(self.buckets))

    def __getitem__(self, key: Key) -> BucketRuntime:
        return self.buckets[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def values(self):
        return self.buckets.values()

    def in_launch_order(self) -> list[BucketRuntime]:
        return sorted(self.buckets.values(), key=lambda b: b.order)
