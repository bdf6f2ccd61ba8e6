"""What every data and table key of a store must hold, so that a lost key is reported, never read as zeros.

A key can vanish while its store's header stays: evicted under an evicting
``maxmemory-policy``, deleted by hand, or never written by an upload cut short. A
``SETRANGE`` into a key that is gone would recreate it zero-padded, and reads would return
those zeros as if they had been written. So:

* Every script that writes checks, before its first write, each key it writes in place
  against the length the header implies (``write.lua`` ``ARGV[6]``, built here):
  a homogeneous leaf's blob (or the row block) holds ``elements * element bytes``, an offset
  table ``8 * (elements + 1)`` bytes, a shape table ``8 * ndim * elements``, and a
  heterogeneous leaf's data at least as many bytes as its last offset says.
* Every read checks that each piece came back whole (``read.lua``, and the read
  transactions, which read again through ``read.lua`` when a piece is short).
* A store keeps an *inventory* (``_format.keys.StoreKeys.inventory``): every key that has been
  allocated, and a count of them in the header (``na``). A key that is absent and not
  listed was never allocated: a ring buffer or ``from_schema`` store allocates a segment
  when it is first written, so no call allocates more than about one segment per key, and
  reads of a segment never written return zeros. A listed key that is absent was lost.
  An inventory that lost entries (its size differs from ``na``) can vouch for nothing.

Whatever fails raises :class:`StoreDamagedError`, and nothing is written or recreated.
``tdstore check`` (``inspect_store.audit``) applies the same rules to every key of a store.
This module imports no torch: the command line uses it.
A spread store (segments on several cluster nodes) keeps no inventory: its keys are
allocated up front, and any absent key is a lost one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tdstore._errors import StoreDamagedError
from tdstore._format.keys import StoreKeys

if TYPE_CHECKING:
    from tdstore._format.schema import Header

#: ``write.lua``'s check codes, one (code, length, aux) record of int64 per KEYS entry.
NOT_CHECKED, HET_DATA, EXACT = 0, 1, 2


def expected(role: str, leaf: Any, elements: int) -> tuple[int, int, int]:
    """What key ``role`` (``d``/``o``/``s``) of ``leaf`` in a segment of ``elements`` must hold, as a
    ``(code, length, aux)`` check: ``EXACT`` bytes (aux: a shape table's record size), ``HET_DATA``
    (at least the last offset; aux filled in by the caller) or ``NOT_CHECKED`` (a table of a
    homogeneous leaf, the blob of a leaf living in the row block). ``leaf`` is a ``_format.schema.Leaf``
    or a ``_format.header_info.LeafRecord``: anything with ``shape`` (None: heterogeneous), ``ndim``,
    ``col`` and ``element_nbytes``."""
    if leaf.col is not None:
        return (NOT_CHECKED, 0, 0)
    if leaf.shape is not None:
        return (EXACT, elements * leaf.element_nbytes, 0) if role == "d" else (NOT_CHECKED, 0, 0)
    if role == "d":
        return (HET_DATA, 0, 0)
    if role == "o":
        return (EXACT, 8 * (elements + 1), 0)
    return (EXACT, 8 * leaf.ndim * elements, 8 * leaf.ndim)


def checks(keys: StoreKeys, h: Header, names: list[str], new: Header | None = None) -> bytes:
    """``write.lua``'s ARGV[6] for the call whose KEYS are ``names``: what each key must hold.

    ``h`` is the header the call was planned with and ``new`` the one a schema change leaves:
    a key is checked against the layout its leaf has in ``h`` (what the key holds now), or,
    for a leaf the call creates, in ``new`` (its segments are allocated as the call first
    writes them). Keys that are not data or tables (header, inventory, staging keys) are not
    checked; ``write.lua`` does not check keys that the call sets, allocates or deletes whole.
    """
    out = np.zeros((len(names), 3), dtype="<i8")
    by_number = {}
    for header in (new, h) if new is not None else (h,):
        by_number.update({leaf.number: leaf for leaf in header.leaves.values()})
        if header.block is not None:
            by_number[header.block.number] = header.block
    segs = (new or h).segments
    position: dict[str, int] | None = None
    for i, name in enumerate(names):
        what = keys.describe(name)
        if what is None:
            continue
        role, number, seg = what
        leaf = by_number.get(number)
        if leaf is None or seg >= segs.n:
            continue
        code, length, aux = expected(role, leaf, segs.size(seg))
        if code == HET_DATA:
            if position is None:
                position = {n: j for j, n in enumerate(names)}
            o = position.get(keys.offsets(number, seg))
            if o is None:
                continue
            aux = o + 1
        out[i] = (code, length, aux)
    return out.tobytes()


class ChecksMemo:
    """:func:`checks` of the calls planned from one header, kept while that header is current.

    An element write names the same keys call after call, and what they must hold follows
    from the header alone, so the table is built once per header and key list instead of on
    every call (it was a tenth of an element write's client time). Only calls that keep the
    schema are kept; a stale entry cannot be used, as a new header starts a new memo.
    """

    LIMIT = 256  # key lists kept per header (a store written at many segments keeps the latest)

    def __init__(self) -> None:
        self._state: tuple[Any, dict[tuple[str, ...], bytes]] = (None, {})

    def checks(self, keys: StoreKeys, h: Header, names: list[str], new: Header | None = None) -> bytes:
        if new is not None:
            return checks(keys, h, names, new)
        state = self._state  # one read: another thread may swap in a new header's memo meanwhile
        if state[0] is not h:
            state = (h, {})
            self._state = state
        memo = state[1]
        key = tuple(names)
        out = memo.get(key)
        if out is None:
            if len(memo) >= self.LIMIT:
                memo.clear()
            out = memo[key] = checks(keys, h, names)
        return out


class WrongTypeError(StoreDamagedError):
    """The server's ``WRONGTYPE``: a key of the store holds another kind of value than tdstore keeps there
    (another client wrote it by hand). ``keys`` are those of the call that met it; the engine finds which of
    them it was (``Engine.wrong_type``) and names it and the store."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        super().__init__("a key holds another kind of value than tdstore keeps there (WRONGTYPE)", named=False)
        self.keys = list(keys)


def wrong_types(keys: StoreKeys, found: dict[str, str]) -> str:
    """The detail of a :class:`WrongTypeError`: each key of ``found`` (key -> its type on the server) whose type
    is not the one tdstore keeps under that name (``StoreKeys.value_type``), or a general one if none is."""
    wrong = [
        f"key {key!r} holds a {kind}, where tdstore keeps a {want}"
        for key, kind in found.items()
        if kind != "none" and (want := keys.value_type(key)) is not None and kind != want
    ]
    if not wrong:
        return "a key held another kind of value than tdstore keeps there (WRONGTYPE), changed again since: another client wrote it"
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return f"{'; '.join(wrong[:3])}{more}: another client wrote it (WRONGTYPE)"


def damaged(where: str, detail: str, td_id: str, *, header: bool = False) -> StoreDamagedError:
    """The error a damaged store gives: which store, which key, what to do. ``header``: the store's
    header itself holds a value out of range (a ``HeaderDamagedError``, which is a ``StoreFormatError`` too)."""
    header = header or detail.startswith("header field")
    if header or edited(detail):
        from tdstore._format.header_info import HeaderDamagedError

        return (HeaderDamagedError if header else StoreDamagedError)(
            f"the store with {where} is damaged: {detail}. tdstore never writes such a value (another client edited the "
            f"store by hand); nothing was read or written by this call. 'tdstore check {td_id}' lists what it finds; delete "
            f"the store (clear_redis() or 'tdstore rm {td_id}') and write it again"
        )
    return StoreDamagedError(
        f"the store with {where} has lost data: {detail}. Keys are lost when the server evicts them "
        f"(a maxmemory-policy other than noeviction) or someone deletes them; nothing was read or written by this call. "
        f"'tdstore check {td_id}' lists every lost key; delete the store (clear_redis() or 'tdstore rm {td_id}') "
        f"and write it again, and run the server with maxmemory-policy noeviction"
    )


def edited(detail: str) -> bool:
    """Whether a damage report is about a value out of range (a header field, a tree value, an offset
    table edited by hand: see ``tds_int_field`` in ``lua/_lib.lua``), not a key lost or cut short."""
    return detail.startswith("header field") or "another client" in detail


__all__ = [
    "ChecksMemo",
    "StoreDamagedError",
    "WrongTypeError",
    "wrong_types",
    "checks",
    "damaged",
    "edited",
    "expected",
    "EXACT",
    "HET_DATA",
    "NOT_CHECKED",
]
