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
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    from tdstore._engine.connection import ConnectionSpec

_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], redis.Redis] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def shared_client(spec: ConnectionSpec, password: str | None, secrets: dict[str, Any]) -> redis.Redis:
    """The client of this process for ``spec`` logging in with ``password`` (None: none) and these
    secrets; made when there is none."""
    key = (spec.describe(), spec.ssl, tuple(sorted(spec.kwargs.items())), password, tuple(sorted(secrets.items())))
    try:
        hash(key)
    except TypeError:  # a setting that cannot be compared (a list...): a client of its own
        return spec.connect(password, secrets)
    with _LOCK:
        client = _SHARED.get(key)
        if client is None:
            client = _SHARED[key] = spec.connect(password, secrets)
        return client
