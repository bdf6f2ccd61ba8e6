"""What ``tdstore.torchrl`` sees of a sharded ring's engine and ops (its schema, reads by global slot)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase

if TYPE_CHECKING:
    from tdstore._shards.ring import ShardedRing


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
