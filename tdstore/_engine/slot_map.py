"""A call on the cluster node that serves a slot, under a call's deadline: a node that cannot be reached
makes the handle ask the cluster where the slot is now and try there, until the deadline.

Without this, a handle whose slot map named a primary that was killed kept sending to it: under a
deadline every try went to the dead node until the deadline passed (``RedisCluster``, which would
refresh its map, is no way out there: no deadline bounds it), so after a failover an old handle's
``sample(timeout=2)`` raised ``TimeoutError`` call after call while a new handle sampled at once.
Here a connection error on the node (``_deadline.rerouting``: at once, not retried there until the
deadline) refreshes the client's slot map (``CLUSTER SLOTS`` of a node that answers, the failed one
last), and the call goes to the node the map names now; while that is still the failed node (its
replica not promoted yet), the tries are paced (10 ms doubling to 250 ms) until the deadline. The
refresh runs on a worker thread, waited for only as long as the deadline leaves (a node that hangs
cannot hold the call past it); it goes on for the next call. Calls without a deadline keep the
client's own behaviour (``RedisCluster`` refreshes its map on errors).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis

from tdstore._engine import deadline

#: Pauses between tries while the slot map still names a node that cannot be reached (seconds).
PAUSE_S = (0.01, 0.25)
#: A refresh of one client's slot map starts at most this often (seconds): several threads whose calls
#: fail on the same node at once share one.
MIN_REFRESH_S = 0.05

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_last: weakref.WeakKeyDictionary[Any, tuple[float, Any]] = weakref.WeakKeyDictionary()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tdstore-slots")
        return _pool


def refresh(cluster: Any, failed: str | None) -> None:
    """Read the cluster's slot map again (``failed``: the node name to ask last), waiting for it at most
    as long as the thread's deadline leaves. A refresh another thread started less than
    :data:`MIN_REFRESH_S` ago is waited for instead of starting one more. A refresh that fails keeps the
    map the client has (the next try fails the same way and asks again)."""
    manager = getattr(cluster, "nodes_manager", None)
    if manager is None:
        return
    now = time.monotonic()
    with _pool_lock:
        last = _last.get(cluster)
        if last is not None and (now - last[0] < MIN_REFRESH_S or not last[1].done()):
            future = last[1]
        else:
            future = None
    if future is None:
        future = _executor().submit(_initialize, manager, failed)
        with _pool_lock:
            _last[cluster] = (now, future)
    dl = deadline.active()
    try:
        future.result(timeout=None if dl is None else dl.left())
    except FutureTimeout:
        return  # the deadline's: the refresh goes on for the next call


def _initialize(manager: Any, failed: str | None) -> None:
    try:
        manager.initialize(last_failed_node_name=failed)
    except Exception:  # no node answered, or none with a whole map: the client keeps the map it has
        pass


def on_slot_node(cluster: Any, key: str, send: Callable[[Any], Any], forget: Callable[[], None]) -> Any:
    """``send(node)`` (a ``ClusterNode``) on the primary the slot map names for ``key``, under the thread's deadline
    (which must be set): a node that cannot be reached refreshes the map and the call goes to the node it
    names then, paced while that is the same one, until the deadline (then the call's ``TimeoutError``).
    ``forget()`` drops what the caller holds of a node that failed. Redirects and server errors are the
    caller's."""
    pause = PAUSE_S[0]
    while True:
        node = cluster.get_node_from_key(key)
        try:
            with deadline.rerouting():
                return send(node)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            forget()
            deadline.raise_if_over(err)
            refresh(cluster, node.name)
            deadline.raise_if_over(err)
            if cluster.get_node_from_key(key).name != node.name:
                continue  # the slot has a new primary: try it at once
            dl = deadline.active()
            if dl is None:
                raise
            time.sleep(min(pause, dl.left()))
            pause = min(pause * 2, PAUSE_S[1])
