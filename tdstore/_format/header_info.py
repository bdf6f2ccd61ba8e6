"""A store header read without torch: what ``tdstore ls``, ``info`` and ``rm`` need.

:class:`tdstore._format.schema.Header` is what a store handle works with; it holds torch
dtypes and sizes, so importing it imports torch (about 2 s).  The command line
only shows headers and deletes stores, so it reads them here instead: the same
checks as ``Header.from_fields``, with dtypes kept as their allow-listed names
(``tests/format/test_headerinfo.py`` holds the two readers to the same verdicts).
Nothing read from the server is imported, evaluated or unpickled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tdstore._errors import StoreDamagedError
from tdstore._format.sampling_policy import UNBOUNDED, SamplingPolicy
from tdstore._format.trajectories import Trajectories

__all__ = [
    "FORMATS",
    "ITEMSIZE",
    "MAX_INT",
    "HeaderDamagedError",
    "HeaderInfo",
    "LeafRecord",
    "StoreFormatError",
    "check_new_layout",
    "float_field",
    "int_field",
    "parse_header",
]

FORMATS = ("1", "2", "3")
"""Header formats this tdstore reads (see ``_format.schema``: ``3`` is a spread store)."""
FORMAT_PLAIN, FORMAT_SPREAD = "1", "3"

#: Bytes per element of every allow-listed dtype (``_format.codec.DTYPES``), by name.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


class StoreFormatError(RuntimeError):
    """The server holds metadata that this version of tdstore cannot read safely."""

    __module__ = "tdstore"  # its public home: pickles name it there


class HeaderDamagedError(StoreFormatError, StoreDamagedError):
    """A header field holds a value tdstore never writes (edited by hand): a :class:`StoreDamagedError`
    naming the field, and a :class:`StoreFormatError` (what a header this tdstore cannot read raises)."""

    def __init__(self, message: str, *, named: bool = True) -> None:
        StoreDamagedError.__init__(self, message, named=named)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


#: Counters and sizes stay below 2**53, where a double (the scripts' numbers) is exact.
MAX_INT = 2**53
#: The most elements a store is made with (a new store's count, checked by :func:`check_new_layout`).
MAX_COUNT = 2**40
_INT = re.compile(r"-?[0-9]+")


def _text(v: bytes | str | None) -> str | None:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def int_field(raw: bytes | str | None, name: str, lo: int = 0, hi: int = MAX_INT, default: int | None = None) -> int:
    """Header field ``name`` (raw value ``raw``, None when absent) as an integer in ``lo..hi``: plain
    decimal digits as HINCRBY writes them (no ``+``, leading zero or ``-0``), as ``tds_int_field`` in
    ``lua/_lib.lua`` reads it; ``default`` when absent
    (None: required). Anything else raises :class:`HeaderDamagedError` naming the field."""
    v = _text(raw)
    if v is None:
        if default is not None:
            return default
        raise HeaderDamagedError(f"header field {name} is missing")
    if not _INT.fullmatch(v) or str(int(v)) != v or not lo <= int(v) <= hi:  # canonical: fields compared as strings
        raise HeaderDamagedError(f"header field {name} holds {v[:40]!r}, not an integer in {lo}..{hi}")
    return int(v)


def float_field(raw: bytes | str | None, name: str, lo: float, hi: float, default: float) -> float:
    """Header field ``name`` as a finite number in ``lo..hi`` (``tds_float_field``); ``default`` when absent."""
    v = _text(raw)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and lo <= x <= hi):
        raise HeaderDamagedError(f"header field {name} holds {v[:40]!r}, not a finite number in {lo:g}..{hi:g}")
    return x


def check_new_layout(count: Any, stack_dim: Any, inner_batch_size: Any) -> tuple[int, tuple[int, ...]]:
    """A new store's count, stack dim and inner batch size as the constructors accept them (``ValueError``,
    ``TypeError`` otherwise); returns the count and the inner batch size as a tuple of ints. Checkpoints
    are held to the same (``_checkpoint.disk_format``), so a restore makes only stores a constructor could."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int (a lazy stack has at least one element), got {count!r}")
    if count > MAX_COUNT:
        raise ValueError(f"count {count} is too large (at most 2**40 elements)")
    try:
        inner = tuple(int(i) for i in inner_batch_size)
    except TypeError:
        raise TypeError(f"inner_batch_size must be a sequence of ints, got {inner_batch_size!r}") from None
    if any(i < 0 for i in inner):
        raise ValueError(f"inner_batch_size must hold non-negative sizes, got {list(inner)}")
    if isinstance(stack_dim, bool) or not isinstance(stack_dim, int) or not -(len(inner) + 1) <= stack_dim <= len(inner):
        raise ValueError(f"stack_dim {stack_dim!r} is out of range for an inner batch size of {len(inner)} dims")
    return count, inner


def _check_counters(f: Mapping[str, str], leaves: list[LeafRecord]) -> None:
    """The ring's counters and the guard fields the scripts compute with, in range (see ``tds_ring_fields``):
    ``rw`` >= 0, ``rr``, ``lb`` and ``ho`` at most ``rw``, ``sn`` and ``na`` >= 0, ``pm`` finite, each ``lv:<n>``
    the version its leaf record holds (else every call on the leaf would be answered STALE)."""
    rw = int_field(f.get("rw"), "rw", default=0)
    int_field(f.get("rr"), "rr", 0, rw, default=0)
    int_field(f.get("lb"), "lb", 0, rw, default=0)
    int_field(f.get("ho"), "ho", 0, rw, default=0)  # rows a restore left absent (lua/_absent.lua)
    int_field(f.get("sn"), "sn", default=0)
    int_field(f.get("na"), "na", default=0)
    float_field(f.get("pm"), "pm", 0.0, UNBOUNDED, 1.0)
    for leaf in leaves:
        if int_field(f.get(f"lv:{leaf.number}"), f"lv:{leaf.number}", default=leaf.version) != leaf.version:
            raise HeaderDamagedError(
                f"header field lv:{leaf.number} holds {f[f'lv:{leaf.number}']!r}, its leaf record version {leaf.version}"
            )


@dataclass(frozen=True)
class LeafRecord:
    """One leaf of a header: its dtype as a name, ``shape`` None when it varies per element."""

    path: tuple[str, ...]
    number: int
    dtype: str
    ndim: int
    shape: tuple[int, ...] | None
    json: bool = False
    col: int | None = None
    version: int = 0

    @property
    def element_nbytes(self) -> int:
        assert self.shape is not None
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class HeaderInfo:
    """The facts of a header that an inspection shows (see ``_format.schema.Header`` for their meaning)."""

    version: int
    count: int
    stack_dim: int
    inner: tuple[int, ...]
    device: str
    kind: str
    leaves: tuple[LeafRecord, ...]
    next_leaf: int
    state: str
    epoch: str
    tensorclass: str
    seg: int
    spread: bool
    row: tuple[int, int] | None
    batchless: bool = False
    keyset_version: int = 1
    tracked: bool = False
    """The store keeps an inventory of its keys (header field ``na``, see ``_format.integrity``)."""
    sampling: SamplingPolicy | None = None
    """The ring's sampling policy (header field ``sc``, see ``_format.sampling_policy``), if it has one."""
    trajectories: Trajectories | None = None
    """The key that tells the ring's trajectories apart (header field ``tj``, see ``_format.trajectories``)."""
    leased: bool = False
    """A leased pop ran on the ring (header field ``ls``): every pop goes through the lease table."""
    distinct: bool = False
    """The ring tracks distinct rows sampled (header field ``sd`` = ``1``, ``lua/distinct.lua``)."""
    absent_rows: bool = False
    """The ring was restored with rows absent (header field ``ho``, see ``lua/_absent.lua``)."""
    rollouts: bool = False
    """The ring keeps a rollout index (header field ``ro``, ``lua/_rollouts.lua``): its writes stamp rows, its samples
    and pops take read.lua's 'G'."""

    @property
    def segments(self) -> int:
        """Number of segments (``Segments(count, seg or count).n``)."""
        per = self.seg or max(self.count, 1)
        return max(1, -(-self.count // per))


def _leaf(rec: dict) -> LeafRecord:
    """One leaf record of the schema, checked (``_format.schema.Header.from_fields`` makes it a ``Leaf``)."""
    path = rec["path"]
    if not isinstance(path, list) or not path or not all(isinstance(p, str) for p in path):
        raise StoreFormatError(f"bad leaf path {path!r}")
    number, ndim, shape, version = rec["n"], rec["ndim"], rec.get("shape"), rec.get("v", 0)
    if not isinstance(number, int) or number < 0 or not isinstance(ndim, int) or ndim < 0 or not isinstance(version, int):
        raise StoreFormatError(f"bad leaf record {rec!r}")
    if shape is not None:
        if not isinstance(shape, list) or len(shape) != ndim or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise StoreFormatError(f"bad leaf shape in {rec!r}")
        shape = tuple(shape)
    json_leaf = rec.get("nt", 0) == 1
    dtype = rec["dtype"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r} in the store metadata (not one of tdstore's dtypes)")
    if json_leaf and (dtype != "uint8" or ndim != 1 or shape is not None):
        raise StoreFormatError(f"bad non-tensor leaf record {rec!r}")
    col = rec.get("col")
    if col is not None and (not isinstance(col, int) or isinstance(col, bool) or col < 0 or shape is None or json_leaf):
        raise StoreFormatError(f"bad row-block column in {rec!r}")
    return LeafRecord(tuple(path), number, dtype, ndim, shape, json_leaf, col, version)


#: The state of a store being deleted in batches (a tombstone, see ``lua/clear.lua``).
DELETING = "deleting"


def parse_header(raw: Mapping[bytes | str, bytes | str]) -> HeaderInfo:
    """Parse and check a header hash read from the server, as ``Header.from_fields`` does.

    Anything unexpected raises :class:`StoreFormatError` instead of being guessed at.
    """
    f = {
        (k.decode(errors="replace") if isinstance(k, bytes) else k): (v.decode(errors="replace") if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }
    fmt = f.get("format")
    if fmt not in FORMATS:
        if fmt is not None and fmt.isdigit() and fmt.isascii():  # a format of a newer tdstore
            raise StoreFormatError(f"store header has format {fmt!r}; this tdstore reads formats {', '.join(map(repr, FORMATS))}")
        raise HeaderDamagedError(f"header field format holds {fmt!r}, not one of {', '.join(map(repr, FORMATS))}")
    try:
        return _parse_fields(f, fmt)
    except HeaderDamagedError:
        raise
    except StoreFormatError as err:  # a value tdstore never writes: the store is damaged
        raise HeaderDamagedError(str(err)) from None


def _parse_fields(f: dict[str, str], fmt: str) -> HeaderInfo:
    """:func:`parse_header` once the format is known."""
    count = int_field(f.get("count"), "count")
    stack_dim = int_field(f.get("stack_dim"), "stack_dim", -MAX_INT, MAX_INT)
    # a tombstone (clear.lua cut in batches) has no version: it only tells which keys are left
    version = int_field(f.get("version"), "version", default=0 if f.get("state") == DELETING else None)
    keyset_version = int_field(f.get("kv"), "kv")
    seg = int_field(f.get("seg"), "seg", default=0)
    for name in ("inner", "schema", "type", "epoch"):
        if name not in f:
            raise HeaderDamagedError(f"header field {name} is missing")
    try:
        inner = json.loads(f["inner"])
    except ValueError:
        raise HeaderDamagedError(f"header field inner holds {f['inner'][:40]!r}, not a JSON list of sizes") from None
    try:
        schema = json.loads(f["schema"])
    except ValueError:
        raise HeaderDamagedError(f"header field schema is corrupt: {f['schema'][:40]!r} is not JSON") from None
    kind = f["type"]
    state = f.get("state", "ready")
    if kind not in ("lazy", "dense"):
        raise HeaderDamagedError(f"header field type holds {kind[:40]!r}, not 'lazy' or 'dense'")
    if state not in ("ready", DELETING) and not state.startswith("uploading:"):
        raise HeaderDamagedError(f"header field state holds {state[:40]!r}, not 'ready', '{DELETING}' or 'uploading:<token>'")
    epoch = f["epoch"]
    tensorclass = f.get("tensorclass", "")
    _check_layout(epoch, count, inner, seg, stack_dim)
    row = _row_block(schema, fmt)
    leaves = _leaves(schema, row, inner)
    _check_counters(f, leaves)
    try:
        sampling = SamplingPolicy.from_json(f.get("sc"))
    except (ValueError, TypeError) as err:
        raise HeaderDamagedError(f"header field sc holds a bad sampling policy: {err}") from None
    try:
        trajectories = Trajectories.from_json(f.get("tj"))
    except (ValueError, TypeError) as err:
        raise HeaderDamagedError(f"header field tj holds a bad trajectory setting: {err}") from None
    if f.get("sd", "1") != "1":
        raise HeaderDamagedError(f"header field sd holds {f['sd'][:40]!r}, not '1' (distinct rows tracked) or absent")
    return HeaderInfo(
        version=version,
        count=count,
        stack_dim=stack_dim,
        inner=tuple(inner),
        device=f.get("device", ""),
        kind=kind,
        leaves=tuple(leaves),
        next_leaf=schema["next"],
        state=state,
        epoch=epoch,
        tensorclass=tensorclass if all(part.isidentifier() for part in tensorclass.split(".")) else "",
        seg=seg,
        spread=fmt == FORMAT_SPREAD,
        row=(row[0], row[1]) if row is not None else None,
        batchless=f.get("batchless") == "1",
        keyset_version=keyset_version,
        tracked="na" in f,
        sampling=sampling,
        trajectories=trajectories,
        leased="ls" in f,
        distinct="sd" in f,
        absent_rows="ho" in f,
        rollouts="ro" in f,
    )


def _check_layout(epoch: str, count: int, inner: Any, seg: int, stack_dim: int) -> None:
    """The header's scalar fields: a hex epoch, the element count, the inner batch size (a JSON
    value, checked to be a list of sizes), the segment length and a stack dim within the batch dims."""
    if not epoch or any(c not in "0123456789abcdef" for c in epoch):
        raise StoreFormatError(f"store header has a bad epoch {epoch!r}")
    if count < 0 or not isinstance(inner, list) or not all(isinstance(i, int) and i >= 0 for i in inner):
        raise StoreFormatError(f"store header has a bad count or inner batch size: {count!r}, {inner!r}")
    if seg < 0:
        raise StoreFormatError(f"store header has a bad segment length {seg}")
    if not -(len(inner) + 1) <= stack_dim <= len(inner):
        raise StoreFormatError(f"store header has a bad stack_dim {stack_dim}")


def _row_block(schema: Any, fmt: str) -> list[int] | None:
    """The schema's row block ``[leaf number, width]``, or None; ``schema`` (a JSON value) is checked
    to hold a leaf list and the next leaf number, which the row block's number must be below."""
    if not isinstance(schema, dict) or not isinstance(schema.get("leaves"), list) or not isinstance(schema.get("next"), int):
        raise StoreFormatError("store header has a corrupt schema")
    row = schema.get("row")
    if row is not None and fmt == FORMAT_PLAIN:
        raise StoreFormatError(f"store header of format {fmt!r} has a row block")
    if row is not None and not (
        isinstance(row, list)
        and len(row) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        and row[0] < schema["next"]
    ):
        raise StoreFormatError(f"store header has a bad row block {row!r}")
    return row


def _leaves(schema: dict[str, Any], row: list[int] | None, inner: list[int]) -> list[LeafRecord]:
    """The schema's leaf records: distinct paths and numbers below the next leaf number, row-block
    columns that fit the row without overlapping, and tensor shapes that start with ``inner``."""
    try:
        leaves = [_leaf(rec) for rec in schema["leaves"]]
    except (KeyError, TypeError, ValueError) as err:
        raise StoreFormatError(f"store header has a corrupt leaf record: {err}") from None
    numbers = {leaf.number for leaf in leaves}
    if len({leaf.path for leaf in leaves}) != len(leaves) or len(numbers) != len(leaves) or any(n >= schema["next"] for n in numbers):
        raise StoreFormatError("store header has duplicate leaves or leaf numbers")
    end = 0
    for leaf in sorted((lf for lf in leaves if lf.col is not None), key=lambda lf: lf.col or 0):
        assert leaf.col is not None
        if row is None or row[0] in numbers or inner or leaf.col < end or leaf.col + leaf.element_nbytes > row[1]:
            raise StoreFormatError(
                f"leaf {leaf.path} has a row-block column that the header's row block {row!r} cannot hold (or that overlaps another)"
            )
        end = leaf.col + leaf.element_nbytes
    for leaf in leaves:
        if leaf.json:
            continue
        if leaf.ndim < len(inner) or (leaf.shape is not None and list(leaf.shape[: len(inner)]) != inner):
            raise StoreFormatError(f"leaf {leaf.path} does not start with the inner batch size {inner}")
    return leaves


def ring_writes(rw: int, na: int | None, has_leaves: bool, count: int) -> int:
    """The ring write count every ring call works with, from the header's ``rw`` (``tds_ring_rw``
    in ``lua/_lib.lua`` derives the same on the server).

    A store that holds data the ring never wrote (``rw`` 0: written by index, or uploaded by an
    older tdstore) is a full ring of ``count`` slots written once each, so its first ``extend``
    overwrites slot 0, the oldest. A store whose keys hold no data yet (a ring before its first
    ``extend``, a ``from_schema`` store never written) has written nothing. Holding data: an
    inventory (``na``) that lists a key; a store without one holds data when it has keys.
    """
    if rw > 0:
        return rw
    holds = na > 0 if na is not None else has_leaves
    return count if holds else 0


RAGGED = -1
"""A sub-tree batch dim that varies between elements (``Header.sub``, ``_format.schema``)."""

_MAX_NAME = 1000


def parse_classes(raw: object) -> dict[tuple[str, ...], str]:
    """The ``"tc"`` entry of the schema JSON: ``[[path, "module.QualName"], ...]`` (``ValueError`` when malformed)."""
    if not isinstance(raw, list):
        raise ValueError(f"bad sub-tree tensorclasses {raw!r}"[:300])
    out: dict[tuple[str, ...], str] = {}
    for rec in raw:
        if not (
            isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], list) and rec[0] and all(isinstance(p, str) for p in rec[0])
        ):
            raise ValueError(f"bad sub-tree tensorclass record {rec!r}"[:300])
        name = rec[1]
        if not (
            isinstance(name, str) and len(name) <= _MAX_NAME and len(name.split(".")) > 1 and all(x.isidentifier() for x in name.split("."))
        ):
            raise ValueError(f"bad sub-tree tensorclass name {name!r}"[:300])
        out[tuple(rec[0])] = name
    return out
