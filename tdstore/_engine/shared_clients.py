"""The clients of this process, shared by the stores opened with the same settings.

Opening a client costs a store three round trips (connect, ``HELLO``, then its first command on
the new connection) and about half a millisecond of redis-py's work: a tenth of a torchrl buffer's
first fill. Stores opened with the same settings in one process share one client and its
connection pool instead, so a new store takes a connection another store gave back. Each store
still holds a connection of its own while it lives (``_engine.transport``), and ``close()`` gives
it back to the pool. The table is weak: a client goes, and its connections close, with the last
store that uses it. The password is part of the key (in memory only), so a rotated password
opens a new client. Cluster clients are not shared (a sharded ring opens its own).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import redis

_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], redis.Redis] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def shared_client(settings: tuple[Any, ...], connect: Callable[[], redis.Redis]) -> redis.Redis:
    """The client of this process opened with ``settings`` (everything that tells one client from another:
    where, how, the password and the other secrets), made by ``connect()`` when there is none.
    ``_engine.connection`` says what the settings are; this table only keeps the clients."""
    try:
        hash(settings)
    except TypeError:  # a setting that cannot be compared (a list...): a client of its own
        return connect()
    with _LOCK:
        client = _SHARED.get(settings)
        if client is None:
            client = _SHARED[settings] = connect()
        return client
