"""What ``tdstore.torchrl`` sees of a sharded ring's engine and ops (its schema, reads by global slot)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from tensordict import TensorDictBase

#: The ``ShardedRing`` this view is of (typed loosely: ``ring`` imports this module, so this one names it not).
ShardedRing = Any


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

    @property
    def shard_engines(self) -> list[Any]:
        """Each shard's engine, in shard order: the header fields torchrl keeps (``Ring.marks``) and
        the sampling policy live in every shard's header."""
        return [s._engine for s in self._ring._shards]

    def each_shard(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine)`` for every shard's engine, all at once (one round trip each, overlapping): the results."""
        return self._ring._fan_out([(k, fn, (s._engine,)) for k, s in enumerate(self._ring._shards)])

    @contextmanager
    def counting_in_place(self) -> Iterator[None]:
        """Within: this thread's writes count as in-place writes on every shard (``Engine.counting_in_place``)."""
        with ExitStack() as stack:
            for e in self.shard_engines:
                stack.enter_context(e.counting_in_place())
            yield


class _ShardedAccess:
    """``stack_ops`` of a sharded ring: its schema and reads by global slot."""

    def __init__(self, ring: ShardedRing) -> None:
        self._ring = ring
        self.engine = _ShardedEngine(ring)

    @property
    def header(self) -> Any:
        return self.engine.header

    def read(self, index: Any, paths: list[Any] | None = None, under: Any = (), strip: bool = True) -> TensorDictBase:
        return self._ring._read(index, paths)
