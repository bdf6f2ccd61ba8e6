"""Segments: the stack cut into ranges of elements, each stored under its own hash tag.

A leaf of a store is one blob per segment (plus offset and shape tables when it is
heterogeneous), so no value grows past the segment size, a shape-changing element
write rewrites one segment's tables instead of the whole store's, and on Redis
Cluster the segments spread over the primaries.  Segment ``k`` holds elements
``k * per .. (k + 1) * per - 1``; its tables are local (offsets start at 0).  A store
that fits in one segment (``per >= count``) has exactly one, under the header's tag.

The planners (``_plan.read_plan``, ``_plan.write_plan``, ``_plan.ring_plan``) plan in *global* terms: element
ids and byte offsets of a leaf as if it were one blob, on segment 0's key names.
This module turns such a plan into segment-local ops (:func:`localize_write`,
:func:`localize_read`, :func:`localize_ranges`) and puts the reply pieces back into
the shape the planner's parser expects.  Elements of segment 0 have the same
global and local addresses, and keys of other segments are passed through, so a
planner that already addresses one segment (the one-element fast paths) is left
unchanged.  Ops that address rows the server picks (ring writes, samples, scattered
batch reads) get a ``Q`` op instead: the script maps each row to its segment's key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.op_kinds import OpKind, Read, Write, read_kind, read_ops, write_kind
from tdstore._format.wire import Piece

#: Default target size of one segment's blob of one leaf.  Small enough that a
#: shape-changing write into a 1 GiB store costs about what it costs in a 4 MiB one
#: (the tail of one segment moves), large enough that a store of a few MiB keeps one
#: segment; far below Dragonfly's 256 MiB cap on one SETRANGE.
DEFAULT_SEGMENT_BYTES = 4 << 20


@dataclass(frozen=True)
class Segments:
    """How ``count`` elements are cut into segments of ``per`` elements (the last one may be shorter)."""

    count: int
    per: int

    @property
    def n(self) -> int:
        return max(1, -(-self.count // self.per))

    def of(self, e: int) -> int:
        return e // self.per

    def start(self, seg: int) -> int:
        return seg * self.per

    def size(self, seg: int) -> int:
        return max(0, min(self.per, self.count - seg * self.per))

    def split(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(segment, lo, hi)`` pieces (global, inclusive) of the element run ``lo..hi``."""
        while lo <= hi:
            seg = lo // self.per
            end = min(hi, (seg + 1) * self.per - 1)
            yield seg, lo, end
            lo = end + 1

    def split_bytes(self, start: int, length: int, eb: int) -> Iterator[tuple[int, int, int]]:
        """``(segment, local start, length)`` pieces of a byte range of a homogeneous leaf of ``eb``-byte elements."""
        span = self.per * eb
        while length > 0:
            seg = start // span
            local = start - seg * span
            take = min(length, span - local)
            yield seg, local, take
            start += take
            length -= take


def check_segment_bytes(value: object) -> int:
    """A ``segment_bytes=`` argument as a positive int (``None``: the default)."""
    if value is None:
        return DEFAULT_SEGMENT_BYTES
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"segment_bytes must be a positive number of bytes, got {value!r}")
    return value


#: A scattered row read fetches a whole segment blob (read.lua 'B') instead of one GETRANGE per
#: row ('X') when that reads at most this many bytes per row. Measured on Redis 7.0: a GETRANGE
#: from Lua costs about 3.4 us, a GET of a blob into Lua about 1.9 ns per byte, so the two
#: meet near 1.8 KB per row; a batch of 256 over the benchmark's keys went from 3.5 to 2.6 ms
#: of server time (tools/batch_server_time.py).
ROW_BLOB_BYTES = 1536


def row_read_op(segs: Segments, row_bytes: int, rows: int) -> OpKind:
    """'B' or 'X' for reading ``rows`` scattered rows of ``row_bytes`` each (see ROW_BLOB_BYTES)."""
    fetched = min(segs.n, rows) * min(segs.per, segs.count) * row_bytes
    return Read.B if fetched <= rows * ROW_BLOB_BYTES else Read.X


def het_row_read_op(segs: Segments, ndim: int, rows: int) -> OpKind:
    """'V' or 'Y' for reading ``rows`` scattered elements of a heterogeneous leaf: its offset and
    shape tables (8 + 8 * ndim bytes per element) read whole, or three ranges per row (see ROW_BLOB_BYTES)."""
    return Read.V if row_read_op(segs, 8 + 8 * ndim, rows) is Read.B else Read.Y


#: The most segments a store may have: a call addressed by rows the server picks (a ring write, a
#: sample) names one key per segment and leaf, so a store of millions of segments could not be
#: called at all (65,536 segments of the default 4 MiB hold 256 GiB per key).
MAX_SEGMENTS = 1 << 16


#: Bytes a segment's blob leaves free below ``segment_bytes`` (when that is at least :data:`ALLOC_SLACK_FROM`):
#: the server allocates a string's bytes plus its header and a terminating zero, rounded up to the allocator's
#: size class, and a blob of exactly 4 MiB (64 elements of 64 KiB) lands in the 5 MiB class: 25% more memory
#: than the data (issue 39: 2,400 such rows, 800 per node, needed 13 x 5 MiB = 65 MiB on 64 MB nodes). A blob
#: a few bytes short of the class (63 elements: 4,128,768 bytes) takes 4 MiB.
ALLOC_SLACK = 64
ALLOC_SLACK_FROM = 1 << 16


def segment_length(count: int, element_bytes: int, segment_bytes: int) -> int:
    """Elements per segment for elements of at most ``element_bytes`` in their largest leaf (the blob at
    most ``segment_bytes`` less :data:`ALLOC_SLACK` when a segment holds 16 elements or more); 0 when one
    segment holds them all."""
    whole = max(1, segment_bytes // max(1, element_bytes))
    short = max(1, (segment_bytes - ALLOC_SLACK) // max(1, element_bytes))
    # a row less costs at most 1/16 of the segment here, against the quarter an allocator's size class may add
    per = short if segment_bytes >= ALLOC_SLACK_FROM and whole >= 16 else whole
    return 0 if per >= count else per


# -- writes -----------------------------------------------------------------------


def _whole_leaf_key(keys: StoreKeys, name: str) -> tuple[str, int] | None:
    """``(role, leaf number)`` of segment 0's data or table key ``name``: a key as the planners name it,
    for the whole leaf; None for a key that is already segment-local or is not a data or table key."""
    what = keys.describe(name)
    return (what[0], what[1]) if what is not None and what[2] == 0 else None


def _i64(v: Any) -> np.ndarray:
    return np.frombuffer(v, dtype="<i8")


def _pairs(lo: Sequence[int], hi: Sequence[int]) -> bytes:
    out = np.empty(2 * len(lo), dtype="<i8")
    out[0::2] = lo
    out[1::2] = hi
    return out.tobytes()


@dataclass
class LeafShape:
    """What localizing needs to know of one leaf: element bytes (homogeneous) and shape record size."""

    het: bool
    eb: int
    rec: int


def localize_write(
    segs: Segments, keys: StoreKeys, leaf_of: Callable[[int], LeafShape], kt: KeyTable, ops: list[list[Any]]
) -> tuple[KeyTable, list[list[Any]]]:
    """The ops of one ``write.lua`` call, planned on whole leaves, turned into segment-local ops."""
    out = kt.fresh()
    new: list[list[Any]] = []
    offsets_set = {}  # leaf number -> offset table an 'S' op of this call sets (global)
    for op in ops:
        if op[0] == Write.S.marker and (w := _whole_leaf_key(keys, kt.keys[op[1] - 1])) and w[0] == "o":
            offsets_set[w[1]] = _i64(op[2])
    queued = False
    for op in ops:
        kind = write_kind(op)
        if kind.picks_rows:
            if not queued:
                new.append(Write.Q(segs.per))
                queued = True
            new.append(op)
            continue
        w = _whole_leaf_key(keys, kt.keys[op[1] - 1])
        if w is None:  # already segment-local (a key of another segment): as planned
            new.append(_rekeyed(kind, op, kt.keys, out))
            continue
        role, n = w
        localize = _LOCALIZE_WRITE.get(kind.marker)
        if localize is None:
            raise AssertionError(f"cannot localize write op {kind.marker!r}")
        new.extend(localize(_WriteLocal(segs, keys, out, n, role, leaf_of(n), kt, offsets_set.get(n)), op))
    return out, new


def _rekeyed(kind: OpKind, op: list[Any], kt_keys: Sequence[str], out: KeyTable) -> list[Any]:
    """``op`` with its key indices (into ``kt_keys``) renumbered into ``out``."""
    new = list(op)
    for i in kind.keys:
        if op[i]:
            new[i] = out.ref(kt_keys[op[i] - 1])
    return new


@dataclass(frozen=True)
class _WriteLocal:
    """One write op's leaf, as localizing it needs: the call's key tables and the leaf's shape."""

    segs: Segments
    keys: StoreKeys
    out: KeyTable
    n: int  # the leaf's number
    role: str  # which of its keys the op names: 'd'ata, 'o'ffsets or 's'hapes
    leaf: LeafShape
    kt: KeyTable  # the planned call's key table
    offsets: np.ndarray | None  # the leaf's whole offset table, when an 'S' op of the call sets it

    def key(self, seg: int, role: str | None = None) -> int:
        return self.out.ref(self.keys.leaf_keys(self.n, seg)["dos".index(role or self.role)])

    def other(self, index: int) -> tuple[str, int]:
        """``(role, leaf number)`` of another whole-leaf key the op names."""
        w = _whole_leaf_key(self.keys, self.kt.keys[index - 1])
        assert w is not None
        return w


def _local_each_segment(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'D' and 'T': the same op on the key of every segment."""
    for seg in range(loc.segs.n):
        yield [op[0], loc.key(seg)]


def _local_zeros(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'Z': each segment's share of the zero blob."""
    segs = loc.segs
    unit = op[2] // max(1, segs.count)
    if unit * segs.count != op[2]:
        raise AssertionError(f"a zero blob of {op[2]} bytes is not one size per element of {segs.count}")
    for seg in range(segs.n):
        yield Write.Z(loc.key(seg, "d"), unit * segs.size(seg))


def _local_fill(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'F': the filled byte range (homogeneous) or element run (heterogeneous) cut per segment."""
    segs = loc.segs
    if op[2] == 0:
        for seg, start, length in segs.split_bytes(op[3], op[4] - op[3], loc.leaf.eb):
            yield Write.F(loc.key(seg, "d"), 0, start, start + length, op[5])
    else:
        for seg, lo, hi in segs.split(op[3], op[4]):
            base = segs.start(seg)
            yield Write.F(loc.key(seg, "d"), loc.key(seg, "o"), lo - base, hi - base, op[5])


def _local_elements(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'E': the run of heterogeneous elements cut per segment, with its shapes, bytes and sizes."""
    lo, hi, rec, shapes, data, sizes = op[5], op[6], op[4], op[7], memoryview(op[8]).cast("B"), op[9:]
    pos = 0
    for seg, a, b in loc.segs.split(lo, hi):
        base = loc.segs.start(seg)
        part = sizes[a - lo : b - lo + 1]
        nbytes = sum(part)
        shape_part = shapes[(a - lo) * rec : (b - lo + 1) * rec]
        yield Write.E(
            loc.key(seg, "d"), loc.key(seg, "o"), loc.key(seg, "s"), rec, a - base, b - base, shape_part, data[pos : pos + nbytes], *part
        )
        pos += nbytes


def _local_rows(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'X', 'K' and 'Y' (addressed by rows): each key index becomes a block of that key in every segment."""
    yield _row_blocks(loc.segs, loc.keys, loc.kt.keys, loc.out, write_kind(op), op)


def _row_blocks(segs: Segments, keys: StoreKeys, kt_keys: Sequence[str], out: KeyTable, kind: OpKind, op: list[Any]) -> list[Any]:
    """A row-addressed op whose key indices (whole-leaf keys in ``kt_keys``) each become a block
    of ``out``: the same key of every segment, in segment order (the script picks a row's one)."""
    new = list(op)
    for i in kind.keys:
        w = _whole_leaf_key(keys, kt_keys[op[i] - 1])
        if w is None:
            raise AssertionError(f"op {op[0]!r} addressed by rows names a key of one segment")
        new[i] = out.block([keys.leaf_keys(w[1], seg)["dos".index(w[0])] for seg in range(segs.n)])
    return new


def _local_column(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'C': a column of the row block copied out in every segment."""
    target = loc.other(op[2])
    for seg in range(loc.segs.n):
        yield [op[0], loc.out.ref(loc.keys.data(loc.n, seg)), loc.out.ref(loc.keys.data(target[1], seg)), *op[3:]]


def _local_copy(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    """'O': a key copied to another leaf number's, in every segment."""
    role, m = loc.other(op[2])
    for seg in range(loc.segs.n):
        yield Write.O(loc.key(seg), loc.out.ref(loc.keys.leaf_keys(m, seg)["dos".index(role)]))


def _local_rows_set(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    yield from _localize_rows(loc.segs, loc.keys, loc.n, loc.leaf.eb, op, loc.out)


def _local_set(loc: _WriteLocal, op: list[Any]) -> Iterator[list[Any]]:
    yield from _localize_set(loc.segs, loc.keys, loc.n, loc.role, loc.leaf, op[2], loc.offsets, loc.out)


#: How each write op planned on a whole leaf becomes segment-local ops.
_LOCALIZE_WRITE: dict[str, Callable[[_WriteLocal, list[Any]], Iterator[list[Any]]]] = {
    Write.D.marker: _local_each_segment,
    Write.T.marker: _local_each_segment,
    Write.Z.marker: _local_zeros,
    Write.X.marker: _local_rows,
    Write.K.marker: _local_rows,
    Write.Y.marker: _local_rows,
    Write.C.marker: _local_column,
    Write.O.marker: _local_copy,
    Write.R.marker: _local_rows_set,
    Write.S.marker: _local_set,
    Write.F.marker: _local_fill,
    Write.E.marker: _local_elements,
}


def _localize_rows(segs: Segments, keys: StoreKeys, n: int, eb: int, op: list[Any], out: KeyTable) -> list[list[Any]]:
    """An 'R' write op (byte ranges of a homogeneous leaf): one 'R' op per segment it touches."""
    ranges = _i64(op[3]).reshape(-1, 2)
    data = memoryview(op[4]).cast("B")
    per_seg: dict[int, tuple[list[int], list[int], list[Any]]] = {}
    pos = 0
    for start, length in ranges.tolist():
        for seg, local, take in segs.split_bytes(start, length, eb):
            lo, ln, parts = per_seg.setdefault(seg, ([], [], []))
            lo.append(local)
            ln.append(take)
            parts.append(data[pos : pos + take])
            pos += take
    return [
        Write.R(out.ref(keys.data(n, seg)), len(lo), _pairs(lo, ln), parts[0] if len(parts) == 1 else b"".join(parts))
        for seg, (lo, ln, parts) in per_seg.items()
    ]


def _localize_set(
    segs: Segments, keys: StoreKeys, n: int, role: str, leaf: LeafShape, value: Any, offsets: np.ndarray | None, out: KeyTable
) -> list[list[Any]]:
    """An 'S' op (a whole blob or table of a leaf): one 'S' op per segment with its part."""
    view = memoryview(value).cast("B")
    ops = []
    for seg in range(segs.n):
        a, b = segs.start(seg), segs.start(seg) + segs.size(seg)
        key = keys.leaf_keys(n, seg)["dos".index(role)]
        if role == "s":
            part: Any = view[a * leaf.rec : b * leaf.rec]
        elif role == "o":
            part = (_i64(value)[a : b + 1] - _i64(value)[a]).astype("<i8").tobytes()
        elif leaf.het:
            if offsets is None:
                raise AssertionError(f"a heterogeneous blob of leaf {n} set without its offset table")
            part = view[int(offsets[a]) : int(offsets[b])]
        else:
            part = view[a * leaf.eb : b * leaf.eb]
        ops.append(Write.S(out.ref(key), part))
    return ops


# -- reads ------------------------------------------------------------------------


def localize_read(
    segs: Segments, keys: StoreKeys, leaf_of: Callable[[int], LeafShape], kt_keys: list[str], args: list[Any]
) -> tuple[list[str], list[Any], Callable[[list], list]]:
    """A ``read.lua`` call planned on whole leaves, turned into segment-local ops.

    ``args`` starts with the op count (no version checks yet).  Returns the new
    KEYS, ARGV, and a function that turns the new reply back into the one the
    planner's parser expects.
    """
    out = KeyTable(*kt_keys[: 2 if len(kt_keys) > 1 and kt_keys[1] == keys.inventory else 1])
    new: list[Any] = []
    merges: list[tuple[str, Any]] = []  # per original op: how to rebuild its pieces
    queued = False
    for op in read_ops(args[1:]):
        kind = read_kind(op)
        if kind.picks_rows and not queued:
            new += Read.Q(segs.per)
            queued = True
        w = None if kind.picks_rows else _whole_leaf_key(keys, kt_keys[op[1] - 1])
        if w is None or kind is Read.T:  # no leaf key, or planned on one segment's keys already: as planned
            new += _rekeyed(kind, op, kt_keys, out)
            merges.append(("pass", kind.reply_pieces(op)))
        elif kind is Read.R:
            merges.append(_local_ranges(segs, keys, w[1], leaf_of(w[1]).eb, op, out, new))
        elif kind is Read.E:
            merges.append(_local_runs(segs, keys, w[1], op, out, new))
        elif kind.by_row:
            new += _row_blocks(segs, keys, kt_keys, out, kind, op)
            merges.append(("pass", kind.reply_pieces(op)))
        else:
            raise AssertionError(f"cannot localize read op {kind.marker!r}")
    return out.keys, [sum(1 for _ in read_ops(new)), *new], partial(_merge_reply, merges)


def _local_ranges(segs: Segments, keys: StoreKeys, n: int, eb: int, op: list[Any], out: KeyTable, new: list[Any]) -> tuple[str, Any]:
    """An 'R' read op of a whole homogeneous leaf cut into one 'R' op per run of ranges in one segment;
    how its reply pieces join back: one piece ('join') or one per planned range ('ranges')."""
    _, _, _, ranges, join = op
    pieces_per_range: list[int] = []
    groups: list[tuple[int, list[tuple[int, int]]]] = []  # (segment, [(local, length)])
    for start, length in _i64(ranges).reshape(-1, 2).tolist():
        c = 0
        # an empty range (elements of zero bytes) still has its piece in the reply
        pieces = list(segs.split_bytes(start, length, eb)) or [(groups[-1][0] if groups else 0, 0, 0)]
        for seg, local, take in pieces:
            if groups and groups[-1][0] == seg:
                groups[-1][1].append((local, take))
            else:
                groups.append((seg, [(local, take)]))
            c += 1
        pieces_per_range.append(c)
    for seg, rs in groups:
        new += Read.R(out.ref(keys.data(n, seg)), len(rs), _pairs([r[0] for r in rs], [r[1] for r in rs]), join)
    return ("join", len(groups)) if join == "1" else ("ranges", pieces_per_range)


def _local_runs(segs: Segments, keys: StoreKeys, n: int, op: list[Any], out: KeyTable, new: list[Any]) -> tuple[str, Any]:
    """An 'E' read op of a whole heterogeneous leaf cut into one 'E' op per segment it touches;
    how its reply pieces join back (per planned run, the pieces of each segment it crossed)."""
    rec, runs = op[4], op[6]
    pieces_per_run: list[int] = []
    groups: list[tuple[int, list[tuple[int, int]]]] = []  # (segment, [(local lo, local hi)])
    for lo, hi in _i64(runs).reshape(-1, 2).tolist():
        c = 0
        for seg, x, y in segs.split(lo, hi):
            base = segs.start(seg)
            if groups and groups[-1][0] == seg:
                groups[-1][1].append((x - base, y - base))
            else:
                groups.append((seg, [(x - base, y - base)]))
            c += 1
        pieces_per_run.append(c)
    for seg, rs in groups:
        d, o, s = (out.ref(key) for key in keys.leaf_keys(n, seg))
        new += Read.E(d, o, s, rec, len(rs), _pairs([r[0] for r in rs], [r[1] for r in rs]))
    return ("runs", pieces_per_run)


def _merge_reply(merges: list[tuple[str, Any]], reply: list) -> list:
    """A localized read's reply turned back into the one its planner's parser expects."""
    if reply[0] != b"OK":
        return reply
    fixed = [reply[0], reply[1]]
    pos = 2
    for how, what in merges:
        if how == "pass":
            fixed.extend(reply[pos : pos + what])
            pos += what
        elif how == "join":
            fixed.append(b"".join(reply[pos : pos + what]))
            pos += what
        elif how == "ranges":
            for c in what:
                fixed.append(reply[pos] if c == 1 else b"".join(reply[pos : pos + c]))
                pos += c
        else:  # runs of heterogeneous elements: 3 pieces per run
            for c in what:
                fixed.extend(reply[pos : pos + 3] if c == 1 else _joined_runs(reply[pos : pos + 3 * c]))
                pos += 3 * c
    return fixed


def _joined_runs(parts: list[bytes]) -> list[bytes]:
    """The three pieces of one run of heterogeneous elements read from several segments, as one run's."""
    c = len(parts) // 3
    sizes = np.concatenate([np.diff(_i64(parts[3 * j])) for j in range(c)])
    offs = np.zeros(sizes.size + 1, dtype="<i8")
    np.cumsum(sizes, out=offs[1:])
    return [offs.tobytes(), b"".join(parts[1::3]), b"".join(parts[2::3])]


def localize_ranges(segs: Segments, keys: StoreKeys, leaf_of: Callable[[int], LeafShape], buffers: list[list[Piece]]) -> list[list[Piece]]:
    """The byte ranges of a read transaction (MULTI/EXEC of GETRANGE), planned on whole leaves,
    split at segment boundaries and addressed to the segments' keys, each buffer's ranges in order."""
    out = []
    for pieces in buffers:
        new: list[Piece] = []
        for key, starts, lengths in pieces:
            w = _whole_leaf_key(keys, key)
            if w is None or not starts.size:
                new.append((key, starts, lengths))
                continue
            span = segs.per * leaf_of(w[1]).eb
            if span == 0:  # a leaf of zero-size elements: nothing to read anywhere
                new.append((key, starts, lengths))
                continue
            first = starts // span
            if bool(np.all(first == (starts + np.maximum(lengths, 1) - 1) // span)):
                # every range inside one segment (rows, small runs): one piece per stretch of one segment
                cuts = np.flatnonzero(np.diff(first)) + 1
                for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [first.size])).tolist()):
                    seg = int(first[lo])
                    new.append((keys.data(w[1], seg), starts[lo:hi] - seg * span, lengths[lo:hi]))
                continue
            for start, length in zip(starts.tolist(), lengths.tolist()):
                for seg, local, take in segs.split_bytes(start, length, leaf_of(w[1]).eb):
                    new.append((keys.data(w[1], seg), np.array([local], dtype=np.int64), np.array([take], dtype=np.int64)))
        out.append(new)
    return out
