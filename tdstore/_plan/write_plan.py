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
from typing import Any

import numpy as np
import torch

from tdstore._errors import DenseShapeError
from tdstore._format import codec, row_block
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf, NestedPath, check_paths
from tdstore._plan.index import Component, Plan, is_full, normalize, pack_pairs, plan, storage_rows
from tdstore._plan.leaf_writes import (
    Value,
    as_rows,
    check_dtype,
    element_checks,
    element_op,
    fits,
    het_tables,
    key_name,
    new_leaf_ops,
    plan_full_leaf,
    rows_op,
    splice_ops,
    to_heterogeneous,
)
from tdstore._plan.values import subtree_conflicts


def element_order(p: Plan, norm: tuple[Component, ...]) -> list[int]:
    """The element ids along the stack dim in the order the value holds them."""
    s = norm[p.stack_pos]
    if isinstance(s, int):
        return [s]
    if isinstance(s, slice):
        return list(range(s.start, s.stop, s.step))
    if s.ndim != 1:
        raise NotImplementedError("writing whole elements with a multi-dimensional index tensor; flatten the index first")
    return [int(i) for i in s.tolist()]


def _whole_rows_write(h: Header, writes: list[tuple[Leaf, np.ndarray, np.ndarray]]) -> bool:
    """Whether ``writes`` cover every live key of the row block at the same rows (so they write whole rows)."""
    first_rows = writes[0][1]
    return row_block.covers_block(h, [leaf.path for leaf, _, _ in writes]) and all(np.array_equal(r, first_rows) for _, r, _ in writes)


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
            op = Write.S(kt.ref(keys.data(leaf.number)), np.ascontiguousarray(data).data.cast("B"))
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
        op = rows_op(kt, key, writes[0][1], row_block.join(width, [(leaf, data) for leaf, _, data in writes]))
        return [op] if op is not None else []
    ops = []
    for leaf, rows, data in writes:
        if rows.size == 0 or data.shape[1] == 0:
            continue
        # keep the last occurrence of each row, as sequential assignment would
        uniq, first_in_rev = np.unique(rows[::-1], return_index=True)
        picked = np.ascontiguousarray(data[rows.size - 1 - first_in_rev])
        starts = uniq * width + leaf.col
        ops.append(Write.R(kt.ref(key), int(uniq.size), pack_pairs(starts, np.full(uniq.size, data.shape[1])), picked.data.cast("B")))
    return ops


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
    writes = _WritePlan(keys, h, index, kt, replace)
    for path, value in items.items():
        if isinstance(value, NonTensor):
            writes.non_tensor(path, value)
        else:
            writes.tensors(path, value)
    return writes.finish(items, sub)


class _WritePlan:
    """The state of one :func:`plan_write`: the leaves as the write leaves them, and its ops so far."""

    def __init__(self, keys: StoreKeys, h: Header, index: Any, kt: KeyTable, replace: bool) -> None:
        self.keys, self.h, self.kt = keys, h, kt
        self.norm = normalize(index, h.batch_size)
        self.p = plan(self.norm, h.batch_size, h.stack_pos)
        self.full = is_full(self.norm, h.batch_size)
        self.replace_whole = replace and self.full  # a set() of whole keys: a key may change dtype or shape
        self.leaves = dict(h.leaves)
        self.next_leaf = h.next_leaf
        self.changed = False
        self.ops: list[list[Any]] = []
        self.grouped: list[tuple[Leaf, np.ndarray, np.ndarray]] = []  # rows of grouped leaves, written together at the end
        self.new_paths: list[NestedPath] = []
        # a spread store changes a key's layout copy-on-write: the new layout gets a new leaf number
        # and the old keys are deleted at the end (after the commit, see _spread_change), so a change that is
        # rolled back has written nothing that its segments' current schema uses
        self.retire: list[list[Any]] = []
        self._rows: tuple[np.ndarray, tuple[int, ...]] | None = None

    def renumber(self, leaf: Leaf | None) -> int:
        """The leaf number a key gets when its layout changes (or it is new)."""
        if leaf is not None and not self.h.spread:
            return leaf.number
        if leaf is not None:
            self.retire.extend(Write.D(self.kt.ref(k)) for k in self.keys.leaf_keys(leaf.number))
        self.next_leaf += 1
        return self.next_leaf - 1

    def set_leaf(self, leaf: Leaf, *, new: bool) -> None:
        self.leaves[leaf.path] = leaf
        if new:
            self.new_paths.append(leaf.path)
        self.changed = True

    def rows(self) -> np.ndarray:
        """The storage rows the index selects, flat (computed once)."""
        if self._rows is None:
            r = storage_rows(self.p, self.h.inner)
            self._rows = (r.reshape(-1).numpy(), tuple(r.shape))
        return self._rows[0]

    def rows_shape(self) -> tuple[int, ...]:
        self.rows()
        assert self._rows is not None
        return self._rows[1]

    def per_element(self, path: NestedPath, value: Value) -> tuple[list[int], list[torch.Tensor]]:
        """The element ids along the stack dim, in the value's order, and the value split per element."""
        p, h = self.p, self.h
        order = element_order(p, self.norm)
        if not p.inner_full:
            raise ValueError(
                f"key {key_name(path)}: this write changes element shapes (or the key is heterogeneous), "
                "which needs whole elements; index the stack dim only (e.g. store[i] = td)"
            )
        if isinstance(value, torch.Tensor):
            want = self.rows_shape()
            if p.element_int:
                elems = [value]
            else:
                if value.ndim <= h.stack_pos or value.shape[h.stack_pos] != len(order):
                    raise ValueError(
                        f"key {key_name(path)}: value of shape {list(value.shape)} does not hold {len(order)} elements "
                        f"along dim {h.stack_pos} (indexed batch {list(want)})"
                    )
                elems = list(value.unbind(h.stack_pos))
        else:
            elems = list(value)
        if len(elems) != len(order):
            raise ValueError(f"key {key_name(path)}: got {len(elems)} elements for an index that selects {len(order)}")
        return order, elems

    def non_tensor(self, path: NestedPath, value: NonTensor) -> None:
        """A key of non-tensor data: its elements spliced in, or the whole key set (or created)."""
        keys, h, kt, p = self.keys, self.h, self.kt, self.p
        leaf = self.leaves.get(path)
        if not p.inner_full:
            raise ValueError(f"key {key_name(path)} holds non-tensor data, written per whole element; index the stack dim only")
        order = element_order(p, self.norm)
        docs = element_docs(path, value, None if p.element_int else len(order), h.stack_pos)
        if leaf is not None and leaf.json:
            self.ops += splice_ops(kt, keys, leaf, order, docs)
            return
        if leaf is not None and not self.replace_whole:
            raise TypeError(
                f"key {key_name(path)} holds tensors; write a tensor, or set() the whole key to replace it with non-tensor data"
            )
        if not self.full:
            # a new key written at some elements: created for every element, the others None
            leaf = Leaf(path, self.renumber(None), torch.uint8, 1, None, json=True)
            self.set_leaf(leaf, new=True)
            self.ops += new_leaf_ops(kt, keys, h, leaf)
            self.ops += splice_ops(kt, keys, leaf, order, docs)
            return
        by_element = dict(zip(order, docs))
        number = self.renumber(leaf)
        data, offsets, shape_table = het_tables(h.inner, [by_element[e] for e in range(h.count)])
        self.set_leaf(Leaf(path, number, torch.uint8, 1, None, json=True), new=leaf is None)
        self.ops += [
            Write.S(kt.ref(keys.data(number)), data),
            Write.S(kt.ref(keys.offsets(number)), offsets),
            Write.S(kt.ref(keys.shapes(number)), shape_table),
        ]

    def tensors(self, path: NestedPath, value: Value) -> None:
        """A key of tensors: a new key or a replaced one, else the value written into the key as it is."""
        leaf = self.leaves.get(path)
        if leaf is not None and leaf.json and not self.replace_whole:
            raise TypeError(
                f"key {key_name(path)} holds non-tensor data; write NonTensorData or a str, "
                "or set() the whole key to replace it with a tensor"
            )
        if leaf is None and not self.full:
            leaf = self.new_partial_key(path, value)
        elif leaf is None or (self.replace_whole and (leaf.json or not fits(leaf, value, self.h))):
            new_leaf, leaf_ops = plan_full_leaf(self.keys, self.h, path, value, self.renumber(leaf), self.kt)
            self.set_leaf(new_leaf, new=leaf is None)
            self.ops += leaf_ops
            return
        if isinstance(value, torch.Tensor):
            check_dtype(path, value, leaf.dtype)
        else:
            element_checks(self.h, path, value, None, leaf.dtype)
        if not leaf.het and isinstance(value, torch.Tensor) and self.dense_value(path, leaf, value):
            return
        self.elements(path, leaf, value)

    def new_partial_key(self, path: NestedPath, value: Value) -> Leaf:
        """A new key written at some elements: created for every element (the others zeros, or empty
        elements of a heterogeneous key), then written as any existing key is."""
        h = self.h
        _, elems = self.per_element(path, value)
        dtype = elems[0].dtype if elems else value.dtype if isinstance(value, torch.Tensor) else None
        if dtype is None:
            raise ValueError(f"key {key_name(path)}: no element to take the new key's dtype and shape from")
        codec.dtype_name(dtype)
        element_checks(h, path, elems, elems[0].ndim if elems else None, dtype)
        shapes = {tuple(t.shape) for t in elems}
        if len(shapes) > 1 and h.kind == "dense":
            got = sorted(map(list, shapes))
            raise DenseShapeError(f"key {key_name(path)}: rows of shapes {got}; a dense store keeps one shape per key")
        shape = shapes.pop() if len(shapes) == 1 else None
        leaf = Leaf(path, self.renumber(None), dtype, elems[0].ndim if elems else len(shape or ()), shape)
        self.set_leaf(leaf, new=True)
        self.ops += new_leaf_ops(self.kt, self.keys, h, leaf)
        return leaf

    def dense_value(self, path: NestedPath, leaf: Leaf, value: torch.Tensor) -> bool:
        """A homogeneous leaf written from one tensor of the indexed batch shape; False when the value
        must be written per element instead (it changes element shapes)."""
        h, p = self.h, self.p
        if p.element_int and p.inner_full and value.shape == leaf.shape:
            # store[i] = td on a homogeneous leaf: one SETRANGE of the element's bytes
            if leaf.col is not None:
                self.grouped.append((leaf, np.array([int(p.elements[0])], dtype=np.int64), as_rows(value, 0).reshape(1, -1)))
            else:
                self.ops.extend(element_op(self.kt, self.keys, leaf, int(p.elements[0]), value, h))
            return True
        assert leaf.shape is not None
        want = self.rows_shape() + tuple(leaf.shape[len(h.inner) :])
        if tuple(value.shape) != want:
            if not p.inner_full or value.ndim != len(want):
                raise ValueError(f"key {key_name(path)}: expected a value of shape {list(want)}, got {list(value.shape)} (no broadcasting)")
            return False
        if leaf.col is not None:
            # a grouped leaf (no inner batch size: storage rows are elements)
            self.grouped.append((leaf, self.rows(), as_rows(value, len(self.rows_shape()))))
        elif self.full and not p.flips:
            # the whole leaf, in order: replace the blob (large ones are staged, see Engine.run_write)
            em = value.movedim(h.stack_pos, 0) if h.stack_pos else value
            self.ops.append(Write.S(self.kt.ref(self.keys.data(leaf.number)), codec.to_bytes(em)))
        elif (op := rows_op(self.kt, self.keys.data(leaf.number), self.rows(), as_rows(value, len(self.rows_shape())))) is not None:
            self.ops.append(op)
        return True

    def elements(self, path: NestedPath, leaf: Leaf, value: Value) -> None:
        """Whole elements of a key: rows of a homogeneous leaf that keeps its shape, else spliced
        into a heterogeneous leaf (a homogeneous one turns heterogeneous in the same call)."""
        keys, h, kt = self.keys, self.h, self.kt
        order, elems = self.per_element(path, value)
        element_checks(h, path, elems, leaf.ndim, leaf.dtype)
        if not leaf.het and all(tuple(t.shape) == leaf.shape for t in elems):
            eb = leaf.element_nbytes
            data = np.stack([as_rows(t, 0).reshape(-1) for t in elems]) if eb else np.zeros((len(elems), 0), np.uint8)
            if leaf.col is not None:
                self.grouped.append((leaf, np.asarray(order, dtype=np.int64), data))
            elif (op := rows_op(kt, keys.data(leaf.number), np.asarray(order, dtype=np.int64), data)) is not None:
                self.ops.append(op)
            return
        if not leaf.het and h.kind == "dense":
            assert leaf.shape is not None
            shapes = sorted({tuple(t.shape) for t in elems} - {leaf.shape})
            raise DenseShapeError(
                f"key {key_name(path)} has shape {list(leaf.shape)} per row in this dense store, got {list(shapes[0])}; "
                "a dense store keeps one shape per key: replace the whole key (store[key] = tensor) to change it"
            )
        if not leaf.het:
            # a homogeneous key gets a new element shape: it becomes heterogeneous, in this same call
            leaf, table_ops = to_heterogeneous(kt, keys, leaf, h, self.renumber(leaf) if h.spread and leaf.col is None else None)
            self.ops += table_ops
            self.set_leaf(leaf, new=False)
        self.ops += splice_ops(kt, keys, leaf, order, elems)

    def finish(
        self, items: dict[NestedPath, Value], sub: dict[NestedPath, tuple[int, ...]] | None
    ) -> tuple[Header | None, list[list[Any]], list[Leaf]]:
        """The row block's writes, the retired keys, and the new header (None when the schema stays)."""
        h = self.h
        grouped = self.grouped
        if grouped:
            grouped, moved = _move_out_whole(self.kt, self.keys, h, grouped)
            for leaf, op in moved:
                self.set_leaf(leaf, new=False)
                self.ops.append(op)
        ops = [*self.ops, *_grouped_ops(self.kt, self.keys, h, grouped), *self.retire]
        if self.new_paths:
            check_paths(list(self.leaves))
        # a sub-tree written with other batch dims than the store's (a chat of another length) becomes
        # one whose dims vary between elements (RAGGED), in this same call
        conflicts = subtree_conflicts(h.sub, sub) if sub and h.sub else {}
        if self.changed or conflicts:
            new_sub = {**(_new_subtrees(h, sub, self.new_paths) or {}), **conflicts}
            new_header = h.with_leaves(self.leaves, self.next_leaf, sub=new_sub, classes=getattr(sub, "classes", None))
        else:
            new_header = None
        touched = [h.leaves[p] for p in items if p in h.leaves]
        return new_header, ops, touched


def _new_subtrees(
    h: Header, sub: dict[NestedPath, tuple[int, ...]] | None, new_paths: list[NestedPath]
) -> dict[NestedPath, tuple[int, ...]] | None:
    """The sub-tree batch dims that a write's new keys bring (those of sub-trees holding one of them)."""
    if not sub or not new_paths:
        return None
    return {path: dims for path, dims in sub.items() if any(p[: len(path)] == path for p in new_paths)} or None


def plan_delete(keys: StoreKeys, h: Header, paths: list[NestedPath], kt: KeyTable) -> tuple[Header, list[list[Any]], list[Leaf]]:
    """Delete the leaves ``paths`` (their numbers are never reused)."""
    leaves = dict(h.leaves)
    ops: list[list[Any]] = []
    for path in paths:
        leaf = leaves.pop(path)
        for key in keys.leaf_keys(leaf.number):
            ops.append(Write.D(kt.ref(key)))
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
        raise TypeError(f"key {key_name(paths[0])} holds non-tensor data, which cannot be filled with a number")
    for path in paths:
        leaf = h.leaves[path]
        if leaf.json:  # zero_() and fill_ of a sub-tree leave non-tensor data alone, as on a TensorDict
            continue
        touched.append(leaf)
        try:  # fill_'s conversion, as a tensor's: a value the dtype cannot hold (1e40 in float16) raises, never inf
            one = torch.empty(2, dtype=leaf.dtype).fill_(value)[0]  # (torch checks a fill of one value less: inf)
        except RuntimeError as err:
            raise RuntimeError(f"key {key_name(path)}: {err}") from None
        pattern = bytes(codec.to_bytes(one))
        if leaf.het:
            lo, hi = (0, h.count - 1) if element is None else (element, element)
            ops.append(Write.F(kt.ref(keys.data(leaf.number)), kt.ref(keys.offsets(leaf.number)), lo, hi, pattern))
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
                ops.append(Write.F(kt.ref(keys.data(leaf.number)), 0, a, b, pattern))
    if fills and element is None and _whole_rows_write(h, fills):
        # every key of the block filled whole: one row of patterns, repeated by the server
        assert h.row is not None
        number, width = h.row
        row = row_block.join(width, [(leaf, np.ascontiguousarray(data[:1])) for leaf, _, data in fills])
        ops.append(Write.F(kt.ref(keys.data(number)), 0, 0, h.count * width, row.tobytes()))
        return None, ops, touched
    if fills and element is None:
        # keys of the block filled whole without the rest of it: each gets a blob of its own,
        # allocated and filled by the server (nothing sent), and leaves the block
        leaves = dict(h.leaves)
        for leaf, _, data in fills:
            n = h.count * leaf.element_nbytes
            ops += [
                Write.Z(kt.ref(keys.data(leaf.number)), n),
                Write.F(kt.ref(keys.data(leaf.number)), 0, 0, n, bytes(data[0][: leaf.dtype.itemsize])),
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
        if op[0] == Write.S.marker and kt.keys[op[1] - 1] in data_keys:
            mean = -(-len(op[2]) // max(1, h.count))
            sizes.append((mean, mean))
        elif op[0] == Write.Y.marker and op[7:]:
            sizes.append((-(-sum(op[7:]) // len(op[7:])), max(op[7:])))
    return sizes
