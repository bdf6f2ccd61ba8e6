"""Read what stores a server holds, for ``tdstore ls``, ``info``, ``check`` and ``rm`` (no printing here).

Everything is read from the store headers and the registry set of a prefix (see
:mod:`tdstore._format.keys`); nothing the server names is ever imported or unpickled:
dtypes go through tdstore's allow-list and leaf paths stay plain strings.  The
registry may name stores that expired with their TTL; listing skips those
without changing the server, and only ``tdstore rm`` removes such an entry.

Sizes and TTLs are read just after the headers, not atomically with them: an
inspection is a snapshot for a human, while every data operation is checked by
the server itself.

The parts: :mod:`tdstore._inspect.connect` (the connection and its errors),
:mod:`tdstore._inspect.headers` (headers and sizes), :mod:`tdstore._inspect.audit`
(``check``), :mod:`tdstore._inspect.results` (what they return), :mod:`tdstore._inspect.stats`
(a ring's counters, ``top``/``metrics``), :mod:`tdstore._shards.info` (sharded rings as ``ls``/``info``
show them); this module gathers them and deletes stores (``rm``). The command line (``tdstore.cli``)
reads servers through this module only.

Nothing here imports torch or tensordict (``tdstore ls`` answers in a fraction
of a second): headers are read by :mod:`tdstore._format.header_info`, and ``rm`` runs
``clear.lua`` itself.  Only deleting a spread store goes through the store class
(its delete takes the schema lock on every node, see ``_engine.spread``).
"""

from __future__ import annotations

from typing import Any

import redis

from tdstore._engine import batches
from tdstore._format.header_info import DELETING, HeaderInfo, StoreFormatError
from tdstore._format.keys import StoreKeys, registry_key, shard_of_id
from tdstore._inspect import stats
from tdstore._inspect.audit import audit
from tdstore._inspect.connect import (
    CONNECT_TIMEOUT,
    DEFAULT_URL,
    REPLY_TIMEOUT,
    URL_ENV,
    InvalidURL,
    LoginRefused,
    ServerConnection,
    ServerUnreachable,
    connect,
    resolve_url,
)
from tdstore._inspect.headers import describe_policy, inspect_for_delete, list_stores, lookup, read_header, store_info, store_layout
from tdstore._inspect.results import Audit, Deletion, LeafInfo, Listing, NoSuchStore, StoreBusy, StoreInfo, Unreadable, UnreadableStore
from tdstore._shards.info import group_shards, node_of_key, ring_info, ring_info_lines

__all__ = [
    "Audit",
    "CONNECT_TIMEOUT",
    "DEFAULT_URL",
    "REPLY_TIMEOUT",
    "URL_ENV",
    "Deletion",
    "InvalidURL",
    "LeafInfo",
    "LoginRefused",
    "Listing",
    "NoSuchStore",
    "ServerConnection",
    "ServerUnreachable",
    "StoreBusy",
    "StoreInfo",
    "Unreadable",
    "UnreadableStore",
    "audit",
    "connect",
    "delete_store",
    "describe_policy",
    "group_shards",
    "node_of_store",
    "registered_ids",
    "ring_info",
    "ring_info_lines",
    "ring_stats",
    "shard_of_id",
    "inspect_for_delete",
    "list_stores",
    "resolve_url",
    "store_info",
]

#: Header reads and deletes ``rm`` tries while other clients keep changing the store's schema.
CLEAR_TRIES = 20


def registered_ids(client: redis.Redis, prefix: str) -> list[str]:
    """Every id in the registry of ``prefix``, sorted (a sharded ring's shards are ids of their own, which
    :func:`shard_of_id` tells apart); one round trip. Stores that expired may still be named (``list_stores`` skips them)."""
    return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in client.smembers(registry_key(prefix)))


def ring_stats(client: redis.Redis, prefix: str, td_id: str, *, cluster: bool = False) -> dict[str, Any]:
    """The ring counters and state of the store ``td_id`` (``tdstore.Ring.stats``: what each key counts is in
    ``tdstore._inspect.stats``), in one round trip of reads; ``KeyError`` when there is no such store."""
    return stats.read(client, StoreKeys(prefix, td_id), cluster=cluster)


def node_of_store(client: redis.Redis, prefix: str, td_id: str) -> str:
    """The node (``host:port``) holding the header of store ``td_id`` on a cluster; ``"-"`` off one, ``"?"`` unknown."""
    return node_of_key(client, StoreKeys(prefix, td_id).meta)


def delete_store(client: redis.Redis, prefix: str, td_id: str) -> Deletion:
    """Delete one store in one atomic call, or drop a registry entry whose store is gone or unreadable.

    A readable store is deleted by ``clear.lua``, as ``clear_redis()`` does: every
    key of every leaf number the header ever gave out, registry entry included,
    guarded by the header's epoch and version (a schema change in between makes
    the script refuse, and the header is read again).  A spread store goes through
    :meth:`tdstore.TensorDictStore.from_store` and ``clear_redis`` (its delete takes
    the schema lock on every node).  An unreadable header is *not* deleted: its
    layout is unknown, so which keys belong to it cannot be listed safely; only its
    registry entry is removed so ``ls`` stops showing it.
    """
    info, error, registered = lookup(client, prefix, td_id)
    if info is None:
        if not registered:
            if error is not None:
                raise UnreadableStore(error)
            raise NoSuchStore(td_id)
        client.srem(registry_key(prefix), td_id)
        reason = (
            "its header is gone (expired or deleted)"
            if error is None
            else f"its header is unreadable ({error}); its keys were left on the server"
        )
        return Deletion(td_id, 0, registry_only=True, reason=reason)
    for _ in range(CLEAR_TRIES):
        raw = client.hgetall(StoreKeys(prefix, td_id).meta)
        if not raw:
            raise NoSuchStore(td_id)  # deleted or expired since it was read
        try:
            header, _ = read_header(raw)
        except StoreFormatError as err:
            raise UnreadableStore(str(err)) from None
        if header.state == DELETING or b"xd" in raw or "xd" in raw:
            # what a delete or a deadline change cut in batches left half-done (lua/clear.lua): the
            # script deletes it when its tombstone or lapsed deadline says so, else answers STALE
            deleted = _clear(client, store_layout(client, StoreKeys(prefix, td_id), header), header, f"{header.epoch}:X")
            if deleted is not None:
                return Deletion(td_id, deleted, registry_only=False)
        if header.state != "ready":
            raise StoreBusy(f"store {td_id!r} is still being uploaded (state {header.state!r}); an abandoned upload expires by itself")
        if header.spread:
            return _delete_spread(client, prefix, td_id)
        deleted = _clear(client, store_layout(client, StoreKeys(prefix, td_id), header), header)
        if deleted is not None:
            return Deletion(td_id, deleted, registry_only=False)
    raise StoreBusy(f"the schema of store {td_id!r} changed on each of {CLEAR_TRIES} tries to delete it; try again")


def _clear(client: redis.Redis, keys: StoreKeys, header: HeaderInfo, spec: str | None = None) -> int | None:
    """``clear.lua`` on a store whose keys are all in one slot (in batches above ``_engine.batches.BATCH_KEYS``):
    keys deleted, or None when the header moved on."""
    from redis.cluster import RedisCluster

    cluster = isinstance(client, RedisCluster)
    every = keys.all_keys(header.next_leaf, header.segments) + keys.side_keys
    # on Redis Cluster the registry lives in another slot: the script leaves it, and it is updated after
    spec = spec or f"{header.epoch}:V{header.version}"
    reply = batches.clear(client, every[0], None if cluster else keys.registry, every[1:], spec, keys.td_id)
    status = batches.status(reply)
    if status == "GONE":
        raise NoSuchStore(keys.td_id)
    if status != "OK":
        return None  # STALE: read the header again
    if cluster:
        client.srem(keys.registry, keys.td_id)
    return int(reply[1])


def _delete_spread(client: redis.Redis, prefix: str, td_id: str) -> Deletion:
    """A spread store, through the store class (this imports torch)."""
    from tdstore.store import TensorDictStore

    try:
        store = TensorDictStore.from_store(client=client, prefix=prefix, td_id=td_id)
    except KeyError:  # deleted or expired since it was read
        raise NoSuchStore(td_id) from None
    except (TypeError, StoreFormatError) as err:  # e.g. a kind of store this version cannot open
        raise UnreadableStore(str(err)) from None
    try:
        n = store.clear_redis()
    finally:
        store.close()  # the client is ours (client=), so this leaves it open
    return Deletion(td_id, n, registry_only=False)
