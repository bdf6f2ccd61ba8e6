"""Offset tables of heterogeneous leaves, kept by a handle so their rows can be read as plain GETRANGEs.

Element ``i`` of a heterogeneous leaf sits at bytes ``[o[i], o[i + 1])`` of its segment's data
key, where ``o`` is the segment's offset table. A script that reads scattered rows must fetch
those offsets before the bytes: one ``redis.call`` per row and table (about 1 us each on Redis
7) plus the tables copied into Lua, 1 ms of server time for a random batch of 256 token rows,
against 0.13 ms for the same rows of a homogeneous key read as a ``MULTI``/``EXEC`` of plain
``GETRANGE``s. With the table at hand the client names every range itself and reads the rows
in one such transaction.

The table is never trusted. The transaction that reads a row's bytes also reads the row's two
offsets back (and its shape record): ``RowPlan.pieces`` compares them with the offsets the byte
ranges were computed from. The server runs the transaction with no other command in between, so
when they match the bytes are the row's; when they do not (another client changed an element's
size since), the read goes through ``read.lua``, which sends the current table back with the
rows (its ``T`` op), in the same call. A leaf whose table keeps changing under the reader (a
ring that writers keep filling) is left to ``read.lua`` for a growing number of reads instead of
being fetched again and again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tdstore._errors import StoreDamagedError
from tdstore._format import wire
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import Header, Leaf
from tdstore._format.wire import Piece

#: Table bytes one handle keeps at most (8 bytes per element and heterogeneous leaf): 64 MiB hold
#: the tables of 8 million elements. Past it, reads of the leaves not kept go through read.lua.
MAX_BYTES = 64 << 20
#: Table bytes one read asks for at most (its ``T`` ops): a read of rows spread over many large
#: segments fetches their tables over several calls instead of one very large reply.
FILL_BYTES_PER_CALL = 4 << 20
#: After this many changed tables in a row, a leaf is left to read.lua for at most this many reads.
MAX_HOLD = 64


@dataclass
class _LeafTables:
    version: int  # the leaf's version the tables belong to
    segments: dict[int, bytes]  # segment -> its offset table as the server keeps it (little-endian int64, elements + 1)
    misses: int = 0  # changed tables met in a row
    hold: int = 0  # reads still left to read.lua


@dataclass
class RowPlan:
    """A read transaction's buffers for ``n`` rows of one heterogeneous leaf, and how to turn what they
    bring back into the three pieces ``read.lua``'s ``Y`` op returns (each row's (start, end) offsets,
    its shape record, its bytes), once the offsets read back are the ones the byte ranges used."""

    offsets: list[Piece]  # per segment: its whole table, or each row's two offsets
    shapes: list[Piece]  # each row's shape record; for one-dim elements, whose bytes tell their shape,
    # the last byte of each segment's shape table instead: a table lost or cut short is then found
    data: list[Piece]  # each row's bytes, in row order
    records: bool  # whether ``shapes`` reads the rows' records
    expected: bytes  # what ``offsets`` must bring back
    bounds: bytes  # each row's (start, end), packed as the server keeps them
    itemsize: int  # of the leaf's dtype (shape records of one-dim elements are their byte sizes / itemsize)

    @property
    def buffers(self) -> list[list[Piece]]:
        return [self.offsets, self.shapes, self.data]

    def pieces(self, got: list) -> list | None:
        """``Y``'s three pieces from this plan's buffers as read (``got``, in ``buffers`` order); None when
        the offsets moved since they were kept (the bytes read are then not the rows')."""
        if got[0] != self.expected:
            return None
        if self.records:
            return [self.bounds, got[1], got[2]]
        b = np.frombuffer(self.bounds, dtype="<i8").reshape(-1, 2)
        return [self.bounds, ((b[:, 1] - b[:, 0]) // self.itemsize).astype("<i8").tobytes(), got[2]]


class OffsetTables:
    """One handle's cache of offset tables, per heterogeneous leaf and segment (see the module)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._leaves: dict[int, _LeafTables] = {}
        self._bytes = 0
        self._epoch: str | None = None
        self._lock = threading.Lock()  # a handle may be used from several threads

    def _tables(self, h: Header, leaf: Leaf) -> _LeafTables:
        if h.epoch != self._epoch:  # another creation of the store: nothing kept applies
            self._leaves.clear()
            self._bytes = 0
            self._epoch = h.epoch
        t = self._leaves.get(leaf.number)
        if t is None or t.version != leaf.version:
            if t is not None:
                self._forget(t)
            t = self._leaves[leaf.number] = _LeafTables(leaf.version, {})
        return t

    def _forget(self, t: _LeafTables) -> None:
        """Drop every table kept for one leaf (the caller holds the lock)."""
        self._bytes -= sum(len(raw) for raw in t.segments.values())
        t.segments.clear()

    def plan(self, h: Header, keys: StoreKeys, leaf: Leaf, ids: np.ndarray) -> RowPlan | None:
        """The transaction's buffers for rows ``ids`` (in that order) of ``leaf``; None when a table
        they need is not kept (or the leaf is held back: the caller reads through read.lua)."""
        per = h.segments.per
        one = h.segments.n == 1
        segs = np.zeros_like(ids) if one else ids // per
        local = ids if one else ids - segs * per
        bounds = np.empty((ids.size, 2), dtype="<i8")
        offsets: list[Piece] = []
        probes: list[Piece] = []
        expected = []
        rec = 8 * leaf.ndim
        read_shapes = leaf.json or leaf.ndim != 1
        with self._lock:
            t = self._tables(h, leaf)
            if t.hold:
                return None
            for seg in [0] if one else np.unique(segs).tolist():
                raw = t.segments.get(seg)
                if raw is None:
                    return None
                table = np.frombuffer(raw, dtype="<i8")
                rows = slice(None) if one else segs == seg
                at = local[rows]
                bounds[rows, 0] = table[at]
                bounds[rows, 1] = table[at + 1]
                okey = keys.offsets(leaf.number, seg)
                if not read_shapes:
                    probes.append(
                        (
                            keys.shapes(leaf.number, seg),
                            np.full(1, rec * (len(raw) // 8 - 1) - 1, dtype=np.int64),
                            np.ones(1, dtype=np.int64),
                        )
                    )
                # the whole table back, or each row's two offsets (see _wire.TX_WHOLE_BYTES_PER_RANGE)
                if len(raw) <= at.size * wire.TX_WHOLE_BYTES_PER_RANGE:
                    offsets.append((okey, np.zeros(1, dtype=np.int64), np.full(1, len(raw), dtype=np.int64)))
                    expected.append(raw)
                else:
                    offsets.append((okey, 8 * at, np.full(at.size, 16, dtype=np.int64)))
                    expected.append(bounds[rows].tobytes())
        # one piece per stretch of rows in one segment, so the rows come back in their order
        cuts = np.flatnonzero(np.diff(segs)) + 1 if not one else np.zeros(0, dtype=np.int64)
        shapes: list[Piece] = []
        data: list[Piece] = []
        for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [ids.size])).tolist()):
            seg = int(segs[lo])
            at = local[lo:hi]
            if read_shapes and rec:
                shapes.append((keys.shapes(leaf.number, seg), rec * at, np.full(at.size, rec, dtype=np.int64)))
            first = bounds[lo:hi, 0]
            data.append((keys.data(leaf.number, seg), first, bounds[lo:hi, 1] - first))
        return RowPlan(
            offsets, shapes if read_shapes else probes, data, read_shapes, b"".join(expected), bounds.tobytes(), leaf.dtype.itemsize
        )

    def wanted(self, h: Header, leaf: Leaf, ids: np.ndarray) -> list[int]:
        """The segments whose tables a read of rows ``ids`` through read.lua should bring back (its
        ``T`` ops): those not kept, within the per-call and per-handle budgets; none while held back."""
        per = h.segments.per
        with self._lock:
            t = self._tables(h, leaf)
            if t.hold:
                t.hold -= 1
                return []
            room = min(FILL_BYTES_PER_CALL, self.max_bytes - self._bytes)
            out = []
            for seg in np.unique(ids // per).tolist():
                size = 8 * (h.segments.size(seg) + 1)
                if seg not in t.segments and size <= room:
                    out.append(seg)
                    room -= size
            return out

    def keep(self, h: Header, leaf: Leaf, seg: int, table: bytes) -> None:
        """Keep segment ``seg``'s table as a script read it (in the same call as the rows); a table of
        the wrong size (a key never written, say) is not kept; one that does not start at 0 and rise
        (edited by hand) raises ``StoreDamagedError``: rows are never cut from it."""
        if len(table) != 8 * (h.segments.size(seg) + 1):
            return
        raw = bytes(table)
        offs = np.frombuffer(raw, dtype="<i8")
        if offs[0] != 0 or (np.diff(offs) < 0).any() or int(offs[-1]) >= 2**53:
            key = leaf.path[0] if len(leaf.path) == 1 else leaf.path
            raise StoreDamagedError(
                f"the offset table of key {key!r} (segment {seg}) does not start at 0 and rise (written by another client?)", named=False
            )
        with self._lock:
            t = self._tables(h, leaf)
            old = t.segments.get(seg)
            if self._bytes - (len(old) if old is not None else 0) + len(raw) > self.max_bytes:
                return
            t.segments[seg] = raw
            self._bytes += len(raw) - (len(old) if old is not None else 0)

    def confirmed(self, h: Header, leaf: Leaf) -> None:
        """A transaction found ``leaf``'s rows where the kept tables said."""
        with self._lock:
            self._tables(h, leaf).misses = 0

    def changed(self, h: Header, leaf: Leaf) -> None:
        """A transaction found ``leaf``'s offsets changed: forget its tables; the first time the read
        that follows fetches them again, then each time in a row leaves twice as many reads to read.lua."""
        with self._lock:
            t = self._tables(h, leaf)
            self._forget(t)
            t.hold = min(MAX_HOLD, (1 << t.misses) - 1)
            t.misses += 1

    @property
    def nbytes(self) -> int:
        """Table bytes kept now."""
        return self._bytes
