"""One planned server call, and what a per-segment runner needs from the engine that plans it.

``Call`` is what every planner returns and ``Engine._run`` sends (a script call, or a read
transaction of plain ``GETRANGE``s); ``SegmentHost`` is the part of the engine that
``_engine.spread`` (a spread store's calls cut per segment and sent per node) uses, and ``CallHost`` the
part that ``_engine.write_call`` and ``_engine.spread_call`` (the calls the engine sends) use. They live
here, below the engine and those modules, so that the engine imports them and they import nothing of
the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from redis.cluster import RedisCluster

from tdstore._format import wire
from tdstore._format.integrity import ChecksMemo
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.schema import Header, Leaf

#: Read transactions ask for at most this many bytes per ``GETRANGE``.
BULK_CHUNK = 1 << 20


@dataclass
class Call:
    """One planned script call: KEYS, ARGV and how to turn the reply into a result.

    A read of homogeneous leaves (``script == "tx"``), or of heterogeneous rows whose offset
    tables the handle keeps (see ``_format.offsets``), is sent instead as one MULTI/EXEC transaction of
    plain ``GETRANGE`` commands in ~1 MiB chunks (``ranges``: per buffer of the reply, runs of
    key, starts, lengths), preceded by an ``HMGET`` of the header guards; the client compares them
    with ``guards`` and, on a mismatch, refreshes and plans again. Atomic and one round trip like
    a script, without pushing megabytes through Lua.
    """

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[list], Any]
    ranges: list[list[wire.Piece]] | None = None  # per buffer of the reply: its byte ranges, in order
    guards: dict[str, str] | None = None
    staged: list[tuple[str, Any]] | None = None  # (staging key, bytes) sent by plain SETRANGE before the script
    fields: list[str] | None = None  # header fields a transaction also reads (HMGET, after the guards)
    field_values: dict[str, bytes | None] | None = None  # ... and what it read
    ops: list[list[Any]] | None = None  # a write's ops, as in args (a spread store cuts them per segment)
    schema: Header | None = None  # a write's new header (a schema change), else None
    verify: Callable[[list], list | None] | None = None  # a read transaction's reply as ``parse`` takes it, or None (see _format.offsets)
    counts: list[list[Any]] | None = None  # commands a read transaction ends with (a sample's counters: _inspect.stats)


def leaf_checks(leaves: Iterable[Leaf]) -> str:
    """The 'number:version' words that make a script refuse a call planned with stale leaves."""
    return " ".join(f"{leaf.number}:{leaf.version}" for leaf in leaves)


class SegmentHost(Protocol):
    """What ``_engine.spread`` uses of the engine of a store: its connection, key names and header."""

    keys: StoreKeys

    @property
    def client(self) -> redis.Redis: ...

    @property
    def cluster(self) -> RedisCluster: ...

    @property
    def max_value_bytes(self) -> int: ...

    def where(self) -> str: ...

    def gone(self) -> KeyError: ...

    def set_header(self, header: Header | None) -> None: ...

    def fetch_header(self) -> Header: ...

    def adopt_stale(self, reply: list) -> None: ...

    def command(self, *args: Any) -> Any: ...

    def execute(self, client: Any, *args: Any) -> Any: ...

    def segment_call(self, name: str, keys: list[str], args: list[Any]) -> Any: ...

    def queue_staged(self, pipe: Any, staged: list[tuple[str, Any]]) -> None: ...

    def ttl_ms(self) -> int | None: ...


class CallHost(SegmentHost, Protocol):
    """What ``_engine.write_call`` (a write's ARGV) and ``_engine.spread_call`` (a spread store's call) use of
    the engine: its cached header, key table, room and size checks; never its run loop, which calls them."""

    checks_memo: ChecksMemo
    transactions: bool

    @property
    def header(self) -> Header: ...

    @property
    def segment_size(self) -> int: ...

    @property
    def counts_in_place(self) -> bool: ...

    def key_table(self, h: Header) -> KeyTable: ...

    def check_room(self, h: Header, element_bytes: int, declared: int | None = None) -> None: ...

    def check_argument_sizes(self, call: Call) -> None: ...

    def localize_read(self, h: Header, call: Call) -> None: ...

    def short(self, call: Call, reply: list) -> bool: ...
