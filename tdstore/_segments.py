"""Segments: the stack cut into ranges of elements, each stored under its own hash tag.

A leaf of a store is one blob per segment (plus offset and shape tables when it is
heterogeneous), so no value grows past the segment size, a shape-changing element
write rewrites one segment's tables instead of the whole store's, and on Redis
Cluster the segments spread over the primaries.  Segment ``k`` holds elements
``k * per .. (k + 1) * per - 1``; its tables are local (offsets start at 0).  A store
that fits in one segment (``per >= count``) has exactly one, under the header's tag.

The planners (``_reads``, ``_writes``, ``_ring``) plan in *global* terms: element
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
from typing import Any

import numpy as np

from ._keys import KeyTable, StoreKeys
from ._wire import Piece

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


def row_read_op(segs: Segments, row_bytes: int, rows: int) -> str:
    """'B' or 'X' for reading ``rows`` scattered rows of ``row_bytes`` each (see ROW_BLOB_BYTES)."""
    fetched = min(segs.n, rows) * min(segs.per, segs.count) * row_bytes
    return "B" if fetched <= rows * ROW_BLOB_BYTES else "X"


def het_row_read_op(segs: Segments, ndim: int, rows: int) -> str:
    """'V' or 'Y' for reading ``rows`` scattered elements of a heterogeneous leaf: its offset and
    shape tables (8 + 8 * ndim bytes per element) read whole, or three ranges per row (see ROW_BLOB_BYTES)."""
    return "V" if row_read_op(segs, 8 + 8 * ndim, rows) == "B" else "Y"


#: The most segments a store may have: a call addressed by rows the server picks (a ring write, a
#: sample) names one key per segment and leaf, so a store of millions of segments could not be
#: called at all (65,536 segments of the default 4 MiB hold 256 GiB per key).
MAX_SEGMENTS = 1 << 16


def segment_length(count: int, element_bytes: int, segment_bytes: int) -> int:
    """Elements per segment for elements of at most ``element_bytes`` in their largest leaf; 0 when one segment holds them all."""
    per = max(1, segment_bytes // max(1, element_bytes))
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

    def what(k: int) -> tuple[str, int] | None:
        return _whole_leaf_key(keys, kt.keys[k - 1])

    offsets_set = {}  # leaf number -> offset table an 'S' op of this call sets (global)
    for op in ops:
        if op[0] == "S" and (w := what(op[1])) and w[0] == "o":
            offsets_set[w[1]] = _i64(op[2])
    queued = False
    for op in ops:
        kind = op[0]
        if kind in ("W", "G"):
            if not queued:
                new.append(["Q", segs.per])
                queued = True
            new.append(op)
            continue
        w = what(op[1])
        if w is None:  # already segment-local (a key of another segment): as planned
            # (an 'F' op's second key index is 0 for a homogeneous leaf: no key)
            new.append([kind, *(out.ref(kt.keys[x - 1]) if i in _KEY_ARGS.get(kind, ()) and x else x for i, x in enumerate(op[1:], 1))])
            continue
        role, n = w
        leaf = leaf_of(n)
        if kind in ("D", "T"):
            for seg in range(segs.n):
                new.append([kind, out.ref(keys.leaf_keys(n, seg)["dos".index(role)])])
        elif kind == "R":
            _localize_rows(segs, keys, n, leaf.eb, op, out, new)
        elif kind == "Z":
            unit = op[2] // max(1, segs.count)
            if unit * segs.count != op[2]:
                raise AssertionError(f"a zero blob of {op[2]} bytes is not one size per element of {segs.count}")
            for seg in range(segs.n):
                new.append(["Z", out.ref(keys.data(n, seg)), unit * segs.size(seg)])
        elif kind == "S":
            new.extend(_localize_set(segs, keys, n, role, leaf, op[2], offsets_set.get(n), out))
        elif kind == "F":
            if op[2] == 0:
                for seg, local, length in segs.split_bytes(op[3], op[4] - op[3], leaf.eb):
                    new.append(["F", out.ref(keys.data(n, seg)), 0, local, local + length, op[5]])
            else:
                for seg, lo, hi in segs.split(op[3], op[4]):
                    base = segs.start(seg)
                    new.append(["F", out.ref(keys.data(n, seg)), out.ref(keys.offsets(n, seg)), lo - base, hi - base, op[5]])
        elif kind == "E":
            lo, hi, rec, shapes, data, sizes = op[5], op[6], op[4], op[7], memoryview(op[8]).cast("B"), op[9:]
            pos = 0
            for seg, a, b in segs.split(lo, hi):
                base = segs.start(seg)
                part = sizes[a - lo : b - lo + 1]
                nbytes = sum(part)
                d, o, s = (out.ref(k) for k in keys.leaf_keys(n, seg))
                new.append(
                    ["E", d, o, s, rec, a - base, b - base, shapes[(a - lo) * rec : (b - lo + 1) * rec], data[pos : pos + nbytes], *part]
                )
                pos += nbytes
        elif kind in ("X", "K"):
            new.append([kind, out.block([keys.data(n, seg) for seg in range(segs.n)]), *op[2:]])
        elif kind == "C":
            target = what(op[2])
            assert target is not None
            for seg in range(segs.n):
                new.append(["C", out.ref(keys.data(n, seg)), out.ref(keys.data(target[1], seg)), *op[3:]])
        elif kind == "O":  # a key copied to another leaf number's: in every segment
            target = what(op[2])
            assert target is not None
            for seg in range(segs.n):
                new.append(
                    [
                        "O",
                        out.ref(keys.leaf_keys(n, seg)["dos".index(role)]),
                        out.ref(keys.leaf_keys(target[1], seg)["dos".index(target[0])]),
                    ]
                )
        elif kind == "Y":
            blocks = [out.block([keys.leaf_keys(n, seg)[r] for seg in range(segs.n)]) for r in range(3)]
            new.append(["Y", *blocks, *op[4:]])
        else:
            raise AssertionError(f"cannot localize write op {kind!r}")
    return out, new


# arguments (1-based positions within an op) that are key indices, for ops passed through
_KEY_ARGS = {"R": (1,), "S": (1,), "D": (1,), "T": (1,), "Z": (1,), "F": (1, 2), "E": (1, 2, 3), "C": (1, 2), "O": (1, 2), "P": (1, 2)}


def _localize_rows(segs: Segments, keys: StoreKeys, n: int, eb: int, op: list[Any], out: KeyTable, new: list[list[Any]]) -> None:
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
    for seg, (lo, ln, parts) in per_seg.items():
        new.append(["R", out.ref(keys.data(n, seg)), len(lo), _pairs(lo, ln), parts[0] if len(parts) == 1 else b"".join(parts)])


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
        ops.append(["S", out.ref(key), part])
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
    nops, a = int(args[0]), 1
    queued = False
    for _ in range(nops):
        kind = args[a]
        if kind in ("U", "I", "P", "F"):
            if not queued:
                new += ["Q", segs.per]
                queued = True
            size = _READ_OP_SIZES[kind]
            op = list(args[a : a + size])
            if kind == "P":  # its tree and sample-count keys
                op[3], op[4] = out.ref(kt_keys[int(op[3]) - 1]), out.ref(kt_keys[int(op[4]) - 1])
            new += op
            merges.append(("pass", {"U": 2, "I": 0, "P": 4, "F": 2}[kind]))
            a += size
            continue
        if kind == "T":  # planned on a segment's own offset table already
            new += ["T", out.ref(kt_keys[int(args[a + 1]) - 1])]
            merges.append(("pass", 1))
            a += 2
            continue
        w = _whole_leaf_key(keys, kt_keys[int(args[a + 1]) - 1])
        if kind == "R":
            k, count, ranges, join = args[a + 1 : a + 5]
            a += 5
            if w is None:
                new += ["R", out.ref(kt_keys[k - 1]), count, ranges, join]
                merges.append(("pass", 1 if join == "1" else count))
                continue
            n = w[1]
            pieces_per_range, groups = [], []  # groups: (segment, [(local, length)])
            for start, length in _i64(ranges).reshape(-1, 2).tolist():
                c = 0
                # an empty range (elements of zero bytes) still has its piece in the reply
                pieces = list(segs.split_bytes(start, length, leaf_of(n).eb)) or [(groups[-1][0] if groups else 0, 0, 0)]
                for seg, local, take in pieces:
                    if groups and groups[-1][0] == seg:
                        groups[-1][1].append((local, take))
                    else:
                        groups.append((seg, [(local, take)]))
                    c += 1
                pieces_per_range.append(c)
            for seg, rs in groups:
                new += ["R", out.ref(keys.data(n, seg)), len(rs), _pairs([r[0] for r in rs], [r[1] for r in rs]), join]
            merges.append(("join", len(groups)) if join == "1" else ("ranges", pieces_per_range))
        elif kind == "E":
            kd, ko, ks, rec, count, runs = args[a + 1 : a + 7]
            a += 7
            if w is None:
                new += ["E", out.ref(kt_keys[kd - 1]), out.ref(kt_keys[ko - 1]), out.ref(kt_keys[ks - 1]), rec, count, runs]
                merges.append(("pass", 3 * count))
                continue
            n = w[1]
            pieces_per_run, egroups = [], []
            for lo, hi in _i64(runs).reshape(-1, 2).tolist():
                c = 0
                for seg, x, y in segs.split(lo, hi):
                    base = segs.start(seg)
                    if egroups and egroups[-1][0] == seg:
                        egroups[-1][1].append((x - base, y - base))
                    else:
                        egroups.append((seg, [(x - base, y - base)]))
                    c += 1
                pieces_per_run.append(c)
            for seg, rs in egroups:
                d, o, s = (out.ref(key) for key in keys.leaf_keys(n, seg))
                new += ["E", d, o, s, rec, len(rs), _pairs([r[0] for r in rs], [r[1] for r in rs])]
            merges.append(("runs", pieces_per_run))
        elif kind in ("X", "B"):
            n = w[1]  # type: ignore[index]
            new += [kind, out.block([keys.data(n, seg) for seg in range(segs.n)]), args[a + 2]]
            merges.append(("pass", 1))
            a += 3
        elif kind in ("Y", "V"):
            n = w[1]  # type: ignore[index]
            blocks = [out.block([keys.leaf_keys(n, seg)[r] for seg in range(segs.n)]) for r in range(3)]
            new += [kind, *blocks, args[a + 4]]
            merges.append(("pass", 3))
            a += 5
        else:
            raise AssertionError(f"cannot localize read op {kind!r}")
    n_new = sum(1 for _ in _ops(new))  # ops as sent (one planned op may become several)

    def merge(reply: list) -> list:
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
                    if c == 1:
                        fixed.extend(reply[pos : pos + 3])
                    else:
                        parts = reply[pos : pos + 3 * c]
                        sizes = np.concatenate([np.diff(_i64(parts[3 * j])) for j in range(c)])
                        offs = np.zeros(sizes.size + 1, dtype="<i8")
                        np.cumsum(sizes, out=offs[1:])
                        fixed += [offs.tobytes(), b"".join(parts[1::3]), b"".join(parts[2::3])]
                    pos += 3 * c
        return fixed

    return out.keys, [n_new, *new], merge


#: Arguments of each ``read.lua`` op, its marker included (see the script's header).
_READ_OP_SIZES = {"R": 5, "E": 7, "U": 3, "P": 8, "F": 3, "I": 3, "X": 3, "B": 3, "Y": 5, "V": 5, "T": 2, "Q": 2}


def _ops(flat: list[Any]) -> Iterator[str]:
    """The op kinds of a flat read op list (to count them)."""
    a = 0
    while a < len(flat):
        yield flat[a]
        a += _READ_OP_SIZES[flat[a]]


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
