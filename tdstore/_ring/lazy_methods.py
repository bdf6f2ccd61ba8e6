"""The ring of a lazy store: ``LazyStackedTensorDictStore``'s ring calls (``tdstore.Ring``).

The calls themselves are ``_ring.ring_calls.RingCalls``'s, written once for every kind; a lazy store's
ring is the one of its own engine (``_ring.one_node.OneNodeRing``), whose batches are handed back as read
(a lazy stack when keys are heterogeneous).
"""

from __future__ import annotations

from tdstore._front.common import LOCK_ERROR
from tdstore._front.state import LazyState
from tdstore._ring.one_node import OneNodeRing
from tdstore._ring.ring_calls import RingCalls


class LazyRing(RingCalls, LazyState):
    """The shared ring buffer, and server-side priorities, rate limiting and queues, shared by every handle on the store."""

    def _ring_work(self, *, write: bool = False) -> OneNodeRing:
        engine = self._engine
        if write and self.is_locked and not engine.header.leaves:
            raise RuntimeError(LOCK_ERROR)  # a locked store refuses the first ring write only (it creates keys)
        return OneNodeRing(engine, self._count, self._inner_batch_size, self._device, self)
