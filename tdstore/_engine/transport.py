"""The connection side of a store's engine: held connections, cluster routing and redirects,
script calls (``EVALSHA``, through ``_engine.scripts``), staged writes and read transactions on the wire.

``Transport`` does not plan: it sends one planned ``Call`` (or one command) to the node that
serves the store and gives the reply back (for a read transaction, after checking its guards). ``Engine`` (``_engine.engine``) builds on it:
it plans, runs the loop and handles what comes back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import redis
from redis.cluster import RedisCluster

from tdstore._engine import deadline, scripts, slot_map
from tdstore._engine.connection import ConnectionSpec, HeldConnection
from tdstore._engine.limits import ServerLimits, warn_eviction
from tdstore._engine.limits import read as read_limits
from tdstore._format import wire
from tdstore._format.keys import StoreKeys
from tdstore._plan.call import BULK_CHUNK, Call

#: ``Transport._transaction``: the transaction cannot be sent on a cluster (a slot that moved, a node away).
NO_TRANSACTION = object()
STAGING_TTL_MS = 60_000
_BINARY = frozenset({bytes, bytearray, memoryview})


def refused_for_good(err: redis.exceptions.ResponseError) -> bool:
    """Whether a refused read transaction means this server or ACL user has no MULTI/EXEC at all (then reads
    go through the scripts for good), not a refusal of this one (at maxmemory a server refuses to queue commands)."""
    text = str(err).lower()
    return "noperm" in text or "unknown command" in text or "no permissions" in text


def _release_all(held: dict[str, HeldConnection]) -> None:
    for h in held.values():
        h.release()


class Transport:
    """One store's connection to its server: a held connection (no pool checkout per command), on
    Redis Cluster to the primary that serves the store's slot, and one per other node a spread
    store's segments live on."""

    def __init__(self, spec: ConnectionSpec, keys: StoreKeys, client: redis.Redis | None, owns_client: bool) -> None:
        self.spec = spec
        self.keys = keys
        self._client = client
        self._owns_client = owns_client
        self._limits: ServerLimits | None = None
        self.value_limit = 512 << 20
        self._held = HeldConnection()  # script calls skip redis-py's per-command pool checkout
        self._node: redis.Redis | None = None  # on Redis Cluster: the client of the primary serving this store's slot
        # a handle dropped without close() gives its connection back to a caller's shared pool
        weakref.finalize(self, self._held.release)
        self._node_held: dict[str, HeldConnection] = {}  # a spread store's other nodes: one held connection each
        weakref.finalize(self, _release_all, self._node_held)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = self.spec.connect()
        return self._client

    @property
    def cluster(self) -> RedisCluster:
        """The client as what it is on Redis Cluster (``spec.cluster``): the node routing, a spread
        store's calls and its per-node pipelines use it."""
        return cast(RedisCluster, self.client)

    def idle(self) -> None:
        """Give the held connections back to their pools (a deleted store's handle needs none); the next
        call takes one again, from the pool."""
        self._held.release()
        _release_all(self._node_held)

    def close(self) -> None:
        """Release our connection; a caller's own client is left open. The next call reconnects."""
        self.idle()
        self._node = None
        if self._client is not None and self._owns_client:
            self._client.close()
            self._client = None

    @property
    def limits(self) -> ServerLimits:
        """What the server allows (see ``_engine.limits``): read once per server and process, with a
        warning when its maxmemory-policy may evict a store's keys."""
        if self._limits is None:
            where = self.spec.describe()
            self._limits = read_limits(self.client, where)
            warn_eviction(self._limits, where)
        return self._limits

    @property
    def max_value_bytes(self) -> int:
        """The largest string the server accepts (``proto-max-bulk-len``).

        ``write.lua`` refuses a call that would grow a string past it before writing
        anything. Set ``engine.value_limit`` lower for Dragonfly (256 MiB).
        """
        return min(self.value_limit, self.limits.value_bytes)

    def where(self) -> str:
        return f"td_id {self.keys.td_id!r} under prefix {self.keys.prefix!r} on {self.spec.describe()}"

    def gone(self) -> KeyError:
        return KeyError(f"no store with {self.where()} (it was deleted, expired, or never created)")

    def command(self, *args: Any) -> Any:
        """One plain command on the handle's held connection (the raw reply, no redis-py callbacks)."""
        return self.execute(self.client, *args)

    def execute(self, client: Any, *args: Any) -> Any:
        """One command on the handle's held connection; on Redis Cluster, to the primary that serves the store.

        Every key of a store lives in one slot (of a spread store: its header and segment 0,
        see ``segment_call`` for the others), so its calls go straight to that node's client
        instead of through ``RedisCluster``'s per-command routing (about 150 us a call). A redirect
        (the slot moved: resharding, failover) or a node that cannot be reached hands the command to ``RedisCluster``, which
        refreshes its map and routes or raises; the next call looks the node up again.
        """
        if not self.spec.cluster:
            return self._held.execute(client, *args)
        return self._on_store_node(client, lambda node: self._held.execute(node, *args), lambda: client.execute_command(*args))

    def _on_store_node(self, client: Any, send: Callable[[Any], Any], fallback: Callable[[], Any]) -> Any:
        """``send`` to the client of the cluster primary that serves the store; ``fallback()`` after a
        redirect or when that node cannot be reached (the next call looks the node up again).

        Under a call's deadline (``_engine.deadline``) a node that does not answer in time is not handed
        to ``fallback()`` (``RedisCluster``, which no deadline bounds): the slot map is read again and the
        call goes to the node it names, until the deadline (``_engine.slot_map``: a handle adopts the
        primary a failover promoted within the call that meets the failover)."""
        if deadline.active() is not None:

            def forget() -> None:
                self._held.release()
                self._node = None

            try:
                return slot_map.on_slot_node(client, self.keys.meta, lambda node: send(node.redis_connection), forget)
            except scripts.REDIRECTS:
                forget()
                return fallback()
        node = self._node
        try:
            if node is None:
                node = self._node = client.get_node_from_key(self.keys.meta).redis_connection
            return send(node)
        except (*scripts.REDIRECTS, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self._held.release()
            self._node = None
        return fallback()

    def segment_call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """One script call on the keys of one slot (a spread store's segment), on a connection held to the
        node that serves it; a redirect or a node that cannot be reached hands it to ``RedisCluster`` (under a
        call's deadline, a node that does not answer in time does not: see ``_on_store_node``)."""
        held_for: dict[str, HeldConnection] = {}

        def on(node: Any) -> Any:
            held = self._node_held.get(node.name)
            if held is None:
                held = self._node_held[node.name] = HeldConnection()
            held_for["last"] = held
            return scripts.call(node.redis_connection, name, keys, args, held.execute)

        def forget() -> None:
            if "last" in held_for:
                held_for["last"].release()

        try:
            if deadline.active() is not None:
                return slot_map.on_slot_node(self.cluster, keys[0], on, forget)
            return on(self.cluster.get_node_from_key(keys[0]))
        except (*scripts.REDIRECTS, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            if deadline.active() is not None and not isinstance(err, scripts.REDIRECTS):
                raise
            forget()
        return scripts.call(self.client, name, keys, args)

    def check_argument_sizes(self, call: Call) -> None:
        """Refuse, before sending, a call the server would not read: an argument larger than one string
        (``proto-max-bulk-len``) or a request larger than ``client-query-buffer-limit``.

        Otherwise the server drops the connection mid-request and redis-py retries for
        seconds before a bare ``ConnectionError``. Every server accepts a 1 MiB string and
        request (the smallest limits it allows), so the limits are only looked up above that.
        """
        big = total = 0
        for a in call.args:  # a plain loop: this runs on every call
            if a.__class__ in _BINARY:
                n = len(a)
                total += n
                if n > big:
                    big = n
        if total <= 1 << 19:
            return
        if big > self.max_value_bytes:
            raise ValueError(
                f"a value of {big} bytes is larger than the server accepts in one piece "
                f"(proto-max-bulk-len {self.max_value_bytes}); nothing was sent ({self.where()})"
            )
        if total + 64 * len(call.args) + 64 * len(call.keys) > self.limits.query_bytes:
            raise ValueError(
                f"this call sends {total} bytes in one request, more than the server reads from a client "
                f"(client-query-buffer-limit {self.limits.query_bytes}); write fewer elements per call, or raise "
                f"client-query-buffer-limit; nothing was sent ({self.where()})"
            )

    def queue_staged(self, pipe: Any, staged: list[tuple[str, Any]]) -> None:
        """Queue on ``pipe`` each staged blob: created empty with a TTL, then filled by plain SETRANGEs of
        1 MiB (less under a small client-query-buffer-limit)."""
        piece = self.limits.piece_bytes
        for key, data in staged:
            view = memoryview(data).cast("B")
            # the TTL first (SETRANGE keeps it): a connection lost midway leaves only keys that expire
            pipe.set(key, b"", px=STAGING_TTL_MS)
            for a in range(0, len(view), piece):
                pipe.setrange(key, a, view[a : a + piece])

    def _staged_call(self, call: Call) -> list:
        """One pipeline: each staged blob created empty with a TTL, filled by plain ~1 MiB SETRANGEs, then the script."""
        assert call.staged is not None
        text, sha = scripts.script_source(call.script)
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            self.queue_staged(pipe, call.staged)
            # after a NOSCRIPT, send the text itself (EVAL): a second flush cannot get in between
            script = ("EVALSHA", sha) if attempt == 0 else ("EVAL", text)
            pipe.execute_command(*script, len(call.keys), *call.keys, *call.args)
            results = pipe.execute(raise_on_error=False)
            last = results[-1]
            if isinstance(last, redis.exceptions.NoScriptError) and attempt == 0:
                continue
            for r in results:
                if isinstance(r, redis.exceptions.ResponseError):
                    self.client.delete(*(k for k, _ in call.staged))
                    raise scripts.translate(r, call.keys)
            return last
        raise scripts.ServerScriptError("the write script could not be loaded")

    def _transaction(self, call: Call) -> Any:
        """Run a read as MULTI/EXEC of plain GETRANGEs; None when a guard no longer matches (see Call),
        ``NO_TRANSACTION`` when it cannot be sent on a cluster (the caller reads through the script).

        The commands go out packed by ``_format.wire`` on the held connection (on a cluster, the
        store's primary), else through a redis-py transaction pipeline (fakeredis, another
        thread holding the connection).
        """
        assert call.ranges is not None and call.guards is not None
        names = list(call.guards)
        getranges, counts = wire.pack_chunked_getranges(call.ranges, BULK_CHUNK, self._key_encoding)
        n = sum(counts)
        extra = call.fields or []
        tail = call.counts or []  # after the reads, their replies unused
        body = (
            wire.pack("HMGET", self.keys.meta, "version", *names, *extra, encoding=self._key_encoding)
            + getranges
            + b"".join(wire.pack(*cmd, encoding=self._key_encoding) for cmd in tail)
        )
        try:
            results = self._transact(body, n + 1 + len(tail))
        except redis.exceptions.NoScriptError:  # a tail's script (raised while reading the replies one by one)
            self._load_tail(tail)
            results = self._transact(body, n + 1 + len(tail))
        if results is not None:
            self._tail_again(tail, results[n + 1 :])
        if results is None:
            if self.spec.cluster:
                return NO_TRANSACTION
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(self.keys.meta, ["version", *names, *extra])
            for pieces in call.ranges:
                for key, starts, lengths in pieces:
                    for first, last in zip(*wire.chunked(starts, lengths, BULK_CHUNK)):
                        pipe.getrange(key, first, last)
            for cmd in tail:
                pipe.execute_command(*cmd)
            results = pipe.execute(raise_on_error=False)
            for r in results[: len(results) - len(tail)]:
                if isinstance(r, Exception):
                    raise r
            self._tail_again(tail, results[len(results) - len(tail) :])
        head = results[0]
        if head[0] is None:
            raise self.gone()
        if [v.decode() if v is not None else None for v in head[1 : 1 + len(names)]] != [call.guards[n] for n in names]:
            return None
        call.field_values = dict(zip(extra, head[1 + len(names) :]))
        reply: list[Any] = [b"OK", head[0]]
        pos = 1
        for k in counts:
            # the chunks of a buffer joined into one bytearray the result tensor then owns (see from_bytes)
            reply.append(bytearray().join(results[pos : pos + k]))
            pos += k
        return reply

    def _load_tail(self, tail: list[list[Any]]) -> None:
        """Load the scripts a read transaction's tail calls (``EVALSHA``: a sample's counters, see ``Call.counts``)."""
        for cmd in tail:
            if cmd[0] == "EVALSHA":
                text = scripts.script_source(scripts.name_of(cmd[1]))[0]
                if self.spec.cluster:
                    self.cluster.execute_command("SCRIPT", "LOAD", text, target_nodes=self.cluster.get_node_from_key(self.keys.meta))
                else:
                    scripts.load(self.client, text)

    def _tail_again(self, tail: list[list[Any]], replies: list[Any]) -> None:
        """Run again, through the script path (which loads it), a script of a read transaction's tail that the
        server did not have (NOSCRIPT: scripts flushed, a restart): it did nothing, the reads stand."""
        for cmd, reply in zip(tail, replies):
            if isinstance(reply, redis.exceptions.NoScriptError) and cmd[0] == "EVALSHA":
                nk = int(cmd[2])
                scripts.call(self.client, scripts.name_of(cmd[1]), [str(k) for k in cmd[3 : 3 + nk]], list(cmd[3 + nk :]))
            elif cmd[0] == "HINCRBY" and cmd[1] == self.keys.stats and isinstance(reply, int) and reply == int(cmd[3]):
                # the transaction made the counter (perhaps the hash): a transaction cannot read the store's deadline,
                # so lua/sampled.lua, counting nothing, gives it (or deletes the hash of a store gone); once per store
                keys = [self.keys.meta, self.keys.stats, self.keys.sampled_rows]
                scripts.call(self.client, "sampled", keys, [0])

    def commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Plain commands on the store's keys in one round trip (a transaction on the held connection; on a
        cluster, to the store's primary, see ``execute``): their raw replies. One by one where no
        transaction can be sent (fakeredis, another thread holding the connection, a redirect)."""
        body = b"".join(wire.pack(*c, encoding=self._key_encoding) for c in commands)
        got = self._transact(body, len(commands))
        return [self.command(*c) for c in commands] if got is None else list(got)

    def _transact(self, body: bytes, n_commands: int) -> list | None:
        """A transaction of packed commands on the held connection (see ``execute``); None to go through redis-py instead."""
        if not self.spec.cluster:
            return self._held.transaction(self.client, body, n_commands)
        return self._on_store_node(self.client, lambda node: self._held.transaction(node, body, n_commands), lambda: None)

    @property
    def _key_encoding(self) -> tuple[str, str]:
        """How the client encodes key names (read transactions pack them themselves, and must name the same keys)."""
        enc = self.__dict__.get("_key_enc")
        if enc is None:
            get = getattr(self.client, "get_encoder", None)
            e = get() if get is not None else None
            enc = self.__dict__["_key_enc"] = (getattr(e, "encoding", "utf-8"), getattr(e, "encoding_errors", "strict"))
        return enc
