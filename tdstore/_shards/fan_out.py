"""What every part of a sharded ring shares: its state, calls on one shard and on every shard at once (one thread each)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
import torch
from tensordict import TensorDict

from tdstore._engine import deadline
from tdstore._errors import ShardUnavailableError
from tdstore._format import codec
from tdstore._format.keys import StoreKeys
from tdstore._plan.index import positions
from tdstore._shards.layout import Layout

#: Errors that mean a shard's node could not be reached (``ShardUnavailableError`` names the shard).
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    ConnectionError,
)
#: A pop (or wait) over shards polls them this often, at first and at most.
_POLL_S = (0.001, 0.05)
#: How long a write waits for ``min_replicas`` replicas to acknowledge it (``WAIT``), in milliseconds.
REPLICA_WAIT_MS = 2000


class NotSentError(ShardUnavailableError):
    """A call on a shard refused before it was sent: its primary has fewer replicas than ``min_replicas``."""


class ShardsBase:
    """The state of a sharded ring and its calls on shards (``ShardedRing`` is made of this and the mixins on it)."""

    _client: Any
    _layout: Layout
    _keys: StoreKeys
    _shards: list[Any]
    _offsets: list[int]
    _pool: ThreadPoolExecutor | None
    _pool_lock: threading.Lock
    _min_replicas: int
    _short: set[int]  # shards whose last wait for replicas fell short: asked their replicas before the next call

    def _node_of(self, k: int) -> str:
        try:
            from redis.crc import key_slot

            client: Any = self._client
            slot = key_slot(StoreKeys(self.prefix, self._layout.ids[k]).meta.encode())
            return str(client.nodes_manager.slots_cache[slot][0].name)
        except Exception:
            return "?"

    def _on(self, k: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a call on shard ``k``: an unreachable node raises ``ShardUnavailableError`` naming it."""
        try:
            return fn(*args, **kwargs)
        except ShardUnavailableError:
            raise
        except _UNREACHABLE as err:
            raise self._unavailable(k, f"is unavailable: {type(err).__name__}: {err}") from err

    def _unavailable(self, k: int, what: str, taken: Any = None) -> ShardUnavailableError:
        return ShardUnavailableError(
            f"shard {k} of the sharded ring td_id={self.td_id!r} (store {self._layout.ids[k]!r}, node {self._node_of(k)}) "
            f"{what} (the other shards serve meanwhile; this one once the cluster has a primary for it)",
            k,
            taken=taken,
        )

    def _within(self, timeout: float | None, what: str) -> Any:
        """The deadline of a call given ``timeout=`` (``_engine.deadline.within``): every command of it, on
        this thread and on the threads its calls on shards run on (``_fan_out``), ends by then, a node that
        is down included (``_engine.slot_map``: the call follows the slot to a promoted replica meanwhile)."""
        return deadline.within(timeout, f"{what} on the sharded ring td_id={self.td_id!r}")

    def _replicated(self, k: int, fn: Callable[..., Any], *args: Any) -> Any:
        """A write on shard ``k`` acknowledged once ``min_replicas`` replicas of its primary have it.

        ``WAIT`` counts the writes of its own connection, and a script cannot call it, so after the
        write this sends, on the node that took the write, a pipeline of a
        throw-away write (``StoreKeys.fence``: it replicates after ours, in the primary's one
        replication stream) and ``WAIT min_replicas``: a replica that has the fence has the write.
        That node no longer being the primary (a failover in between), too few replicas answering
        within ``REPLICA_WAIT_MS`` (or the call's deadline), or the node lost meanwhile raises
        ``ShardUnavailableError`` "may be lost", its ``taken`` the write's reply. A shard whose last
        wait fell short is asked first how many replicas it has (``ROLE``): with too few, the call is
        not sent (it raises saying nothing was done)."""
        if k in self._short:
            self._check_replicas(k)
        out = fn(*args)
        try:
            acks, moved = self._wait_replicas(k)
        except (*_UNREACHABLE, TimeoutError) as err:
            self._short.add(k)
            raise self._unavailable(k, f"wrote on its primary but could not wait for its replicas ({err}): it may be lost", out) from err
        if moved is not None:
            raise self._unavailable(k, f"changed primary before a replica acknowledged a write ({moved}): it may be lost", out)
        if acks < self._min_replicas:
            self._short.add(k)
            raise self._unavailable(
                k, f"wrote on its primary but {acks} of min_replicas={self._min_replicas} replicas acknowledged it: it may be lost", out
            )
        self._short.discard(k)
        return out

    def _wait_replicas(self, k: int) -> tuple[int, Exception | None]:
        """How many replicas of shard ``k``'s primary acknowledged the writes made so far (a fence, then
        ``WAIT``, one pipeline on the node; bounded by the call's deadline, if any), and the node's refusal
        (MOVED, READONLY...: the primary changed since the write) or None."""
        fence = StoreKeys(self.prefix, self._layout.ids[k]).fence
        # the node that took the write: the slot map is read after it, not before. A map that was stale
        # (a failover or resharding that finished earlier) sent the write to the old node, whose redirect
        # RedisCluster followed and learnt; the node the map names now took the write. Only a redirect
        # from that node means that the primary changed after the write.
        node = self._client.get_node_from_key(fence)
        dl = deadline.active()
        wait_ms = REPLICA_WAIT_MS if dl is None else max(1, min(REPLICA_WAIT_MS, int(dl.left() * 1000)))
        replies = deadline.pipeline(
            node.redis_connection, [("SET", fence, b"", "PX", REPLICA_WAIT_MS), ("WAIT", self._min_replicas, wait_ms)]
        )
        for r in replies:
            if isinstance(r, redis.exceptions.ResponseError):
                return 0, r
        return int(replies[1]), None

    def _check_replicas(self, k: int) -> None:
        """``ShardUnavailableError`` (nothing done) when shard ``k``'s primary has fewer than ``min_replicas``
        replicas connected (``ROLE``): a call sent now could not be acknowledged. A node the slot map names
        that is no primary any more (a stale map) is no answer: the call goes and follows the redirect."""
        node = self._client.get_node_from_key(StoreKeys(self.prefix, self._layout.ids[k]).meta)
        role = deadline.execute_command(node.redis_connection, "ROLE")
        kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        if kind != "master":  # the slot map is stale (a failed primary back as a replica): the call follows the redirect
            return
        have = len(role[2]) if len(role) > 2 else 0
        if have < self._min_replicas:
            what = f"has {have} of min_replicas={self._min_replicas} replicas connected: this call was not sent"
            raise NotSentError(str(self._unavailable(k, what)), k)

    def _acked(self, k: int, fn: Callable[..., Any]) -> tuple[Any, ...]:
        """What ``_on(k, *this, *args)`` runs for a call that changes shard ``k``'s state: ``fn``, through
        ``_replicated`` if ``min_replicas`` is set (a pop or ack a failover must not undo)."""
        return (self._replicated, k, fn) if self._min_replicas else (fn,)

    def _fan_out(self, jobs: list[tuple[int, Callable[..., Any], tuple[Any, ...]]], write: bool = False) -> list[Any]:
        """Run one call per shard, all at once (the last in this thread, the others one thread each): their
        results, in order. Every call finishes before the first error is raised. ``write``: calls that
        write rows or priorities, acknowledged by ``min_replicas`` replicas (``_replicated``) if it is set."""
        if write and self._min_replicas:
            jobs = [(k, self._replicated, (k, fn, *args)) for k, fn, args in jobs]
        k, fn, args = jobs[-1]
        if len(jobs) == 1:
            return [self._on(k, fn, *args)]
        pool = self._executor(len(jobs) - 1)
        on = deadline.carried(self._on)  # each under the call's deadline, if it has one
        futures = [pool.submit(on, j, self._counted(j, f) if write else f, *a) for j, f, a in jobs[:-1]]
        last: Any = None
        raised: BaseException | None = None
        try:
            last = self._on(k, fn, *args)
        except BaseException as err:  # raised once the others are done (an error returned is a result)
            raised = err
        errors = [f.exception() for f in futures] + [raised]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures] + [last]

    def _counted(self, k: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` to run on another thread, counting its writes as in-place writes on shard ``k`` when this
        thread's do (``Engine.counting_in_place`` is per thread: torchrl's in-place writes over several
        shards move every shard's count, not only the one written from this thread)."""
        engine = self._shards[k]._engine
        if not engine.counts_in_place:
            return fn

        def call(*args: Any) -> Any:
            with engine.counting_in_place():
                return fn(*args)

        return call

    def _executor(self, n: int) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=max(n, 4), thread_name_prefix="tdstore-shard")
        assert self._pool is not None
        return self._pool

    def _locate(self, slots: torch.Tensor) -> torch.Tensor:
        """The shard of each global slot."""
        bounds = torch.tensor(self._offsets[1:], dtype=torch.int64)
        return torch.bucketize(slots, bounds, right=True)

    def _by_shard(self, index: Any) -> tuple[torch.Tensor, bool, list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """Global slots ``index`` as (slots, one slot?, per shard touched: (shard, rows of the index, local slots))."""
        slots, scalar = positions(index, self._layout.count)
        which = self._locate(slots)
        groups = []
        for k in torch.unique(which).tolist():
            rows = (which == k).nonzero().reshape(-1)
            groups.append((k, rows, slots[rows] - self._offsets[k]))
        return slots, scalar, groups

    @property
    def td_id(self) -> str:
        return self._keys.td_id

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    @property
    def _stack_pos(self) -> int:
        return self._layout.stack_dim

    def _rows(self, td: Any, rows: Any) -> Any:
        if isinstance(rows, torch.Tensor) and type(td) is TensorDict:
            # index_select: torch's advanced indexing of a CPU tensor costs ~10 ms for 256 rows here (2.13)
            sp = self._stack_pos
            try:
                batch = [*td.batch_size[:sp], len(rows), *td.batch_size[sp + 1 :]]
                return td.apply(lambda t: codec.index_select(t, sp, rows), batch_size=batch)
            except (RuntimeError, TypeError):
                pass
        return td[(slice(None),) * self._stack_pos + (rows,)]

    def _pause(self, until: float | None, pause: float, what: str) -> float:
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}, timed out")
            pause = min(pause, left)
        time.sleep(pause)
        return min(pause * 2, _POLL_S[1])

    # -- priorities, rate limiter, queue -----------------------------------------------------
    def _all(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._fan_out([(k, _with_kwargs(getattr(s, name), kwargs), args) for k, s in enumerate(self._shards)])


def _with_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return fn(*args, **kwargs)

    return call
