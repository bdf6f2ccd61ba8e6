"""What an inspection of a server returns (the stores it found, what ``rm`` deleted, what ``check``
found) and the errors it raises about one store; plain data, for the command line to print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Audit",
    "Deletion",
    "LeafInfo",
    "Listing",
    "NoSuchStore",
    "StoreBusy",
    "StoreInfo",
    "Unreadable",
    "UnreadableStore",
]


class NoSuchStore(LookupError):
    """Neither a header nor a registry entry for this id under this prefix."""


class UnreadableStore(RuntimeError):
    """The header exists but this tdstore cannot read it (corrupt, foreign, or another format)."""


class StoreBusy(RuntimeError):
    """The store is still being uploaded: deleting it would pull the data from under its uploader."""


@dataclass(frozen=True)
class LeafInfo:
    """One key of a store as ``info`` shows it."""

    path: tuple[str, ...]
    number: int
    dtype: str
    ndim: int
    shape: tuple[int, ...] | None
    """Shape of one element's tensor (inner batch dims first); ``None`` when it varies (heterogeneous)."""
    data_bytes: int
    table_bytes: int
    """Offset and shape tables of a heterogeneous leaf (0 for a homogeneous one)."""
    segments: int = 1
    """Blobs the key is cut into: one per segment of the store."""
    column: int | None = None
    """Byte offset of the key in the store's row block (its bytes are its share of the block), or ``None``."""

    @property
    def name(self) -> str:
        """Nested keys joined with ``.`` (ambiguous if a key holds a dot: :attr:`path` is exact)."""
        return ".".join(self.path)

    @property
    def layout(self) -> str:
        return "homogeneous" if self.shape is not None else "heterogeneous"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.name,
            "path": list(self.path),
            "dtype": self.dtype,
            "layout": self.layout,
            "ndim": self.ndim,
            "shape": None if self.shape is None else list(self.shape),
            "bytes": self.data_bytes,
            "table_bytes": self.table_bytes,
            "segments": self.segments,
            "row_block_column": self.column,
        }


@dataclass(frozen=True)
class StoreInfo:
    """Everything ``ls`` and ``info`` report about one readable store."""

    td_id: str
    prefix: str
    kind: str
    count: int
    stack_dim: int
    inner: tuple[int, ...]
    device: str
    version: int
    state: str
    ttl_ms: int | None
    """Milliseconds before the store expires; ``None`` when it has no time to live."""
    bytes: int
    """Every data, offset and shape string of the store (keys of deleted leaves included)."""
    write_count: int
    """Ring writes so far (the header field ``rw``; 0 when absent)."""
    leaves: tuple[LeafInfo, ...] = field(default_factory=tuple)
    server_keys: int = 0
    """Server keys the store owns now (header included): what ``rm`` deletes."""
    tensorclass: str = ""
    """Name of the tensorclass the store was uploaded from ("" for none); a name only, never imported."""
    segments: int = 1
    """Segments (element ranges under their own hash tag) the store is cut into."""
    segment_length: int = 0
    """Elements per segment; 0 when the store has one segment."""
    spread: bool = False
    """Segments under hash tags of their own, spread over a Redis Cluster's nodes (``spread=True``)."""
    batchless: bool = False
    """A dense store of batch size ``[]`` (kept as a stack of one element)."""
    sampling: str = ""
    """The ring's sampling policy in words (priorities, rate limiter, queue); "" for none."""

    @property
    def batch_size(self) -> tuple[int, ...]:
        """The batch size of the store as its class shows it (the stack dim inserted; ``()`` for a batchless dense store)."""
        if self.batchless:
            return ()
        dims = list(self.inner)
        dims.insert(self.stack_dim if self.stack_dim >= 0 else len(self.inner) + 1 + self.stack_dim, self.count)
        return tuple(dims)

    @property
    def cursor(self) -> int:
        """The next ring slot ``extend``/``append`` writes."""
        return self.write_count % self.count if self.count else 0

    @property
    def written(self) -> int:
        """Ring slots written at least once."""
        return min(self.write_count, self.count)

    @property
    def ttl_seconds(self) -> float | None:
        return None if self.ttl_ms is None else self.ttl_ms / 1000

    @property
    def has_ring(self) -> bool:
        """Whether the ring (``extend``/``sample``) applies: lazy stores, dense ones with a batch dim; not spread ones (they refuse it)."""
        return (self.kind == "lazy" or (self.kind == "dense" and not self.batchless)) and not self.spread

    def to_json(self, *, schema: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "td_id": self.td_id,
            "prefix": self.prefix,
            "type": self.kind,
            "count": self.count,
            "stack_dim": self.stack_dim,
            "inner_batch_size": list(self.inner),
            "device": self.device or None,
            "version": self.version,
            "state": self.state,
            "ttl_seconds": self.ttl_seconds,
            "bytes": self.bytes,
            "server_keys": self.server_keys,
            "keys": len(self.leaves),
            "ring": {"cursor": self.cursor, "write_count": self.write_count, "written": self.written} if self.has_ring else None,
            "segments": self.segments,
            "segment_length": self.segment_length,
            "spread": self.spread,
            "batch_size": list(self.batch_size),
            "tensorclass": self.tensorclass or None,
            "sampling": self.sampling or None,
        }
        if schema:
            out["schema"] = [leaf.to_json() for leaf in self.leaves]
        return out


@dataclass(frozen=True)
class Unreadable:
    """A registry entry whose header exists but cannot be read (listed, never guessed at)."""

    td_id: str
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"td_id": self.td_id, "error": self.error}


@dataclass(frozen=True)
class Listing:
    """The stores of one prefix."""

    stores: list[StoreInfo]
    unreadable: list[Unreadable]
    stale: list[str]
    """Registry entries whose store is gone (expired): skipped, and left for ``tdstore rm``."""
    reference: list[str] = field(default_factory=list)
    """Ids of stores the reference ``tensordict.store`` wrote under the prefix (another layout:
    ``tdstore import-reference`` copies one), that no tdstore store of the same id shadows."""


@dataclass(frozen=True)
class Deletion:
    """What ``rm`` did."""

    td_id: str
    keys_deleted: int
    """Server keys deleted (0 when only a stale registry entry was removed)."""
    registry_only: bool
    """True when the store was already gone (or unreadable) and only its registry entry was removed."""
    reason: str = ""


@dataclass(frozen=True)
class Audit:
    """What ``tdstore check`` found: every data and table key of a store against its header (``_format.integrity``)."""

    td_id: str
    checked: int
    """Keys checked (each leaf's data and tables in every segment)."""
    never_written: int
    """Keys absent because their segment was never written (the inventory vouches for them)."""
    problems: tuple[str, ...]
    """One line per key lost, short or too long, and for an inventory that lost entries."""
    damaged_keys: tuple[str, ...] = ()
    """The store's keys (``obs``, ``nested.b``) whose data or tables are among the problems, sorted."""

    @property
    def intact(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "td_id": self.td_id,
            "intact": self.intact,
            "checked": self.checked,
            "never_written": self.never_written,
            "problems": list(self.problems),
            "damaged_keys": list(self.damaged_keys),
        }
