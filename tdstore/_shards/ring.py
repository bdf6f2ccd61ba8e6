"""Sharded rings: one replay buffer over the primaries of a Redis Cluster (``tdstore.ShardedRing``).

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
- **extend.** The shards fill in laps (none overwrites its oldest row before every shard has ended its
  lap), so the ring holds ``count`` rows before one is overwritten, whatever the extend sizes. A batch
  goes whole to a shard whose lap has room for it, the shards taken in turn by each handle from a
  random start; else it is cut over the shards, one part per shard, each atomic on its shard, sent at
  once (``shard_writes.place``; what a reader sees between the parts: ``tdstore.Ring.extend``).
- **sample.** Exactly the one-node distribution: the shards' sizes (uniform) or priority masses
  (the roots of their sum trees, ``sum priority ** alpha``) are read in one parallel round trip
  (skipped for a uniform sample once every shard is full: a full ring stays full), ``B`` is
  split by one multinomial draw over them (each row picks its shard with probability
  ``size_k / size``, or ``mass_k / mass``), and each shard samples its part on its node, all
  at once; the rows are put back in the order of the draw. A row's probability is its shard's
  (``mass_k / mass``) times its probability within the shard; importance weights divide by the
  smallest probability over all shards (``min_k min_weight_k / mass``, each root holds its min).
  Two round trips at most. A prioritized sample is usually one: it splits on the masses each shard
  answered the previous one with, and rejection sampling on the masses the shards answer this time
  keeps the draw exact when those were stale (``sample.py``; lua/README.md, Sharded rings).
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
  naming the shard, its store and node; the other shards serve meanwhile (a pop skips the shard),
  and this one once the cluster has promoted a replica. A call given ``timeout=`` keeps it whatever
  the nodes do, and follows its shard to a promoted replica within it (``fan_out._within``,
  ``_engine.slot_map``). A write is acknowledged by the shard's primary; with ``min_replicas=n``
  a call writing rows or priorities, a pop and an ack return only once ``n`` replicas have it
  (``WAIT`` after a fence write, ``fan_out._replicated``: one more round trip), so a failover
  loses nothing acknowledged; else it raises ``ShardUnavailableError`` "may be lost"; a pop's
  carries the items it took (``taken``) and ``retry()``, the same pop under its request id. The
  rate limiter's sample counts are not waited for: a failover may lose the last few, which lets
  the limiter admit that many more inserts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tensordict import TensorDictBase

from tdstore._engine.connection import open_client
from tdstore._engine.engine import td_id_or_new
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import KeySpec, NestedPath
from tdstore._inspect import stats
from tdstore._ring.extend import RingState
from tdstore._ring.slices import ShardedTrajectoryMethods
from tdstore._shards.fan_out import _POLL_S, _with_kwargs
from tdstore._shards.layout import Layout, WrittenSlots, is_cluster, open_layout, open_shard, plan_layout, ring_kwargs, wants_shards
from tdstore._shards.queue import ShardReceipt
from tdstore._shards.rollout_refusal import ShardRollouts
from tdstore._shards.sample import ShardSampling
from tdstore._shards.shard_writes import ShardWrites

# old pickles and imports name these here
__all__ = ["Layout", "ShardReceipt", "ShardedRing", "WrittenSlots", "is_cluster", "plan_layout", "wants_shards"]


class ShardedRing(ShardWrites, ShardSampling, ShardedTrajectoryMethods, ShardRollouts):
    """A ring buffer of ``count`` slots over the primaries of a Redis Cluster (see the module docstring).

    ``tdstore.ShardedRing(count=N, url="redis+cluster://...")`` makes one (``shards=K``: K shards
    instead of one per primary) or attaches to the one its ``td_id`` names (the layout must agree);
    :meth:`from_store` opens an existing one by ``td_id`` and never writes. (It is not a
    ``LazyStackedTensorDictStore``: that class's spread store, ``spread="segments"``, cuts one store's
    segments over the nodes and has no ring calls.) It has the ring's calls (``tdstore.Ring``: ``extend``,
    ``append``, ``sample``, ``update_if``, priorities, the rate limiter, the queue, ``pop``/``ack``) and
    reads and writes by global slot (``store[i]``, ``store[idx]``).
    ``min_replicas=n``: a call writing rows or priorities, a pop or an ack returns once ``n`` replicas have it.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

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
        min_replicas: int = 0,
        db: int = 0,
        unix_socket_path: str | None = None,
        _create: bool = True,
        **redis_kwargs: Any,
    ) -> None:
        if ttl is not None:
            raise NotImplementedError("a sharded ring has no time to live yet: create it without ttl=")
        if "spread" in redis_kwargs or "sharded" in redis_kwargs:
            word = "spread" if "spread" in redis_kwargs else "sharded"
            raise TypeError(f"ShardedRing takes no {word}= (it is the sharded ring); shards=K chooses its number of shards")
        if readonly and td_id is None:
            raise ValueError("readonly=True opens an existing store: pass its td_id")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
            raise ValueError(f"min_replicas must be an int >= 0 (replicas that acknowledge each write), got {min_replicas!r}")
        self._min_replicas = min_replicas
        rc, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        if not spec.cluster:
            raise ValueError("a sharded ring lives on a Redis Cluster: give a redis+cluster:// url or a RedisCluster client")
        self._client, self._owned = rc, owned
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        td_id = td_id_or_new(td_id)
        self._keys = StoreKeys(prefix, td_id)
        self._layout = open_layout(rc, self._keys, count, shards, stack_dim, inner_batch_size, readonly)
        opts = {"client": rc, "prefix": prefix, "device": device, "backend": backend, "cache_metadata": cache_metadata}
        if not readonly and _create:
            opts["segment_bytes"] = segment_bytes
        jobs = [(k, open_shard, (self._layout, k, opts, readonly, _create)) for k in range(len(self._layout.ids))]
        self._init(self._fan_out(jobs))

    def _init(self, shards: list[Any]) -> None:
        self._shards = shards
        self._offsets = self._layout.offsets
        self._full = [False] * len(shards)
        self._short = set()  # shards whose last wait for replicas fell short (fan_out._replicated)
        self._cached = None  # a prioritized sample's shard masses, for the next one's split (see sample.py)
        self._ratio = 1.0
        self._next = random.randrange(len(shards))  # this handle's next shard to extend
        self._rw = None  # each shard's ring writes as this handle last saw them (shard_writes.place)
        self._shared = False  # whether other handles' writes were seen (then the counts are read before each extend)
        self._pop_next = random.randrange(len(shards))

    @classmethod
    def from_store(cls, *, td_id: str, readonly: bool = False, min_replicas: int = 0, **kwargs: Any) -> ShardedRing:
        """Open the existing sharded ring ``td_id`` names (the connection's arguments as the constructor's:
        ``url``/``client``, ``prefix``, ``device``...); never writes. Its layout key is read (one round trip),
        then every shard's header (one round trip each, at once). An unknown ``td_id`` raises ``KeyError``
        naming it; the id of a one-node store raises ``KeyError`` too (``LazyStackedTensorDictStore.from_store``
        opens those, and raises ``TypeError`` for a sharded ring's id). ``count``, ``shards``,
        ``stack_dim`` and ``inner_batch_size`` are read from the server (given ones are ignored)."""
        for name in ("count", "shards", "stack_dim", "inner_batch_size", "segment_bytes", "ttl"):
            kwargs.pop(name, None)
        return cls(td_id=td_id, readonly=readonly, min_replicas=min_replicas, _create=False, **kwargs)

    @classmethod
    def attach(cls, **kwargs: Any) -> ShardedRing:
        """:meth:`from_store` (an older name)."""
        return cls.from_store(**kwargs)

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

    @staticmethod
    def wanted(store_kwargs: dict[str, Any]) -> bool:
        """Whether a buffer opened with these keywords is a sharded ring (``sharded=True``, or ``spread=True``
        on a cluster without ``shards=0``), decided without a round trip: what an adapter asks before opening one
        (``tdstore.torchrl.replay_buffer(..., sharded=True)``)."""
        return wants_shards(store_kwargs)

    @staticmethod
    def own_kwargs(store_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``store_kwargs`` without the words that chose a sharded ring (``sharded``, ``spread``): what
        :class:`ShardedRing` and :meth:`from_store` take."""
        return ring_kwargs(store_kwargs)

    def __repr__(self) -> str:
        return f"ShardedRing(td_id={self.td_id!r}, count={self._layout.count}, shards={list(zip(self._layout.ids, self._layout.counts))})"

    #: A sharded ring is lazy rings, never the stack of a dense store (``LazyStackedTensorDictStore.kept_as_dense``).
    kept_as_dense = False

    def key_specs(self, *, fresh: bool = False) -> dict[NestedPath, KeySpec]:
        """The keys of the first shard holding some (see ``LazyStackedTensorDictStore.key_specs``); ``fresh``:
        a shard that saw none reads its header again first (another process may have written the first keys)."""
        for s in self._shards:
            specs = s.key_specs() or (s.key_specs(fresh=True) if fresh else {})
            if specs:
                return specs
        return {}

    # -- the ring's state --------------------------------------------------------------------
    def _ring_writes(self) -> list[int]:
        """Each shard's ring write count, read at once (one round trip, in parallel; a shard's header another
        handle changed is adopted, so the count goes by the current header)."""
        return self._fan_out([(k, _with_kwargs(s._engine.ring_writes, {"fresh": True}), ()) for k, s in enumerate(self._shards)])

    def stats(self) -> dict[str, Any]:
        """The ring's counters and state (see ``tdstore.Ring.stats``): totals over the shards, read at once
        (one round trip per shard), and ``shards``, each shard's own, with its ``td_id``."""
        parts = self._fan_out([(k, s.stats, ()) for k, s in enumerate(self._shards)])
        for sid, part in zip(self._layout.ids, parts):
            part["td_id"] = sid
        return stats.add_up(parts)

    def shard_states(self) -> list[RingState]:
        """``(write_count, cursor, written)`` of every shard's ring, read at once."""
        return [RingState(rw, rw % c, min(rw, c)) for rw, c in zip(self._ring_writes(), self._layout.counts)]

    def ring_state(self) -> RingState:
        """``(write_count, cursor, written)`` summed over the shards; a sharded ring has no one cursor: -1."""
        st = self.shard_states()
        return RingState(sum(s.write_count for s in st), -1, sum(s.written for s in st))

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> RingState:
        """Block until the ring holds ``written`` items or had ``write_count`` ring writes (polling the shards)."""
        if (written is None) == (write_count is None):
            raise TypeError("wait_for takes exactly one of written= or write_count=")
        with self._within(timeout, "wait_for"):
            return self._wait_for(written, write_count, timeout)

    def _wait_for(self, written: int | None, write_count: int | None, timeout: float | None) -> RingState:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        while True:
            st = self.ring_state()
            if (written is not None and st.written >= written) or (write_count is not None and st.write_count >= write_count):
                return st
            pause = self._pause(deadline, pause, f"wait_for: the sharded ring td_id={self.td_id!r} is at {st}")

    @property
    def write_count(self) -> int:
        """Ring writes of every shard, summed (all laps), read from the server."""
        return sum(self._ring_writes())

    @property
    def written(self) -> WrittenSlots:
        """The written slots (global numbering; ``len(store.written)`` is how many items the ring holds)."""
        return WrittenSlots(self._offsets, self._sizes())

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

    # -- lifecycle ---------------------------------------------------------------------------
    def clear_redis(self) -> int:
        """Delete every shard, then the layout key. Returns the count of keys deleted."""
        n = sum(self._all("clear_redis"))
        for sid in self._layout.ids:  # replication fences (min_replicas): gone in 2 s anyway
            self._client.delete(StoreKeys(self.prefix, sid).fence)
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
        return {"keys": self._keys, "layout": self._layout, "shards": self._shards, "min_replicas": self._min_replicas}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._keys, self._layout = state["keys"], state["layout"]
        self._min_replicas = state.get("min_replicas", 0)
        shards = state["shards"]
        self._client = shards[0]._engine.client
        self._owned = False
        self._pool = None
        self._pool_lock = threading.Lock()
        self._init(shards)
