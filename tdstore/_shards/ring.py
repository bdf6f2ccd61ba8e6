"""Sharded rings: one replay buffer over the primaries of a Redis Cluster (``spread=True``).

A sharded ring of ``N`` slots is ``K`` ordinary one-node rings, the *shards* (``K``: one per
primary by default, ``shards=K`` to choose), each a store of its own in one hash slot, placed
on distinct primaries (shard ``k`` on the ``k % P``-th primary by name: its id's hash tag is
moved until its slot falls there, ``_format.keys.shard_id``), plus a small *layout* key in the ring's
own slot (``StoreKeys.shards``: the count, the layout and the shards' ids and counts, JSON,
written once with ``SET NX`` so that concurrent creators agree). Every call on one shard is
that shard's one-node call (its script, request id, leases, waiting); this module only maps
slots and fans calls out.

- **Slots.** One global numbering: shard ``k`` holds slots ``offset[k] .. offset[k] + count[k] - 1``
  (counts differ by at most one). Generations are the shard's.
- **extend.** A batch goes whole to one shard (a batch larger than a shard is cut, one piece per
  shard, the pieces sent at once), the shards taken in turn by each handle from a random start,
  so that writers fill them evenly (each shard gets one batch in ``K`` of every writer).
- **sample.** Exactly the one-node distribution: the shards' sizes (uniform) or priority masses
  (the roots of their sum trees, ``sum priority ** alpha``) are read in one parallel round trip
  (skipped for a uniform sample once every shard is full: a full ring stays full), ``B`` is
  split by one multinomial draw over them (each row picks its shard with probability
  ``size_k / size``, or ``mass_k / mass``), and each shard samples its part on its node, all
  at once; the rows are put back in the order of the draw. A row's probability is its shard's
  (``mass_k / mass``) times its probability within the shard; importance weights divide by the
  smallest probability over all shards (``min_k min_weight_k / mass``, each root holds its min).
  Two round trips at most; the sizes or masses are read just before the draw (not cached from
  the previous sample: another client's writes would make those stale, and the draw inexact).
- **Rate limiter.** Per shard: each shard limits its own samples and inserts with ``min_size``
  and ``error_buffer`` split in proportion to its count (at least ``max(1, samples_per_insert)``
  each), so the whole buffer's ``samples - samples_per_insert * inserts`` stays within the sum of
  the shards' buffers (``error_buffer``, or ``K * max(1, samples_per_insert)`` when that is more)
  plus one batch per shard, as a one-node limiter overshoots by one batch.
- **pop.** Each shard has its own read cursor (and lease table): a pop takes up to ``batch_size``
  items from one shard, the shards tried in turn; every item goes to exactly one reader, in write
  order within a shard, not across shards (as partitions in Kafka). A pop waiting for items polls
  the shards (from 1 ms to 50 ms apart): each shard's events are on its own node.
- **Faults.** A call on a shard whose node cannot be reached raises ``ShardUnavailableError``
  naming the shard, its store and node; the other shards serve meanwhile.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import redis
import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._engine.connection import open_client
from tdstore._engine.engine import new_td_id
from tdstore._errors import ShardUnavailableError
from tdstore._format.keys import StoreKeys, shard_id
from tdstore._plan import index as _index
from tdstore._ring.extend import RingState, RingWrite, Sample
from tdstore._ring.leases import LeasedSample, Receipt
from tdstore._ring.policy_calls import PrioritizedSample, weights_of

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
#: A pop sent to a shard that had unread items waits there this long at most when another reader took them first.
_POP_WAIT_S = 1.0


@dataclass(frozen=True)
class Layout:
    """What the layout key holds: the ring's count and batch layout, its shards' ids and counts."""

    count: int
    stack_dim: int
    inner: tuple[int, ...]
    ids: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:
        return [0, *np.cumsum(self.counts).tolist()][:-1]

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": 1,
                "count": self.count,
                "stack_dim": self.stack_dim,
                "inner": list(self.inner),
                "shards": list(zip(self.ids, self.counts)),
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> Layout:
        try:
            d = json.loads(text)
            ids, counts = zip(*d["shards"]) if d["shards"] else ((), ())
            out = cls(
                int(d["count"]),
                int(d["stack_dim"]),
                tuple(int(i) for i in d["inner"]),
                tuple(str(i) for i in ids),
                tuple(int(c) for c in counts),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise KeyError(f"the sharded ring {where} has a damaged layout key ({err})") from None
        if not out.ids or sum(out.counts) != out.count or min(out.counts) < 1:
            raise KeyError(
                f"the sharded ring {where} has a damaged layout key (shards {list(zip(out.ids, out.counts))}, count {out.count})"
            )
        return out


def is_cluster(url: str | None, client: Any) -> bool:
    """Whether a store opened with ``url``/``client`` is on a Redis Cluster (where ``spread=True`` shards a ring)."""
    if client is not None:
        return isinstance(client, redis.cluster.RedisCluster)
    return bool(url) and str(url).lower().startswith(("redis+cluster://", "rediss+cluster://"))


def wants_shards(kwargs: dict[str, Any]) -> bool:
    """Whether a store opened with these constructor keywords is a sharded ring (``spread=True`` on a cluster)."""
    return kwargs.get("spread") is True and kwargs.get("shards") != 0 and is_cluster(kwargs.get("url"), kwargs.get("client"))


def plan_layout(client: Any, prefix: str, td_id: str, count: int, shards: int | None, stack_dim: int, inner: tuple[int, ...]) -> Layout:
    """Shard counts as even as can be, shard ``k`` on the ``k % P``-th primary (by name)."""
    primaries = sorted(client.get_primaries(), key=lambda n: n.name)
    k_total = len(primaries) if shards is None else shards
    if isinstance(k_total, bool) or not isinstance(k_total, int) or k_total < 1:
        raise ValueError(f"shards must be None (one per primary) or an int >= 1, got {shards!r}")
    if k_total > count:
        raise ValueError(f"a ring of {count} slots cannot be cut into {k_total} shards (at least one slot each)")
    from redis.crc import key_slot

    slots = client.nodes_manager.slots_cache
    ids = []
    for k in range(k_total):
        target = primaries[k % len(primaries)].name
        for attempt in range(1 << 16):
            sid = shard_id(td_id, k, attempt)
            if slots[key_slot(StoreKeys(prefix, sid).meta.encode())][0].name == target:
                break
        ids.append(sid)
    counts = tuple(count // k_total + (1 if k < count % k_total else 0) for k in range(k_total))
    return Layout(count, stack_dim, inner, tuple(ids), counts)


@dataclass(frozen=True)
class ShardReceipt:
    """What ``ack`` needs for a leased pop of a sharded ring: the shard and its own receipt."""

    shard: int
    receipt: Receipt


class WrittenSlots(Sequence[int]):
    """The written slots of a sharded ring: each shard's first ``written`` slots, in global numbering."""

    def __init__(self, offsets: list[int], written: list[int]) -> None:
        self._ranges = [range(o, o + w) for o, w in zip(offsets, written)]
        self._n = sum(written)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        for r in self._ranges:
            yield from r

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        i = int(i) + (self._n if int(i) < 0 else 0)
        for r in self._ranges:
            if i < len(r):
                return r[i]
            i -= len(r)
        raise IndexError("written slot index out of range")

    def __repr__(self) -> str:
        return f"WrittenSlots({[f'{r.start}..{r.stop - 1}' for r in self._ranges if len(r)]}, n={self._n})"


class ShardedRing:
    """A ring buffer of ``count`` slots over the primaries of a Redis Cluster (see the module docstring).

    Made by ``LazyStackedTensorDictStore(count=N, url="redis+cluster://...", spread=True)``
    (``shards=K``: K shards instead of one per primary); the same call with its ``td_id``, or
    ``LazyStackedTensorDictStore.from_store(td_id=...)``, attaches to it. It has the ring's calls
    (``extend``, ``append``, ``sample``, ``update_if``, priorities, the rate limiter, the queue,
    ``pop``/``ack``) and reads and writes by global slot (``store[i]``, ``store[idx]``).
    """

    def __init__(
        self,
        *,
        count: int | None = None,
        url: str | None = None,
        client: Any = None,
        prefix: str = "tensordict",
        td_id: str | None = None,
        shards: int | None = None,
        stack_dim: int = 0,
        inner_batch_size: Sequence[int] = (),
        device: Any = None,
        readonly: bool = False,
        segment_bytes: int | None = None,
        ttl: float | None = None,
        host: str = "localhost",
        port: int = 6379,
        backend: str = "redis",
        cache_metadata: bool = True,
        spread: bool = True,
        db: int = 0,
        unix_socket_path: str | None = None,
        **redis_kwargs: Any,
    ) -> None:
        from tdstore.lazy import LazyStackedTensorDictStore, _check_layout

        if ttl is not None:
            raise NotImplementedError("a sharded ring (spread=True on a cluster) has no time to live yet: create it without ttl=")
        if readonly and td_id is None:
            raise ValueError("readonly=True opens an existing store: pass its td_id")
        rc, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        if not spec.cluster:
            raise ValueError("a sharded ring lives on a Redis Cluster: give a redis+cluster:// url or a RedisCluster client")
        self._client, self._owned = rc, owned
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        td_id = td_id or new_td_id()
        self._keys = StoreKeys(prefix, td_id)
        where = f"td_id={td_id!r} (prefix {prefix!r})"
        if count is not None:
            count, inner = _check_layout(count, stack_dim, inner_batch_size)
            stack_dim = stack_dim if stack_dim >= 0 else stack_dim + len(inner) + 1
            if readonly:
                raise ValueError("readonly=True opens an existing store: leave count out")
            plan = plan_layout(rc, prefix, td_id, count, shards, stack_dim, inner)
            rc.set(self._keys.shards, plan.to_json(), nx=True)
        text = rc.get(self._keys.shards)
        if text is None:
            raise KeyError(f"No sharded ring with {where} on the cluster")
        layout = Layout.from_json(text, where)
        if count is not None:
            mismatch = [
                f"{name} {got!r} != stored {have!r}"
                for name, got, have in (
                    ("count", count, layout.count),
                    ("stack_dim", stack_dim, layout.stack_dim),
                    ("inner_batch_size", inner, layout.inner),
                )
                if got != have
            ]
            if shards is not None and shards != len(layout.ids):
                mismatch.append(f"shards {shards} != stored {len(layout.ids)}")
            if mismatch:
                raise ValueError(f"a sharded ring with {where} already exists with another layout: {'; '.join(mismatch)}")
        self._layout = layout

        def open_shard(k: int) -> LazyStackedTensorDictStore:
            common = {
                "client": rc,
                "prefix": prefix,
                "td_id": layout.ids[k],
                "device": device,
                "backend": backend,
                "cache_metadata": cache_metadata,
            }
            if readonly:
                return LazyStackedTensorDictStore.from_store(readonly=True, **common)
            return LazyStackedTensorDictStore(
                count=layout.counts[k], stack_dim=layout.stack_dim, inner_batch_size=layout.inner, segment_bytes=segment_bytes, **common
            )

        self._init(self._fan_out([(k, open_shard, (k,)) for k in range(len(layout.ids))]))

    def _init(self, shards: list[Any]) -> None:
        self._shards = shards
        self._offsets = self._layout.offsets
        self._full = [False] * len(shards)
        self._next = random.randrange(len(shards))  # this handle's next shard to extend
        self._pop_next = random.randrange(len(shards))

    @classmethod
    def attach(cls, **kwargs: Any) -> ShardedRing:
        """A handle on an existing sharded ring (``td_id=`` and the connection's arguments)."""
        kwargs.pop("count", None)
        return cls(**kwargs)

    # -- fan-out -----------------------------------------------------------------------------
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
            raise ShardUnavailableError(
                f"shard {k} of the sharded ring td_id={self.td_id!r} (store {self._layout.ids[k]!r}, node {self._node_of(k)}) "
                f"is unavailable: {type(err).__name__}: {err} (the other shards serve meanwhile; this one once the "
                "cluster has a primary for it)",
                k,
            ) from err

    def _fan_out(self, jobs: list[tuple[int, Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
        """Run one call per shard, all at once (one thread each; inline when only one): their results, in order.
        Every call finishes before the first error is raised."""
        if len(jobs) == 1:
            k, fn, args = jobs[0]
            return [self._on(k, fn, *args)]
        pool = self._executor(len(jobs))
        futures = [pool.submit(self._on, k, fn, *args) for k, fn, args in jobs]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]

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
        slots, scalar = _index.positions(index, self._layout.count)
        which = self._locate(slots)
        groups = []
        for k in torch.unique(which).tolist():
            rows = (which == k).nonzero().reshape(-1)
            groups.append((k, rows, slots[rows] - self._offsets[k]))
        return slots, scalar, groups

    # -- identity ----------------------------------------------------------------------------
    @property
    def td_id(self) -> str:
        return self._keys.td_id

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    @property
    def shards(self) -> list[Any]:
        """The shards: one ordinary one-node ring store each (``LazyStackedTensorDictStore``)."""
        return list(self._shards)

    @property
    def shard_ids(self) -> tuple[str, ...]:
        return self._layout.ids

    @property
    def shard_counts(self) -> tuple[int, ...]:
        return self._layout.counts

    @property
    def shard_offsets(self) -> list[int]:
        """The first global slot of each shard."""
        return list(self._offsets)

    def shard_nodes(self) -> list[str]:
        """The node (``host:port``) holding each shard, as the cluster's slot map says now."""
        return [self._node_of(k) for k in range(len(self._shards))]

    @property
    def capacity(self) -> int:
        return self._layout.count

    def __len__(self) -> int:
        return self._layout.count

    @property
    def batch_size(self) -> torch.Size:
        inner = list(self._layout.inner)
        inner.insert(self._layout.stack_dim, self._layout.count)
        return torch.Size(inner)

    @property
    def _stack_pos(self) -> int:
        return self._layout.stack_dim

    @property
    def device(self) -> torch.device | None:
        return self._shards[0].device

    def keys(self, *args: Any, **kwargs: Any) -> Any:
        """The keys of the ring (those of the first shard that has any: every extend writes every key)."""
        for shard in self._shards:
            if shard._engine.header.leaves:
                return shard.keys(*args, **kwargs)
        for shard in self._shards:
            got = shard.keys(*args, **kwargs)
            if len(list(got)):
                return got
        return self._shards[0].keys(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ShardedRing(td_id={self.td_id!r}, count={self._layout.count}, shards={list(zip(self._layout.ids, self._layout.counts))})"

    @property
    def stack_ops(self) -> _ShardedOps:
        """Internal: what ``tdstore.torchrl``'s storage and samplers use of a store (its schema, reads by slot)."""
        return _ShardedOps(self)

    def _read(self, index: Any, paths: list[Any] | None = None) -> TensorDictBase:
        got = self[index]
        if paths is not None:
            got = got.select(*[tuple(p) if len(p) > 1 else p[0] for p in paths])
        return got

    # -- the ring's state --------------------------------------------------------------------
    def _ring_writes(self) -> list[int]:
        """Each shard's ring write count, read at once (one round trip, in parallel)."""
        return self._fan_out([(k, s._engine.ring_writes, ()) for k, s in enumerate(self._shards)])

    def _sizes(self) -> list[int]:
        """Items each shard holds, read at once; a full shard (it stays full) is not read again."""
        todo = [k for k in range(len(self._shards)) if not self._full[k]]
        got = dict(zip(todo, self._fan_out([(k, self._shards[k]._engine.ring_writes, ()) for k in todo]))) if todo else {}
        out = []
        for k, c in enumerate(self._layout.counts):
            n = c if self._full[k] else min(got[k], c)
            self._full[k] = n >= c
            out.append(n)
        return out

    def shard_states(self) -> list[RingState]:
        """``(write_count, cursor, written)`` of every shard's ring, read at once."""
        return [RingState(rw, rw % c, min(rw, c)) for rw, c in zip(self._ring_writes(), self._layout.counts)]

    def ring_state(self) -> RingState:
        """``(write_count, cursor, written)`` summed over the shards; a sharded ring has no one cursor: -1."""
        st = self.shard_states()
        return RingState(sum(s.write_count for s in st), -1, sum(s.written for s in st))

    @property
    def write_count(self) -> int:
        """Ring writes of every shard, summed (all laps), read from the server."""
        return sum(self._ring_writes())

    @property
    def written(self) -> WrittenSlots:
        """The written slots (global numbering; ``len(store.written)`` is how many items the ring holds)."""
        return WrittenSlots(self._offsets, self._sizes())

    # -- writes ------------------------------------------------------------------------------
    def _batch(self, td: Any) -> TensorDictBase:
        if isinstance(td, (list, tuple)):
            if not td:
                raise ValueError("extend got an empty list: nothing to write")
            elements = [
                e.to_tensordict() if is_tensorclass(e) else TensorDict(e, batch_size=self._layout.inner) if isinstance(e, dict) else e
                for e in td
            ]
            bad = [type(e).__name__ for e in elements if not isinstance(e, TensorDictBase)]
            if bad:
                raise TypeError(f"extend got a list holding {bad[0]}; it takes a list of TensorDicts (one per element)")
            return lazy_stack(elements, dim=self._stack_pos)
        if is_tensorclass(td):
            return td.to_tensordict()
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"extend takes a TensorDict (or a list of them), got {type(td).__name__}")
        return td

    def _rows(self, td: Any, rows: Any) -> Any:
        if isinstance(rows, torch.Tensor) and type(td) is TensorDict:
            # index_select: torch's advanced indexing of a CPU tensor costs ~10 ms for 256 rows here (2.13)
            sp = self._stack_pos
            try:
                return td.apply(lambda t: t.index_select(sp, rows), batch_size=[*td.batch_size[:sp], len(rows), *td.batch_size[sp + 1 :]])
            except (RuntimeError, TypeError):
                pass
        return td[(slice(None),) * self._stack_pos + (rows,)]

    def extend(self, td: Any, *, priority: Any = None, timeout: float | None = None) -> RingWrite:
        """Write the elements of ``td`` into one shard's next slots, in one atomic call on its node (a batch
        larger than the shard is cut, one piece per shard, sent at once). Shards are taken in turn by
        each handle, from a random start. Returns the global slots written and their generations."""
        td = self._batch(td)
        sp = self._stack_pos
        bs = td.batch_size
        if len(bs) != len(self._layout.inner) + 1:
            raise ValueError(
                f"a batch for this store must have batch size {list(self._layout.inner)} with the element dim "
                f"inserted at {sp}; got {list(bs)}"
            )
        n = int(bs[sp])
        if not 1 <= n <= self._layout.count:
            raise ValueError(f"extend got {n} elements for a ring of {self._layout.count} slots (1 to {self._layout.count} per call)")
        prios = None
        if priority is not None and not isinstance(priority, (int, float)):
            prios = torch.as_tensor(priority).reshape(-1)
            if prios.numel() == 1:
                prios = None
                priority = float(torch.as_tensor(priority).reshape(-1)[0])
            elif prios.numel() != n:
                raise ValueError(f"got {prios.numel()} priority values for {n} rows")
        k_total = len(self._shards)
        if n <= min(self._layout.counts) and self._guarded():
            k = self._admitting(n, timeout)
            self._next = (k + 1) % k_total
            return self._fan_out([(k, self._extend_one, (k, td, priority, timeout))])[0]
        jobs = []
        k, start = self._next, 0
        while start < n:
            take = min(n - start, self._layout.counts[k])
            piece = td if take == n else self._rows(td, slice(start, start + take))
            p = priority if prios is None else prios[start : start + take]
            jobs.append((k, self._extend_one, (k, piece, p, timeout)))
            start += take
            k = (k + 1) % k_total
        self._next = k
        got = self._fan_out(jobs)
        return RingWrite(torch.cat([w.indices for w in got]), torch.cat([w.generations for w in got]))

    def _guarded(self) -> bool:
        """Whether a shard may hold an extend back (a rate limiter or queue mode, as this handle knows the policy)."""
        pol = self._shards[0]._engine.header.sampling
        return pol is not None and (pol.limit is not None or pol.queue)

    def _heads(self, leases: bool = False) -> list[dict[str, int | None]]:
        """Each shard's ring and limiter counters (``rw``, ``sn``, ``lb``, ``rr``, ``lo``), read at once; with
        ``leases``, ``due``: whether a lease of the shard has run out (by this machine's clock)."""

        def one(k: int) -> dict[str, int | None]:
            e = self._shards[k]._engine
            raw = e.command("HMGET", e.keys.meta, "rw", "sn", "lb", "rr", "lo")
            got: dict[str, int | None] = {f: None if v is None else int(v) for f, v in zip(("rw", "sn", "lb", "rr", "lo"), raw)}
            if leases and got["lo"] is not None:
                first = e.command("ZRANGE", e.keys.lease_keys[1], 0, 0, "WITHSCORES")
                got["due"] = int(bool(first) and float(first[1]) <= time.time() * 1000)
            return got

        return self._fan_out([(k, one, (k,)) for k in range(len(self._shards))])

    def _admitting(self, n: int, timeout: float | None) -> int:
        """The first shard, taken in turn, whose rate limiter and queue admit an extend of ``n`` rows now
        (as its counters say; waiting, polling them, while none does). The extend is then sent to it
        with the caller's timeout: a shard that filled up meanwhile holds it back as on one node."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        k_total = len(self._shards)
        while True:
            heads = self._heads()
            for i in range(k_total):
                k = (self._next + i) % k_total
                if self._admits(k, heads[k], n):
                    return k
            pause = self._pause(
                deadline, pause, f"extend: the rate limiter or queue of every shard of the sharded ring td_id={self.td_id!r} holds inserts"
            )

    def _admits(self, k: int, head: dict[str, int | None], n: int) -> bool:
        pol = self._shards[k]._engine.header.sampling
        if pol is None:
            return True
        rw, sn, lb, rr = (head[f] or 0 for f in ("rw", "sn", "lb", "rr"))
        if pol.limit is not None and (rw - lb + 1) * pol.limit.samples_per_insert - sn > pol.limit.max_diff:
            return False
        unread = rr if head["lo"] is None else min(rr, head["lo"] or 0)
        return not (pol.queue and rw + n - unread > self._layout.counts[k])

    def _extend_one(self, k: int, piece: TensorDictBase, priority: Any, timeout: float | None) -> RingWrite:
        w = self._shards[k].extend(piece, priority=priority, timeout=timeout)
        return RingWrite(w.indices + self._offsets[k], w.generations)

    def append(self, td: Any, *, priority: Any = None, timeout: float | None = None) -> RingWrite:
        """``extend`` with one element (a tensordict of the inner batch size)."""
        if isinstance(td, dict):
            td = TensorDict(td, batch_size=self._layout.inner)
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"append expects a TensorDict or a dict, got {type(td).__name__}")
        return self.extend(td.unsqueeze(self._stack_pos), priority=priority, timeout=timeout)

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        """``update_if`` of each shard touched, at once: which rows were applied (see the one-node ring)."""
        from tdstore._ring.args import generations_arg

        slots, scalar, groups = self._by_shard(index)
        gens = generations_arg(generation, int(slots.numel()), "update_if")
        if scalar:
            td = td.unsqueeze(self._stack_pos)
        out = torch.zeros(int(slots.numel()), dtype=torch.bool)
        jobs = [(k, self._shards[k].update_if, (local, gens[rows], self._rows(td, rows))) for k, rows, local in groups]
        for (_, rows, _), applied in zip(groups, self._fan_out(jobs)):
            out[rows] = applied
        return out

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, int) and not isinstance(index, bool):
            slots, _, groups = self._by_shard(index)
            k, _, local = groups[0]
            self._on(k, self._shards[k].__setitem__, int(local[0]), value)
            return
        slots, _, groups = self._by_shard(index)
        self._fan_out([(k, self._shards[k].__setitem__, (local, self._rows(value, rows))) for k, rows, local in groups])

    # -- reads -------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        """A key (``store["obs"]``: every slot's, shard after shard), an element (a view of it on its
        shard), or the elements at global slots ``index`` (read from every shard touched at once)."""
        if isinstance(index, (str, tuple)) and (isinstance(index, str) or all(isinstance(i, str) for i in index)):
            parts = self._fan_out([(k, s.__getitem__, (index,)) for k, s in enumerate(self._shards)])
            return torch.cat(parts, dim=self._stack_pos)
        slots, scalar, groups = self._by_shard(index)
        if scalar:
            k, _, local = groups[0]
            return self._on(k, self._element, k, int(local[0]))
        if not groups:
            return self._shards[0][torch.zeros(0, dtype=torch.int64)]
        parts = self._fan_out([(k, self._shards[k].__getitem__, (local,)) for k, _, local in groups])
        order = torch.cat([rows for _, rows, _ in groups])
        return self._rows(torch.cat(parts, dim=self._stack_pos), torch.argsort(order))

    def _element(self, k: int, local: int) -> TensorDictBase:
        return self._shards[k][local].to_tensordict()

    def to_tensordict(self) -> TensorDictBase:
        """Every slot, read from every shard at once (shard after shard: global slot order)."""
        parts = self._fan_out([(k, s.to_tensordict, ()) for k, s in enumerate(self._shards)])
        out: Any = torch.cat(parts, dim=self._stack_pos)
        return out

    # -- sampling ----------------------------------------------------------------------------
    def _prioritized(self) -> bool:
        pol = self._shards[0]._engine.header.sampling
        return pol is not None and pol.prioritized

    def _masses(self) -> tuple[list[int], list[float], list[float]]:
        """Each shard's size, priority mass (root of its sum tree) and smallest positive weight, read at once."""

        def one(k: int) -> tuple[int, float, float]:
            shard = self._shards[k]
            engine = shard._engine
            c = self._layout.counts[k]
            pipe = engine.client.pipeline(transaction=False)  # one round trip: both keys are in the shard's slot
            pipe.hmget(engine.keys.meta, "rw", "na")
            pipe.getrange(engine.keys.priorities, *((0, 7) if c == 1 else (-16, -1)))
            head, root = pipe.execute()
            rw = engine.ring_writes_from(head[0], head[1])
            if not root:
                return min(rw, c), 0.0, 0.0
            vals = np.frombuffer(root, dtype="<f8")
            total = float(vals[0])
            low = float(vals[1]) if len(vals) > 1 else total
            if not (math.isfinite(total) and total >= 0 and math.isfinite(low) and low >= 0):
                raise KeyError(f"shard {k} of the sharded ring td_id={self.td_id!r} has a damaged priority tree")
            return min(rw, c), total, low

        got = self._fan_out([(k, one, (k,)) for k in range(len(self._shards))])
        return [g[0] for g in got], [g[1] for g in got], [g[2] for g in got]

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        keys: Sequence[Any] | None = None,
        prioritized: bool | None = None,
        alpha: float | None = None,
        beta: float = 1.0,
        min_size: int | None = None,
        timeout: float | None = None,
        **ragged: Any,
    ) -> Sample | PrioritizedSample:
        """A batch of ``batch_size`` written slots drawn with replacement over every shard, exactly as one ring
        would draw them (uniformly, or by priority on a ring with priorities): see the module docstring.
        Arguments and result as ``LazyStackedTensorDictStore.sample`` (indices are global slots)."""
        from tdstore._ring.sample_pop import _check_sample_args

        _check_sample_args(batch_size, min_size, beta)
        if min_size is not None and min_size > self._layout.count:
            raise ValueError(f"min_size={min_size} can never be reached by a ring of {self._layout.count} slots")
        by_prio = self._prioritized() if prioritized is None else bool(prioritized)
        if by_prio and not self._prioritized():
            self._shards[0]._engine.set_header(self._shards[0]._engine.fetch_header())
            if not self._prioritized():
                raise ValueError(f"the sharded ring td_id={self.td_id!r} has no priorities: call enable_priorities(alpha=...) first")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        while True:
            if by_prio:
                sizes, masses, lows = self._masses()
                weights = masses
            else:
                sizes = self._sizes()
                weights, lows = [float(s) for s in sizes], []
            total = sum(weights)
            if total > 0 and (min_size is None or sum(sizes) >= min_size):
                break
            if min_size is None and timeout is None:
                what = "no slot with a positive priority" if by_prio and sum(sizes) > 0 else "nothing written yet"
                raise ValueError(
                    f"cannot sample: the sharded ring td_id={self.td_id!r} holds {what} (pass min_size= or timeout= to wait for data)"
                )
            pause = self._pause(deadline, pause, f"sample: the sharded ring td_id={self.td_id!r} holds {sum(sizes)} items")
        which = torch.multinomial(torch.tensor(weights, dtype=torch.float64), batch_size, replacement=True, generator=generator)
        parts = torch.bincount(which, minlength=len(self._shards)).tolist()
        seeds = torch.randint(0, 1 << 62, (len(self._shards),), generator=generator).tolist()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        kw = {"keys": keys, "prioritized": prioritized, "alpha": alpha, "beta": beta, "timeout": left, **ragged}
        chosen = [k for k, b in enumerate(parts) if b]
        jobs = [(k, self._shards[k].sample, (parts[k], torch.Generator().manual_seed(seeds[k]))) for k in chosen]
        got = self._fan_out([(k, _with_kwargs(fn, kw), args) for k, fn, args in jobs])
        back = torch.argsort(torch.argsort(which, stable=True))  # row j of the pieces (in shard order) goes to position order[j]
        td = self._rows(torch.cat([g.td for g in got], dim=self._stack_pos), back) if len(got) > 1 else got[0].td
        indices = torch.cat([g.indices + self._offsets[k] for k, g in zip(chosen, got)]).index_select(0, back)
        gens = torch.cat([g.generations for g in got]).index_select(0, back)
        if not by_prio:
            return Sample(td, indices, gens)
        probs = torch.cat([g.probabilities * (masses[k] / total) for k, g in zip(chosen, got)]).index_select(0, back)
        low = min(lows[k] for k in range(len(self._shards)) if masses[k] > 0) / total
        return PrioritizedSample(td, indices, gens, weights_of(probs, low, beta), probs)

    def _pause(self, deadline: float | None, pause: float, what: str) -> float:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}, timed out")
            pause = min(pause, left)
        time.sleep(pause)
        return min(pause * 2, _POLL_S[1])

    # -- priorities, rate limiter, queue -----------------------------------------------------
    def _all(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._fan_out([(k, _with_kwargs(getattr(s, name), kwargs), args) for k, s in enumerate(self._shards)])

    @property
    def sampling_policy(self) -> Any:
        return self._shards[0].sampling_policy

    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        """Priorities on every shard (each its own sum tree), at once; see the one-node ring."""
        self._all("enable_priorities", alpha, max_times_sampled=max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        """``update_priority`` on each shard touched, at once: which slots were updated."""
        slots, _, groups = self._by_shard(index)
        n = int(slots.numel())
        pr = torch.as_tensor(priority, dtype=torch.float64).reshape(-1)
        pr = pr.expand(n) if pr.numel() == 1 else pr
        if pr.numel() != n:
            raise ValueError(f"got {pr.numel()} priority values for {n} rows")
        gens = None
        if generation is not None:
            from tdstore._ring.args import generations_arg

            gens = generations_arg(generation, n, "update_priority")
        out = torch.zeros(n, dtype=torch.bool)
        jobs = [
            (k, _with_kwargs(self._shards[k].update_priority, {"generation": None if gens is None else gens[rows]}), (local, pr[rows]))
            for k, rows, local in groups
        ]
        for (_, rows, _), ok in zip(groups, self._fan_out(jobs)):
            out[rows] = ok
        return out

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        """A rate limiter on every shard: ``min_size`` and ``error_buffer`` split in proportion to the
        shards' counts (each at least ``max(1, samples_per_insert)``). The whole buffer's samples minus
        ``samples_per_insert`` times its inserts stays within the sum of the shards' buffers (see the module docstring)."""
        if isinstance(min_size, bool) or not isinstance(min_size, int) or not 1 <= min_size <= self._layout.count:
            raise ValueError(f"min_size must be an int from 1 to the ring's {self._layout.count} slots, got {min_size!r}")
        n = self._layout.count
        jobs = []
        for k, c in enumerate(self._layout.counts):
            m = max(1, math.ceil(min_size * c / n))
            eb = None
            if (
                error_buffer is not None
                and samples_per_insert is not None
                and isinstance(error_buffer, (int, float))
                and isinstance(samples_per_insert, (int, float))
            ):
                eb = max(error_buffer * c / n, max(1.0, float(samples_per_insert)))
                if error_buffer < max(1.0, samples_per_insert):
                    eb = error_buffer  # the shard refuses it, with the one-node message
            elif error_buffer is not None:
                eb = error_buffer
            jobs.append(
                (
                    k,
                    _with_kwargs(
                        self._shards[k].set_rate_limit, {"min_size": m, "samples_per_insert": samples_per_insert, "error_buffer": eb}
                    ),
                    (),
                )
            )
        self._fan_out(jobs)

    def clear_rate_limit(self) -> None:
        self._all("clear_rate_limit")

    def set_queue(self, on: bool = True) -> None:
        """Queue mode on every shard: an extend that would overwrite items no one popped waits."""
        self._all("set_queue", on)

    # -- pop ---------------------------------------------------------------------------------
    def pop(self, *args: Any, **kwargs: Any) -> Any:
        """``pop(batch_size=1, *, timeout=None, keys=None, lease=None)``: see :meth:`pop_items`."""
        return self.pop_items(*args, **kwargs)

    def pop_items(
        self, batch_size: int = 1, *, timeout: float | None = None, keys: Sequence[Any] | None = None, lease: float | None = None
    ) -> Any:
        """Up to ``batch_size`` unread items of one shard, each handed to exactly one caller (in write
        order within the shard; not across shards). The shards are tried in turn; with none unread, the
        pop waits (polling the shards) up to ``timeout`` seconds (``TimeoutError``; ``None``: no limit).
        ``lease=S``: as the one-node ring, the items return ``S`` seconds after a pop that does not ``ack``."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"pop needs a positive int batch_size, got {batch_size!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        k_total = len(self._shards)
        while True:
            heads = self._heads(leases=True)
            for i in range(k_total):
                k = (self._pop_next + i) % k_total
                h = heads[k]
                if (h["rw"] or 0) <= (h["rr"] or 0) and not h.get("due"):
                    continue
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # another reader may take these first: then wait on this shard a moment at most, and look again
                wait = _POP_WAIT_S if left is None else min(left, _POP_WAIT_S)
                try:
                    got = self._on(k, self._shards[k].pop_items, batch_size, timeout=wait, keys=keys, lease=lease)
                except TimeoutError:
                    break
                self._pop_next = (k + 1) % k_total
                return self._global(k, got)
            else:
                pause = self._pause(
                    deadline, pause, f"pop: no unread item in the {k_total} shards of the sharded ring td_id={self.td_id!r}"
                )
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"pop: no unread item in the {k_total} shards of the sharded ring td_id={self.td_id!r}, timed out")

    def _global(self, k: int, got: Any) -> Any:
        off = self._offsets[k]
        if isinstance(got, LeasedSample):
            receipt: Any = ShardReceipt(k, got.receipt)  # what this ring's ack takes
            return replace(got, indices=got.indices + off, receipt=receipt, _store=self)
        return got._replace(indices=got.indices + off)

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        """Settle the items of a leased pop (its receipt, or the ``LeasedSample``) on their shard."""
        if isinstance(receipt, LeasedSample):
            receipt = receipt.receipt
        if not isinstance(receipt, ShardReceipt):
            raise ValueError(f"a sharded ring acks the receipts its own pops give (ShardReceipt), got {type(receipt).__name__}")
        return int(self._on(receipt.shard, self._shards[receipt.shard].ack, receipt.receipt, timeout=timeout))

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> RingState:
        """Block until the ring holds ``written`` items or had ``write_count`` ring writes (polling the shards)."""
        if (written is None) == (write_count is None):
            raise TypeError("wait_for takes exactly one of written= or write_count=")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        while True:
            st = self.ring_state()
            if (written is not None and st.written >= written) or (write_count is not None and st.write_count >= write_count):
                return st
            pause = self._pause(deadline, pause, f"wait_for: the sharded ring td_id={self.td_id!r} is at {st}")

    # -- lifecycle ---------------------------------------------------------------------------
    def clear_redis(self) -> int:
        """Delete every shard, then the layout key. Returns the count of keys deleted."""
        n = sum(self._all("clear_redis"))
        return n + int(self._client.delete(self._keys.shards))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        for s in self._shards:
            s.close()
        if self._owned:
            self._client.close()

    def __enter__(self) -> ShardedRing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def cursor(self) -> int:
        """-1: a sharded ring has no one cursor (each shard has its own, see :meth:`shard_states`)."""
        return -1

    @property
    def is_locked(self) -> bool:
        return False

    def __getstate__(self) -> dict[str, Any]:
        return {"keys": self._keys, "layout": self._layout, "shards": self._shards}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._keys, self._layout = state["keys"], state["layout"]
        shards = state["shards"]
        self._client = shards[0]._engine.client
        self._owned = False
        self._pool = None
        self._pool_lock = threading.Lock()
        self._init(shards)


class _ShardedEngine:
    """The little of an ``Engine`` that ``tdstore.torchrl`` asks a store's ops for: the schema (that of a
    shard holding keys) and no client-side reads (``tx_reads``: the ring samples)."""

    tx_reads = False

    def __init__(self, ring: ShardedRing) -> None:
        self._ring = ring
        self.ring_full = False  # torchrl's readers saw every slot of every shard written (counts only grow)

    @property
    def header(self) -> Any:
        for s in self._ring._shards:
            if s._engine.header.leaves:
                return s._engine.header
        return self._ring._shards[0]._engine.header

    def fetch_header(self) -> Any:
        for s in self._ring._shards:
            if not s._engine.header.leaves:
                s._engine.set_header(s._engine.fetch_header())
        return self.header

    def set_header(self, h: Any) -> None:
        """Nothing to set: each shard keeps its own."""


class _ShardedOps:
    """``stack_ops`` of a sharded ring: its schema and reads by global slot."""

    def __init__(self, ring: ShardedRing) -> None:
        self._ring = ring
        self.engine = _ShardedEngine(ring)

    @property
    def header(self) -> Any:
        return self.engine.header

    def read(self, index: Any, paths: list[Any] | None = None, under: Any = (), strip: bool = True) -> TensorDictBase:
        return self._ring._read(index, paths)


def _with_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return fn(*args, **kwargs)

    return call


# -- what `tdstore ls` and `tdstore info` show ------------------------------------------------


def node_of_key(client: Any, key: str) -> str:
    """The node (``host:port``) holding ``key`` on a cluster, ``"-"`` off one."""
    try:
        return str(client.get_node_from_key(key).name) if hasattr(client, "get_node_from_key") else "-"
    except Exception:
        return "?"


def group_shards(stores: Sequence[Any]) -> tuple[list[Any], dict[str, list[tuple[int, Any]]]]:
    """Store listings (``StoreInfo``) cut into (the ordinary stores, the shards of each sharded ring by ring id)."""
    from tdstore._format.keys import shard_of_id

    plain, rings = [], {}  # type: ignore[var-annotated]
    for info in stores:
        found = shard_of_id(info.td_id)
        if found is None:
            plain.append(info)
        else:
            rings.setdefault(found[0], []).append((found[1], info))
    return plain, {ring: sorted(parts, key=lambda p: p[0]) for ring, parts in rings.items()}


def ring_info(client: Any, prefix: str, td_id: str) -> dict[str, Any] | None:
    """A sharded ring as ``tdstore info`` shows it: its layout and, per shard, store id, node, count and fill
    (one read per shard); None when ``td_id`` is no sharded ring."""
    keys = StoreKeys(prefix, td_id)
    text = client.get(keys.shards)
    if text is None:
        return None
    layout = Layout.from_json(text, f"td_id={td_id!r}")
    shards = []
    for k, (sid, count) in enumerate(zip(layout.ids, layout.counts)):
        meta = StoreKeys(prefix, sid).meta
        rw = client.hget(meta, "rw")
        exists = bool(client.exists(meta))
        rw_n = int(rw) if rw is not None else 0
        shards.append(
            {"shard": k, "td_id": sid, "node": node_of_key(client, meta), "count": count, "written": min(rw_n, count),
             "write_count": rw_n, "present": exists}
        )  # fmt: skip
    return {
        "td_id": td_id,
        "prefix": prefix,
        "kind": "sharded ring",
        "count": layout.count,
        "stack_dim": layout.stack_dim,
        "inner": list(layout.inner),
        "written": sum(s["written"] for s in shards),
        "write_count": sum(s["write_count"] for s in shards),
        "layout_node": node_of_key(client, keys.shards),
        "shards": shards,
    }


def ring_info_lines(info: dict[str, Any], where: str) -> list[str]:
    lines = [
        f"sharded ring {info['td_id']} under prefix {info['prefix']!r} on {where}",
        f"  slots: {info['count']} in {len(info['shards'])} shards, written {info['written']}/{info['count']}, "
        f"{info['write_count']} ring writes; layout key on {info['layout_node']}",
    ]
    for s in info["shards"]:
        fill = f"{s['written']}/{s['count']}" if s["present"] else "MISSING"
        lines.append(f"  shard {s['shard']}: {s['td_id']} on {s['node']}, {fill}")
    return lines
