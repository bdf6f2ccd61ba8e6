"""Planning ``store[i] = td`` of one element whose keys exist: one SETRANGE per homogeneous leaf (the whole
row of the row block as one), one splice per heterogeneous one, without the general planner.

What depends only on the header and the keys written is found once per header (:class:`_ElementTemplate`);
anything else (new keys, a key changing shape, bad input) goes to :func:`tdstore._plan.write_plan.plan_write`.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from tdstore._format import codec, row_block
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan import index
from tdstore._plan.leaf_writes import (
    Value,
    element_op,
)


class _ElementTemplate:
    """What ``store[i] = td`` of one key set into one segment needs from the header, found once.

    ``entries`` follow the value's keys in order: ``(leaf, kind, keys)`` with kind ``"het"``
    (keys: data, offsets, shapes), ``"row"`` (a grouped leaf) or ``"blob"`` (keys: its data key).
    ``row`` is the block's data key and ``order`` the grouped entries sorted by column when they
    tile the whole row without gaps (their bytes are joined as they are), else None.
    """

    __slots__ = ("entries", "whole", "row", "order")

    def __init__(self, keys: StoreKeys, h: Header, seg: int, paths: tuple[NestedPath, ...]) -> None:
        self.entries: list[tuple[Leaf, str, tuple[str, ...]]] | None = []
        grouped = []
        for j, path in enumerate(paths):
            leaf = h.leaves.get(path)
            if leaf is None:
                self.entries = None  # a new key: the general planner
                break
            if leaf.het:
                self.entries.append((leaf, "het", keys.leaf_keys(leaf.number, seg)))
            elif leaf.col is not None:
                self.entries.append((leaf, "row", ()))
                grouped.append((leaf.col, leaf.element_nbytes, j))
            else:
                self.entries.append((leaf, "blob", (keys.data(leaf.number, seg),)))
        self.whole = bool(grouped) and row_block.covers_block(h, paths)
        self.row = keys.data(h.row[0], seg) if h.row is not None else None
        self.order: list[int] | None = None
        if self.whole and h.row is not None:
            pos, order = 0, []
            for col, nb, j in sorted(grouped):
                if col != pos:
                    break
                pos += nb
                order.append(j)
            else:
                self.order = order if pos == h.row[1] else None


#: Templates of the last few headers: ``{id(header): (header, {(key base, segment, paths): template})}``
#: (the header is held, so its id names it while it is here).
_TEMPLATES: dict[int, tuple[Header, dict[tuple[str, int, tuple[NestedPath, ...]], _ElementTemplate]]] = {}


def _template(keys: StoreKeys, h: Header, seg: int, paths: tuple[NestedPath, ...]) -> _ElementTemplate:
    held = _TEMPLATES.get(id(h))
    if held is None or held[0] is not h:
        if len(_TEMPLATES) >= 16:
            _TEMPLATES.clear()
        held = _TEMPLATES[id(h)] = (h, {})
    memo = held[1]
    at = (keys.base, seg, paths)
    t = memo.get(at)
    if t is None:
        if len(memo) >= 256:
            memo.clear()
        t = memo[at] = _ElementTemplate(keys, h, seg, paths)
    return t


def plan_element_write(
    keys: StoreKeys, h: Header, element: int, items: dict[NestedPath, Value], kt: KeyTable
) -> tuple[None, list[list[Any]], list[Leaf]] | None:
    """``store[i] = td`` of existing keys: one SETRANGE per homogeneous leaf that keeps its shape, one splice per heterogeneous one.

    The common actor write skips the general planner; None hands anything else
    (new keys, a homogeneous key changing shape, bad input) to :func:`tdstore._plan.write_plan.plan_write`. What
    depends only on the header and the keys written is found once (:class:`_ElementTemplate`).
    """
    if h.stack_pos != 0 or h.inner or not 0 <= element < h.count:
        return None
    seg = h.segments.of(element)
    local = element - h.segments.start(seg)  # the element lives in one segment: address it there
    t = _template(keys, h, seg, tuple(items))
    if t.entries is None:
        return None
    ops: list[list[Any]] = []
    touched = []
    grouped: list[tuple[Leaf, Any]] = []
    by_position: dict[int, Any] = {}  # bytes of the grouped leaves, by position in the value
    for j, ((leaf, kind, names), value) in enumerate(zip(t.entries, items.values())):
        if kind == "het":
            # one element of a heterogeneous (or non-tensor) key: one splice, sized on the server
            if leaf.json and isinstance(value, NonTensor):
                v = element_docs(leaf.path, value, None, 0)[0]
            elif not leaf.json and isinstance(value, torch.Tensor) and value.dtype == leaf.dtype and value.ndim == leaf.ndim:
                v = value
            else:
                return None
            data = codec.to_bytes(v)
            d, o, s = kt.ref(names[0]), kt.ref(names[1]), kt.ref(names[2])
            ops.append(Write.E(d, o, s, 8 * leaf.ndim, local, local, struct.pack(f"<{v.ndim}q", *v.shape), data, len(data)))
        elif not isinstance(value, torch.Tensor) or value.dtype != leaf.dtype or value.shape != leaf.shape:
            return None
        elif kind == "row":
            data = by_position[j] = codec.to_bytes(value)
            grouped.append((leaf, data))
        else:
            ops.extend(element_op(kt, keys, leaf, element, value, h))
        touched.append(leaf)
    if grouped:
        if t.whole and t.order is not None and t.row is not None and h.row is not None:
            # the whole row, its columns back to back: one SETRANGE of their bytes joined
            width = h.row[1]
            row = b"".join([by_position[j] for j in t.order]) if len(t.order) > 1 else by_position[t.order[0]]
            ops.append(Write.R(kt.ref(t.row), 1, index.PAIR.pack(local * width, width), row))
        else:
            ops.extend(_element_row_ops(kt, keys, h, seg, local, grouped, t.whole))
    return None, ops, touched


def _element_row_ops(
    kt: KeyTable, keys: StoreKeys, h: Header, seg: int, local: int, grouped: list[tuple[Leaf, Any]], whole: bool
) -> list[list[Any]]:
    """Grouped leaves of one element (segment-local): its whole row as one SETRANGE when every live
    column is written, else one per column."""
    assert h.row is not None
    number, width = h.row
    key = kt.ref(keys.data(number, seg))
    if whole:
        packed = _packed_row(width, grouped)
        if packed is None:  # gaps between the columns (keys deleted from the block): zeros there
            packed = row_block.join(width, [(leaf, np.frombuffer(data, dtype=np.uint8).reshape(1, -1)) for leaf, data in grouped]).tobytes()
        return [Write.R(key, 1, index.PAIR.pack(local * width, width), packed)]
    ops = []
    for leaf, data in grouped:
        assert leaf.col is not None  # a grouped leaf has its column
        if len(data):
            ops.append(Write.R(key, 1, index.PAIR.pack(local * width + leaf.col, len(data)), data))
    return ops


def _packed_row(width: int, grouped: list[tuple[Leaf, Any]]) -> bytes | None:
    """One row of the block as its columns' bytes joined, when they tile it without gaps (the usual
    block); None otherwise. A join of a few buffers instead of a zeroed numpy row and a copy per column."""
    parts = sorted(grouped, key=lambda g: g[0].col or 0)  # grouped leaves: each has its column
    pos = 0
    for leaf, data in parts:
        if leaf.col != pos:
            return None
        pos += len(data)
    return b"".join([data for _, data in parts]) if pos == width else None
