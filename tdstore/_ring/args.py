"""The one-slot rule of ring calls: a spread store has no ring.

The checks of the arguments ring calls share (batch sizes, generations, request ids) are plans, in
``_plan.ring_plan``; they are named here too for the callers that import them from here (``_shards``).
Slot indices mean what they mean to indexing: ``_plan.index.positions``.
"""

from __future__ import annotations

from tdstore._engine.engine import Engine
from tdstore._plan.ring_plan import MAX_BATCH, check_batch_size, check_request_id, generations_arg

__all__ = ["refuse_spread", "MAX_BATCH", "check_batch_size", "check_request_id", "generations_arg"]


def refuse_spread(engine: Engine) -> None:
    """Ring calls reserve slots and pick rows on the server, over every segment at once: one slot only."""
    if engine.header.spread:
        raise NotImplementedError(
            f"the store with {engine.where()} is spread over several cluster nodes (spread='segments'); the ring buffer "
            "(extend, sample, update_if) needs every segment in one slot: create the store without spread=, or as a "
            "sharded ring (tdstore.ShardedRing(count=N, url=...))"
        )
