"""How long this thread's current ring call has been held back (rate limiter, full queue, nothing to pop).

``_ring.waiting.until_ready`` marks when a call was first answered ``WAIT`` (:func:`holding`), and the call's
next tries carry the milliseconds since (:func:`held_ms`) in their stats op ('A', ``lua/_lib.lua``
``tds_stat``), so that the try that goes through counts the time its call was held in the same round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


@contextmanager
def holding() -> Iterator[None]:
    """Within: the calls of this thread count as held since now (the outer mark wins when nested)."""
    outer = getattr(_state, "since", None)
    if outer is None:
        _state.since = time.monotonic()
    try:
        yield
    finally:
        if outer is None:
            _state.since = None


def held_ms() -> int:
    """Milliseconds since this thread's current call was first held back; 0 when it was not."""
    since = getattr(_state, "since", None)
    return 0 if since is None else int((time.monotonic() - since) * 1000)
