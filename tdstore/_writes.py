"""Write planning: from (index, values) to the ops of one ``write.lua`` call.

Everything that can be wrong with a write (unknown key, dtype, shape, ndim,
element count, inner batch size) is found here, before anything is sent, so a bad
write raises with the key and the shapes in the message and the store is left as
it was.  Values are never cast or broadcast.

A value arrives per leaf path either *dense* (one tensor whose leading dims are
the indexed batch shape) or *per element* (a list of tensors, one per element the
index names along the stack dim, as a lazy stack whose elements differ gives).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import torch

from . import _codec, _index, _rows
from ._keys import KeyTable, StoreKeys
from ._nontensor import NonTensor, element_docs
from ._schema import Header, Leaf, NestedPath, check_paths

Value = torch.Tensor | list[torch.Tensor]


def _name(path: NestedPath) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def element_order(p: _index.Plan, norm: tuple[_index.Component, ...]) -> list[int]:
    """The element ids along the stack dim in the order the value holds them."""
    s = norm[p.stack_pos]
    if isinstance(s, int):
        return [s]
    if isinstance(s, slice):
        return list(range(s.start, s.stop, s.step))
    if s.ndim != 1:
        raise NotImplementedError("writing whole elements with a multi-dimensional index tensor; flatten the index first")
    return [int(i) for i in s.tolist()]


def _rows_op(kt: KeyTable, key: str, rows: np.ndarray, data: np.ndarray) -> list[Any] | None:
    """One 'R' op writing ``data[k]`` (a uint8 row) at row ``rows[k]``; a later duplicate wins.

    None when there is nothing to write (no rows, or rows of zero bytes).

    Rows are grouped into runs of consecutive rows, one SETRANGE each on the server;
    the ranges travel packed in one argument and the bytes back to back in another.
    """
    rb = data.shape[1] if data.ndim == 2 else 0
    if rows.size == 0 or rb == 0:
        return None
    if rows.size and int(rows[-1]) - int(rows[0]) == rows.size - 1 and (rows.size == 1 or bool(np.all(np.diff(rows) == 1))):
        # one contiguous ascending run (an element, a slice): a single SETRANGE
        ranges = _index.pack_pairs(np.array([int(rows[0]) * rb]), np.array([rows.size * rb]))
        return ["R", kt.ref(key), 1, ranges, memoryview(np.ascontiguousarray(data)).cast("B")]
    # keep the last occurrence of each row, as sequential assignment would
    uniq, first_in_rev = np.unique(rows[::-1], return_index=True)
    data = np.ascontiguousarray(data[rows.size - 1 - first_in_rev])
    lo, hi = _index.run_bounds(uniq)
    return ["R", kt.ref(key), int(lo.size), _index.pack_pairs(lo * rb, (hi - lo + 1) * rb), memoryview(data).cast("B")]


def _as_rows(t: torch.Tensor, lead: int) -> np.ndarray:
    """A (rows, bytes per row) uint8 view of ``t`` whose first ``lead`` dims are rows."""
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    n = int(np.prod(t.shape[:lead])) if lead else 1
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return raw.reshape(n, -1) if n else np.zeros((0, 0), np.uint8)


def check_dtype(path: NestedPath, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"key {_name(path)} holds {_codec.dtype_name(dtype)}, got {t.dtype}; cast the value explicitly (no silent casts)")


def _het_tables(inner: tuple[int, ...], elems: list[torch.Tensor]) -> tuple[bytes, bytes, bytes]:
    """Data, offset table and shape table of a heterogeneous leaf built from element tensors."""
    shapes, data, sizes = het_payload(elems)
    offsets = np.zeros(len(elems) + 1, dtype="<i8")
    np.cumsum(sizes, out=offsets[1:])
    return data, offsets.tobytes(), shapes


def element_checks(h: Header, path: NestedPath, elems: list[torch.Tensor], ndim: int | None, dtype: torch.dtype | None) -> None:
    inner = h.inner
    for k, t in enumerate(elems):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"key {_name(path)}: element {k} is a {type(t).__name__}, not a tensor")
        if dtype is not None:
            check_dtype(path, t, dtype)
        if tuple(t.shape[: len(inner)]) != inner:
            raise ValueError(f"key {_name(path)}: element shape {list(t.shape)} does not start with the inner batch size {list(inner)}")
        if ndim is not None and t.ndim != ndim:
            raise ValueError(
                f"key {_name(path)} has {ndim} dims per element, got a tensor of shape {list(t.shape)} (the number of dims cannot change)"
            )


def plan_full_leaf(keys: StoreKeys, h: Header, path: NestedPath, value: Value, number: int, kt: KeyTable) -> tuple[Leaf, list[list[Any]]]:
    """Ops that (re)create leaf ``number`` at ``path`` from a value covering every element."""
    if isinstance(value, torch.Tensor):
        bs = h.batch_size
        if tuple(value.shape[: len(bs)]) != tuple(bs):
            raise ValueError(f"key {_name(path)}: a value of shape {list(value.shape)} does not start with the batch size {list(bs)}")
        _codec.dtype_name(value.dtype)
        em = value.movedim(h.stack_pos, 0) if h.stack_pos else value
        shape = tuple(em.shape[1:])
        leaf = Leaf(path, number, value.dtype, len(shape), shape)
        return leaf, [
            ["S", kt.ref(keys.data(number)), _codec.to_bytes(em)],
            ["D", kt.ref(keys.offsets(number))],
            ["D", kt.ref(keys.shapes(number))],
        ]
    if len(value) != h.count:
        raise ValueError(f"key {_name(path)}: got {len(value)} elements for a store of {h.count}")
    if not value:
        raise ValueError(f"key {_name(path)}: cannot infer a dtype and shape from zero elements")
    dtype = value[0].dtype
    _codec.dtype_name(dtype)
    element_checks(h, path, value, value[0].ndim, dtype)
    shapes = {tuple(t.shape) for t in value}
    if len(shapes) == 1:
        return plan_full_leaf(keys, h, path, torch.stack(value, h.stack_pos), number, kt)
    data, offsets, shape_table = _het_tables(h.inner, value)
    leaf = Leaf(path, number, dtype, value[0].ndim, None)
    return leaf, [
        ["S", kt.ref(keys.data(number)), data],
        ["S", kt.ref(keys.offsets(number)), offsets],
        ["S", kt.ref(keys.shapes(number)), shape_table],
    ]


def plan_element_write(
    keys: StoreKeys, h: Header, element: int, items: dict[NestedPath, Value], kt: KeyTable
) -> tuple[None, list[list[Any]], list[Leaf]] | None:
    """``store[i] = td`` of existing keys: one SETRANGE per homogeneous leaf that keeps its shape, one splice per heterogeneous one.

    The common actor write skips the general planner; None hands anything else
    (new keys, a homogeneous key changing shape, bad input) to :func:`plan_write`.
    """
    if h.stack_pos != 0 or h.inner or not 0 <= element < h.count:
        return None
    ops: list[list[Any]] = []
    touched = []
    grouped: list[tuple[Leaf, Any]] = []
    seg = h.segments.of(element)
    local = element - h.segments.start(seg)  # the element lives in one segment: address it there
    for path, value in items.items():
        leaf = h.leaves.get(path)
        if leaf is None:
            return None
        if leaf.het:
            # one element of a heterogeneous (or non-tensor) key: one splice, sized on the server
            if leaf.json and isinstance(value, NonTensor):
                t = element_docs(path, value, None, 0)[0]
            elif not leaf.json and isinstance(value, torch.Tensor) and value.dtype == leaf.dtype and value.ndim == leaf.ndim:
                t = value
            else:
                return None
            data = _codec.to_bytes(t)
            shape_rec = struct.pack(f"<{t.ndim}q", *t.shape)
            n = leaf.number
            ops.append(
                [
                    "E",
                    kt.ref(keys.data(n, seg)),
                    kt.ref(keys.offsets(n, seg)),
                    kt.ref(keys.shapes(n, seg)),
                    8 * leaf.ndim,
                    local,
                    local,
                    shape_rec,
                    data,
                    len(data),
                ]
            )
        elif not isinstance(value, torch.Tensor) or value.dtype != leaf.dtype or value.shape != leaf.shape:
            return None
        elif leaf.col is not None:
            grouped.append((leaf, _codec.to_bytes(value)))
        else:
            ops.extend(_element_op(kt, keys, leaf, element, value, h))
        touched.append(leaf)
    if grouped:
        ops.extend(_element_row_ops(kt, keys, h, seg, local, grouped, _rows.covers_block(h, items)))
    return None, ops, touched


def _element_row_ops(
    kt: KeyTable, keys: StoreKeys, h: Header, seg: int, local: int, grouped: list[tuple[Leaf, Any]], whole: bool
) -> list[list[Any]]:
    """Grouped leaves of one element (segment-local): its whole row as one SETRANGE when every live column is written, else one per column."""
    assert h.row is not None
    number, width = h.row
    key = kt.ref(keys.data(number, seg))
    if whole:
        row = _rows.join(width, [(leaf, np.frombuffer(data, dtype=np.uint8).reshape(1, -1)) for leaf, data in grouped])
        return [["R", key, 1, _index.PAIR.pack(local * width, width), memoryview(row).cast("B")]]
    return [["R", key, 1, _index.PAIR.pack(local * width + leaf.col, len(data)), data] for leaf, data in grouped if len(data)]  # type: ignore[operator]


def _whole_rows_write(h: Header, writes: list[tuple[Leaf, np.ndarray, np.ndarray]]) -> bool:
    """Whether ``writes`` cover every live key of the row block at the same rows (so they write whole rows)."""
    first_rows = writes[0][1]
    return _rows.covers_block(h, [leaf.path for leaf, _, _ in writes]) and all(np.array_equal(r, first_rows) for _, r, _ in writes)


def _move_out_whole(
    kt: KeyTable, keys: StoreKeys, h: Header, writes: list[tuple[Leaf, np.ndarray, np.ndarray]]
) -> tuple[list[tuple[Leaf, np.ndarray, np.ndarray]], list[tuple[Leaf, list[Any]]]]:
    """Keys of the row block written whole, in order, without the rest of the block: each leaves
    the block for a blob of its own, set in one op (its column becomes a gap), instead of one
    range per element (a million SETRANGEs in the script for a million elements).

    Returns the writes left for the block, and (leaf after, op) for the keys that leave it.
    """
    if _whole_rows_write(h, writes):
        return writes, []
    everything = np.arange(h.count, dtype=np.int64)
    keep, moved = [], []
    for leaf, rows, data in writes:
        if rows.size == h.count and np.array_equal(rows, everything):
            op = ["S", kt.ref(keys.data(leaf.number)), memoryview(np.ascontiguousarray(data)).cast("B")]
            moved.append((dataclasses.replace(leaf, col=None), op))
        else:
            keep.append((leaf, rows, data))
    return keep, moved


def _grouped_ops(kt: KeyTable, keys: StoreKeys, h: Header, writes: list[tuple[Leaf, np.ndarray, np.ndarray]]) -> list[list[Any]]:
    """Rows written to grouped leaves (``(leaf, rows, data (rows, element bytes))``, on whole leaves).

    When the writes cover every live column of the block at the same rows, they become
    whole rows of the block (runs of consecutive rows are one SETRANGE each); otherwise
    each leaf's elements are one range per row at its column.
    """
    if not writes:
        return []
    assert h.row is not None
    number, width = h.row
    key = keys.data(number)
    if _whole_rows_write(h, writes):
        op = _rows_op(kt, key, writes[0][1], _rows.join(width, [(leaf, data) for leaf, _, data in writes]))
        return [op] if op is not None else []
    ops = []
    for leaf, rows, data in writes:
        if rows.size == 0 or data.shape[1] == 0:
            continue
        # keep the last occurrence of each row, as sequential assignment would
        uniq, first_in_rev = np.unique(rows[::-1], return_index=True)
        picked = np.ascontiguousarray(data[rows.size - 1 - first_in_rev])
        starts = uniq * width + leaf.col
        ops.append(
            ["R", kt.ref(key), int(uniq.size), _index.pack_pairs(starts, np.full(uniq.size, data.shape[1])), memoryview(picked).cast("B")]
        )
    return ops


def _element_op(kt: KeyTable, keys: StoreKeys, leaf: Leaf, element: int, value: torch.Tensor, h: Header) -> list[list[Any]]:
    """The one SETRANGE that writes a whole element of a homogeneous leaf (none for zero bytes), in its segment."""
    eb = leaf.element_nbytes
    if not eb:
        return []
    seg = h.segments.of(element)
    local = element - h.segments.start(seg)
    return [["R", kt.ref(keys.data(leaf.number, seg)), 1, _index.PAIR.pack(local * eb, eb), _codec.to_bytes(value)]]


def plan_write(
    keys: StoreKeys,
    h: Header,
    index: Any,
    items: dict[NestedPath, Value],
    kt: KeyTable,
    *,
    replace: bool = False,
    sub: dict[NestedPath, tuple[int, ...]] | None = None,
) -> tuple[Header | None, list[list[Any]], list[Leaf]]:
    """Plan ``store[index] = items`` (and ``set``/``update``) as one write call.

    ``sub`` gives the extra batch dims of the value's nested sub-trees (``Header.sub``), which
    keys this write creates take on.

    ``replace`` (a non-inplace ``set`` covering the whole store) lets a key change
    dtype or shape by replacing its leaf; otherwise the key keeps its dtype, and a
    key that is not in the store can only be added by a write that covers every
    element.
    """
    norm = _index.normalize(index, h.batch_size)
    p = _index.plan(norm, h.batch_size, h.stack_pos)
    full = _index.is_full(norm, h.batch_size)
    leaves = dict(h.leaves)
    next_leaf = h.next_leaf
    changed = False
    ops: list[list[Any]] = []
    grouped: list[tuple[Leaf, np.ndarray, np.ndarray]] = []  # rows of grouped leaves, written together at the end
    rows_cache: dict[str, Any] = {}
    # a spread store changes a key's layout copy-on-write: the new layout gets a new leaf number
    # and the old keys are deleted at the end (after the commit, see _spread), so a change that is
    # rolled back has written nothing that its segments' current schema uses
    retire: list[list[Any]] = []

    def renumber(leaf: Leaf | None) -> int:
        nonlocal next_leaf
        if leaf is not None and not h.spread:
            return leaf.number
        if leaf is not None:
            retire.extend(["D", kt.ref(k)] for k in keys.leaf_keys(leaf.number))
        next_leaf += 1
        return next_leaf - 1

    def rows() -> np.ndarray:
        if "rows" not in rows_cache:
            r = _index.storage_rows(p, h.inner)
            rows_cache["shape"] = tuple(r.shape)
            rows_cache["rows"] = r.reshape(-1).numpy()
        return rows_cache["rows"]

    def rows_shape() -> tuple[int, ...]:
        rows()
        return rows_cache["shape"]

    def per_element(path: NestedPath, value: Value) -> tuple[list[int], list[torch.Tensor]]:
        """The element ids along the stack dim, in the value's order, and the value split per element."""
        order = element_order(p, norm)
        if not p.inner_full:
            raise ValueError(
                f"key {_name(path)}: this write changes element shapes (or the key is heterogeneous), "
                "which needs whole elements; index the stack dim only (e.g. store[i] = td)"
            )
        if isinstance(value, torch.Tensor):
            want = rows_shape()
            if p.element_int:
                elems = [value]
            else:
                if value.ndim <= h.stack_pos or value.shape[h.stack_pos] != len(order):
                    raise ValueError(
                        f"key {_name(path)}: value of shape {list(value.shape)} does not hold {len(order)} elements along dim {h.stack_pos} (indexed batch {list(want)})"
                    )
                elems = list(value.unbind(h.stack_pos))
        else:
            elems = list(value)
        if len(elems) != len(order):
            raise ValueError(f"key {_name(path)}: got {len(elems)} elements for an index that selects {len(order)}")
        return order, elems

    new_paths = []
    for path, value in items.items():
        leaf = leaves.get(path)
        if isinstance(value, NonTensor):
            if not p.inner_full:
                raise ValueError(f"key {_name(path)} holds non-tensor data, written per whole element; index the stack dim only")
            order = element_order(p, norm)
            docs = element_docs(path, value, None if p.element_int else len(order), h.stack_pos)
            if leaf is not None and leaf.json:
                ops += _splice_ops(kt, keys, leaf, order, docs)
                continue
            if leaf is not None and not (replace and full):
                raise TypeError(
                    f"key {_name(path)} holds tensors; write a tensor, or set() the whole key to replace it with non-tensor data"
                )
            if not full:
                # a new key written at some elements: created for every element, the others None
                leaf = Leaf(path, renumber(None), torch.uint8, 1, None, json=True)
                leaves[path] = leaf
                new_paths.append(path)
                changed = True
                ops += new_leaf_ops(kt, keys, h, leaf)
                ops += _splice_ops(kt, keys, leaf, order, docs)
                continue
            by_element = dict(zip(order, docs))
            number = renumber(leaf)
            if leaf is None:
                new_paths.append(path)
            data, offsets, shape_table = _het_tables(h.inner, [by_element[e] for e in range(h.count)])
            leaves[path] = Leaf(path, number, torch.uint8, 1, None, json=True)
            ops += [
                ["S", kt.ref(keys.data(number)), data],
                ["S", kt.ref(keys.offsets(number)), offsets],
                ["S", kt.ref(keys.shapes(number)), shape_table],
            ]
            changed = True
            continue
        if leaf is not None and leaf.json and not (replace and full):
            raise TypeError(
                f"key {_name(path)} holds non-tensor data; write NonTensorData or a str, or set() the whole key to replace it with a tensor"
            )
        if leaf is None and not full:
            # a new key written at some elements: created for every element (the others zeros, or empty
            # elements of a heterogeneous key), then written below as any existing key is
            _, elems = per_element(path, value)
            dtype = elems[0].dtype if elems else value.dtype if isinstance(value, torch.Tensor) else None
            if dtype is None:
                raise ValueError(f"key {_name(path)}: no element to take the new key's dtype and shape from")
            _codec.dtype_name(dtype)
            element_checks(h, path, elems, elems[0].ndim if elems else None, dtype)
            shapes = {tuple(t.shape) for t in elems}
            if len(shapes) > 1 and h.kind == "dense":
                raise ValueError(f"key {_name(path)}: rows of shapes {sorted(map(list, shapes))}; a dense store keeps one shape per key")
            shape = shapes.pop() if len(shapes) == 1 else None
            leaf = Leaf(path, renumber(None), dtype, elems[0].ndim if elems else len(shape or ()), shape)
            leaves[path] = leaf
            new_paths.append(path)
            changed = True
            ops += new_leaf_ops(kt, keys, h, leaf)
        elif leaf is None or (replace and full and (leaf.json or not _fits(leaf, value, h))):
            number = renumber(leaf)
            if leaf is None:
                new_paths.append(path)
            new_leaf, leaf_ops = plan_full_leaf(keys, h, path, value, number, kt)
            leaves[path] = new_leaf
            ops += leaf_ops
            changed = True
            continue
        if isinstance(value, torch.Tensor):
            check_dtype(path, value, leaf.dtype)
        else:
            element_checks(h, path, value, None, leaf.dtype)
        if not leaf.het and isinstance(value, torch.Tensor) and p.element_int and p.inner_full and value.shape == leaf.shape:
            # store[i] = td on a homogeneous leaf: one SETRANGE of the element's bytes
            if leaf.col is not None:
                grouped.append((leaf, np.array([int(p.elements[0])], dtype=np.int64), _as_rows(value, 0).reshape(1, -1)))
            else:
                ops.extend(_element_op(kt, keys, leaf, int(p.elements[0]), value, h))
            continue
        if not leaf.het and isinstance(value, torch.Tensor):
            feat = leaf.shape[len(h.inner) :]  # type: ignore[index]
            want = rows_shape() + tuple(feat)
            if tuple(value.shape) == want and leaf.col is not None:
                # a grouped leaf (no inner batch size: storage rows are elements)
                grouped.append((leaf, rows(), _as_rows(value, len(rows_shape()))))
                continue
            if tuple(value.shape) == want and full and not p.flips:
                # the whole leaf, in order: replace the blob (large ones are staged, see Engine.run_write)
                em = value.movedim(h.stack_pos, 0) if h.stack_pos else value
                ops.append(["S", kt.ref(keys.data(leaf.number)), _codec.to_bytes(em)])
                continue
            if tuple(value.shape) == want:
                op = _rows_op(kt, keys.data(leaf.number), rows(), _as_rows(value, len(rows_shape())))
                if op is not None:
                    ops.append(op)
                continue
            if not p.inner_full or value.ndim != len(want):
                raise ValueError(f"key {_name(path)}: expected a value of shape {list(want)}, got {list(value.shape)} (no broadcasting)")
        order, elems = per_element(path, value)
        element_checks(h, path, elems, leaf.ndim, leaf.dtype)
        if not leaf.het and all(tuple(t.shape) == leaf.shape for t in elems):
            eb = leaf.element_nbytes
            data = np.stack([_as_rows(t, 0).reshape(-1) for t in elems]) if eb else np.zeros((len(elems), 0), np.uint8)
            if leaf.col is not None:
                grouped.append((leaf, np.asarray(order, dtype=np.int64), data))
                continue
            op = _rows_op(kt, keys.data(leaf.number), np.asarray(order, dtype=np.int64), data)
            if op is not None:
                ops.append(op)
            continue
        if not leaf.het and h.kind == "dense":
            shapes = sorted({tuple(t.shape) for t in elems} - {leaf.shape})
            raise ValueError(
                f"key {_name(path)} has shape {list(leaf.shape)} per row in this dense store, got {list(shapes[0])}; "  # type: ignore[arg-type]
                "a dense store keeps one shape per key: replace the whole key (store[key] = tensor) to change it"
            )
        if not leaf.het:
            # a homogeneous key gets a new element shape: it becomes heterogeneous, in this same call
            leaf, table_ops = to_heterogeneous(kt, keys, leaf, h, renumber(leaf) if h.spread and leaf.col is None else None)
            ops += table_ops
            leaves[path] = leaf
            changed = True
        ops += _splice_ops(kt, keys, leaf, order, elems)
    if grouped:
        grouped, moved = _move_out_whole(kt, keys, h, grouped)
        for leaf, op in moved:
            leaves[leaf.path] = leaf
            ops.append(op)
            changed = True
    ops += _grouped_ops(kt, keys, h, grouped)
    ops += retire
    if new_paths:
        check_paths(list(leaves))
    new_header = h.with_leaves(leaves, next_leaf, sub=_new_subtrees(h, sub, new_paths)) if changed else None
    touched = [h.leaves[p] for p in items if p in h.leaves]
    return new_header, ops, touched


def _new_subtrees(
    h: Header, sub: dict[NestedPath, tuple[int, ...]] | None, new_paths: list[NestedPath]
) -> dict[NestedPath, tuple[int, ...]] | None:
    """The sub-tree batch dims that a write's new keys bring (those of sub-trees holding one of them)."""
    if not sub or not new_paths:
        return None
    return {path: dims for path, dims in sub.items() if any(p[: len(path)] == path for p in new_paths)} or None


def new_leaf_ops(kt: KeyTable, keys: StoreKeys, h: Header, leaf: Leaf) -> list[list[Any]]:
    """What a new leaf needs before its first elements are written. Nothing in a store that keeps an
    inventory: each segment is allocated by the write that first touches it (zeros; empty elements,
    read as None for non-tensor data). A spread store allocates every segment now, on the server."""
    if h.tracked:
        return []
    n = leaf.number
    if leaf.shape is not None:
        return [["Z", kt.ref(keys.data(n)), h.count * leaf.element_nbytes]]
    empty = [] if leaf.json else list(h.inner) + [0] * (leaf.ndim - len(h.inner))
    record = _codec.pack_i64([0] if leaf.json else empty)
    return [
        ["S", kt.ref(keys.data(n)), b""],
        ["S", kt.ref(keys.offsets(n)), bytes(8 * (h.count + 1))],
        ["S", kt.ref(keys.shapes(n)), record * h.count],
    ]


def _fits(leaf: Leaf, value: Value, h: Header) -> bool:
    """Whether a value covering the whole store can overwrite ``leaf`` without a schema change.

    Anything else (another dtype or shape, or a heterogeneous leaf) is replaced by a
    leaf built from the value, as ``set`` on a TensorDict replaces the entry.
    """
    if not isinstance(value, torch.Tensor) or leaf.het or value.dtype != leaf.dtype:
        return False
    em_shape = list(value.shape)
    if len(em_shape) <= h.stack_pos:
        return False
    em_shape.pop(h.stack_pos)
    return tuple(em_shape) == leaf.shape


def to_heterogeneous(kt: KeyTable, keys: StoreKeys, leaf: Leaf, h: Header, number: int | None = None) -> tuple[Leaf, list[list[Any]]]:
    """A homogeneous leaf as a heterogeneous one: its offset and shape tables, built from its arithmetic layout.

    A grouped leaf first gets its data blob, copied out of the row block on the server ('C').
    With ``number`` (a spread store, copy-on-write) the blob is copied on the server to that
    new leaf number, which gets the tables; the caller deletes the old keys.
    """
    assert leaf.shape is not None
    eb = leaf.element_nbytes
    count = h.count
    ops: list[list[Any]] = []
    if leaf.col is not None:
        assert h.row is not None and number is None
        ops.append(["C", kt.ref(keys.data(h.row[0])), kt.ref(keys.data(leaf.number)), h.row[1], leaf.col, eb])
    elif number is not None:
        # rows of eb bytes at column 0: the whole blob (a zero-byte leaf has none to copy)
        ops.append(
            ["C", kt.ref(keys.data(leaf.number)), kt.ref(keys.data(number)), eb, 0, eb] if eb else ["S", kt.ref(keys.data(number)), b""]
        )
    elif h.tracked:
        # the blobs stay: each segment's is checked, and allocated (zeros) where it was never
        # written, so that the tables below describe bytes that are there
        ops.append(["T", kt.ref(keys.data(leaf.number))])
    n = leaf.number if number is None else number
    ops += [
        ["S", kt.ref(keys.offsets(n)), (np.arange(count + 1, dtype="<i8") * eb).tobytes()],
        ["S", kt.ref(keys.shapes(n)), np.tile(np.asarray(leaf.shape, dtype="<i8"), count).tobytes()],
    ]
    return Leaf(leaf.path, n, leaf.dtype, leaf.ndim, None), ops


def het_payload(elems: list[torch.Tensor]) -> tuple[bytes, bytes, list[int]]:
    """Shape records, data and byte sizes of whole elements of a heterogeneous leaf, as 'E' and 'Y' ops take them."""
    data = b"".join(bytes(_codec.to_bytes(t)) for t in elems)
    shapes = _codec.pack_i64([s for t in elems for s in t.shape])
    return shapes, data, [t.numel() * t.element_size() for t in elems]


def _splice_ops(kt: KeyTable, keys: StoreKeys, leaf: Leaf, order: list[int], elems: list[torch.Tensor]) -> list[list[Any]]:
    """'E' ops writing whole elements of a heterogeneous leaf, one op per run of consecutive ids."""
    last: dict[int, torch.Tensor] = {}
    for e, t in zip(order, elems):
        last[e] = t
    ids = np.array(sorted(last), dtype=np.int64)
    dk, ok, sk = kt.ref(keys.data(leaf.number)), kt.ref(keys.offsets(leaf.number)), kt.ref(keys.shapes(leaf.number))
    ops = []
    for lo, hi in _index.runs(ids):
        shapes, data, sizes = het_payload([last[e] for e in range(lo, hi + 1)])
        ops.append(["E", dk, ok, sk, 8 * leaf.ndim, lo, hi, shapes, data, *sizes])
    return ops


def plan_delete(keys: StoreKeys, h: Header, paths: list[NestedPath], kt: KeyTable) -> tuple[Header, list[list[Any]], list[Leaf]]:
    """Delete the leaves ``paths`` (their numbers are never reused)."""
    leaves = dict(h.leaves)
    ops: list[list[Any]] = []
    for path in paths:
        leaf = leaves.pop(path)
        for key in keys.leaf_keys(leaf.number):
            ops.append(["D", kt.ref(key)])
    return h.with_leaves(leaves), ops, []


def plan_rename(h: Header, renames: dict[NestedPath, NestedPath]) -> Header:
    """Rename leaves: a schema-only change (data keys are named by leaf number)."""
    leaves = {}
    for path, leaf in h.leaves.items():
        new = renames.get(path, path)
        leaves[new] = Leaf(new, leaf.number, leaf.dtype, leaf.ndim, leaf.shape, json=leaf.json, col=leaf.col)
    if len(leaves) != len(h.leaves):
        raise KeyError(f"renaming {renames} would overwrite an existing key")
    check_paths(list(leaves))
    return h.with_leaves(leaves)


def plan_fill(
    keys: StoreKeys, h: Header, paths: list[NestedPath], value: Any, kt: KeyTable, element: int | None = None
) -> tuple[Header | None, list[list[Any]], list[Leaf]]:
    """``fill_``/``zero_`` of the leaves ``paths`` (of one element, or of the whole store).

    The value is cast to each leaf's dtype, as ``Tensor.fill_`` does, and sent as one
    element-sized pattern that the server repeats: nothing is read, and the data
    never crosses the network.
    """
    ops: list[list[Any]] = []
    touched = []
    fills: list[tuple[Leaf, np.ndarray, np.ndarray]] = []  # grouped leaves: rows of the block
    if all(h.leaves[p].json for p in paths) and len(paths) == 1:
        raise TypeError(f"key {_name(paths[0])} holds non-tensor data, which cannot be filled with a number")
    for path in paths:
        leaf = h.leaves[path]
        if leaf.json:  # zero_() and fill_ of a sub-tree leave non-tensor data alone, as on a TensorDict
            continue
        touched.append(leaf)
        pattern = bytes(_codec.to_bytes(torch.full((), value, dtype=leaf.dtype)))
        if leaf.het:
            lo, hi = (0, h.count - 1) if element is None else (element, element)
            ops.append(["F", kt.ref(keys.data(leaf.number)), kt.ref(keys.offsets(leaf.number)), lo, hi, pattern])
        elif leaf.col is not None:
            # a grouped leaf: its column of every row (or of one), written as rows of the block
            eb = leaf.element_nbytes
            rows = np.arange(h.count, dtype=np.int64) if element is None else np.array([element], dtype=np.int64)
            if eb and rows.size:
                data = np.frombuffer(pattern * (eb // len(pattern)), dtype=np.uint8)
                fills.append((leaf, rows, np.broadcast_to(data, (rows.size, eb))))
        else:
            eb = leaf.element_nbytes
            a, b = (0, h.count * eb) if element is None else (element * eb, (element + 1) * eb)
            if b > a:
                ops.append(["F", kt.ref(keys.data(leaf.number)), 0, a, b, pattern])
    if fills and element is None and _whole_rows_write(h, fills):
        # every key of the block filled whole: one row of patterns, repeated by the server
        assert h.row is not None
        number, width = h.row
        row = _rows.join(width, [(leaf, np.ascontiguousarray(data[:1])) for leaf, _, data in fills])
        ops.append(["F", kt.ref(keys.data(number)), 0, 0, h.count * width, row.tobytes()])
        return None, ops, touched
    if fills and element is None:
        # keys of the block filled whole without the rest of it: each gets a blob of its own,
        # allocated and filled by the server (nothing sent), and leaves the block
        leaves = dict(h.leaves)
        for leaf, _, data in fills:
            n = h.count * leaf.element_nbytes
            ops += [
                ["Z", kt.ref(keys.data(leaf.number)), n],
                ["F", kt.ref(keys.data(leaf.number)), 0, 0, n, bytes(data[0][: leaf.dtype.itemsize])],
            ]
            leaves[leaf.path] = dataclasses.replace(leaf, col=None)
        return h.with_leaves(leaves), ops, touched
    ops += _grouped_ops(kt, keys, h, fills)
    return None, ops, touched


def first_element_sizes(keys: StoreKeys, h: Header, ops: list[list[Any]], kt: KeyTable) -> list[tuple[int, int]]:
    """``(mean, largest)`` bytes per element of each blob that the first write of an empty store sets.

    Homogeneous leaves with a blob of their own and the row block give them exactly; a
    heterogeneous one gives the mean of the blob the write sets (its size over the count), or
    the mean and the largest of the rows of the first ring write.
    """
    sizes = [(leaf.element_nbytes,) * 2 for leaf in h.leaves.values() if not leaf.het and leaf.col is None]
    if h.row is not None:
        sizes.append((h.row[1],) * 2)
    data_keys = {keys.data(leaf.number) for leaf in h.leaves.values() if leaf.het}
    for op in ops:
        if op[0] == "S" and kt.keys[op[1] - 1] in data_keys:
            mean = -(-len(op[2]) // max(1, h.count))
            sizes.append((mean, mean))
        elif op[0] == "Y" and op[7:]:
            sizes.append((-(-sum(op[7:]) // len(op[7:])), max(op[7:])))
    return sizes
