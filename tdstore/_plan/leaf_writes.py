"""The ops that write one leaf: its whole blob and tables, rows and elements of it, a new leaf,
and a homogeneous leaf turning heterogeneous.

The planners (``_plan.write_plan`` for indexed writes, ``_plan.ring_plan`` for ring writes) decide which leaves a
write touches and how; the ops for each leaf, and the checks of each value against the leaf
(dtype, number of dims, inner batch size), are built here, once for both.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tdstore._format import codec
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan import index

#: A value per leaf path: one tensor whose leading dims are the indexed batch shape, or one tensor per element.
Value = torch.Tensor | list[torch.Tensor]


def key_name(path: NestedPath) -> str:
    """A key as error messages name it: its name, or its path when nested."""
    return repr(path[0]) if len(path) == 1 else repr(path)


def rows_op(kt: KeyTable, key: str, rows: np.ndarray, data: np.ndarray) -> list[Any] | None:
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
        ranges = index.pack_pairs(np.array([int(rows[0]) * rb]), np.array([rows.size * rb]))
        return Write.R(kt.ref(key), 1, ranges, np.ascontiguousarray(data).data.cast("B"))
    # keep the last occurrence of each row, as sequential assignment would
    uniq, first_in_rev = np.unique(rows[::-1], return_index=True)
    data = np.ascontiguousarray(data[rows.size - 1 - first_in_rev])
    lo, hi = index.run_bounds(uniq)
    return Write.R(kt.ref(key), int(lo.size), index.pack_pairs(lo * rb, (hi - lo + 1) * rb), data.data.cast("B"))


def as_rows(t: torch.Tensor, lead: int) -> np.ndarray:
    """A (rows, bytes per row) uint8 view of ``t`` whose first ``lead`` dims are rows."""
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    n = int(np.prod(t.shape[:lead])) if lead else 1
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return raw.reshape(n, -1) if n else np.zeros((0, 0), np.uint8)


def check_dtype(path: NestedPath, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a tensor of another dtype than the key's (values are never cast)."""
    if t.dtype != dtype:
        raise TypeError(f"key {key_name(path)} holds {codec.dtype_name(dtype)}, got {t.dtype}; cast the value explicitly (no silent casts)")


def het_tables(inner: tuple[int, ...], elems: list[torch.Tensor]) -> tuple[bytes, bytes, bytes]:
    """Data, offset table and shape table of a heterogeneous leaf built from element tensors."""
    shapes, data, sizes = het_payload(elems)
    offsets = np.zeros(len(elems) + 1, dtype="<i8")
    np.cumsum(sizes, out=offsets[1:])
    return data, offsets.tobytes(), shapes


def element_checks(h: Header, path: NestedPath, elems: list[torch.Tensor], ndim: int | None, dtype: torch.dtype | None) -> None:
    """Refuse elements that are not tensors, or whose dtype, inner batch size or number of dims the key cannot hold."""
    inner = h.inner
    for k, t in enumerate(elems):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"key {key_name(path)}: element {k} is a {type(t).__name__}, not a tensor")
        if dtype is not None:
            check_dtype(path, t, dtype)
        if tuple(t.shape[: len(inner)]) != inner:
            raise ValueError(f"key {key_name(path)}: element shape {list(t.shape)} does not start with the inner batch size {list(inner)}")
        if ndim is not None and t.ndim != ndim:
            raise ValueError(
                f"key {key_name(path)} has {ndim} dims per element, got a tensor of shape {list(t.shape)} "
                "(the number of dims cannot change)"
            )


def plan_full_leaf(keys: StoreKeys, h: Header, path: NestedPath, value: Value, number: int, kt: KeyTable) -> tuple[Leaf, list[list[Any]]]:
    """Ops that (re)create leaf ``number`` at ``path`` from a value covering every element."""
    if isinstance(value, torch.Tensor):
        bs = h.batch_size
        if tuple(value.shape[: len(bs)]) != tuple(bs):
            raise ValueError(f"key {key_name(path)}: a value of shape {list(value.shape)} does not start with the batch size {list(bs)}")
        codec.dtype_name(value.dtype)
        em = value.movedim(h.stack_pos, 0) if h.stack_pos else value
        shape = tuple(em.shape[1:])
        leaf = Leaf(path, number, value.dtype, len(shape), shape)
        return leaf, [
            Write.S(kt.ref(keys.data(number)), codec.to_bytes(em)),
            Write.D(kt.ref(keys.offsets(number))),
            Write.D(kt.ref(keys.shapes(number))),
        ]
    if len(value) != h.count:
        raise ValueError(f"key {key_name(path)}: got {len(value)} elements for a store of {h.count}")
    if not value:
        raise ValueError(f"key {key_name(path)}: cannot infer a dtype and shape from zero elements")
    dtype = value[0].dtype
    codec.dtype_name(dtype)
    element_checks(h, path, value, value[0].ndim, dtype)
    shapes = {tuple(t.shape) for t in value}
    if len(shapes) == 1:
        return plan_full_leaf(keys, h, path, torch.stack(value, h.stack_pos), number, kt)
    data, offsets, shape_table = het_tables(h.inner, value)
    leaf = Leaf(path, number, dtype, value[0].ndim, None)
    return leaf, [
        Write.S(kt.ref(keys.data(number)), data),
        Write.S(kt.ref(keys.offsets(number)), offsets),
        Write.S(kt.ref(keys.shapes(number)), shape_table),
    ]


def element_op(kt: KeyTable, keys: StoreKeys, leaf: Leaf, element: int, value: torch.Tensor, h: Header) -> list[list[Any]]:
    """The one SETRANGE that writes a whole element of a homogeneous leaf (none for zero bytes), in its segment."""
    eb = leaf.element_nbytes
    if not eb:
        return []
    seg = h.segments.of(element)
    local = element - h.segments.start(seg)
    return [Write.R(kt.ref(keys.data(leaf.number, seg)), 1, index.PAIR.pack(local * eb, eb), codec.to_bytes(value))]


def new_leaf_ops(kt: KeyTable, keys: StoreKeys, h: Header, leaf: Leaf) -> list[list[Any]]:
    """What a new leaf needs before its first elements are written. Nothing in a store that keeps an
    inventory: each segment is allocated by the write that first touches it (zeros; empty elements,
    read as None for non-tensor data). A spread store allocates every segment now, on the server."""
    if h.tracked:
        return []
    n = leaf.number
    if leaf.shape is not None:
        return [Write.Z(kt.ref(keys.data(n)), h.count * leaf.element_nbytes)]
    empty = [] if leaf.json else list(h.inner) + [0] * (leaf.ndim - len(h.inner))
    record = codec.pack_i64([0] if leaf.json else empty)
    return [
        Write.S(kt.ref(keys.data(n)), b""),
        Write.S(kt.ref(keys.offsets(n)), bytes(8 * (h.count + 1))),
        Write.S(kt.ref(keys.shapes(n)), record * h.count),
    ]


def fits(leaf: Leaf, value: Value, h: Header) -> bool:
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
        ops.append(Write.C(kt.ref(keys.data(h.row[0])), kt.ref(keys.data(leaf.number)), h.row[1], leaf.col, eb))
    elif number is not None:
        # rows of eb bytes at column 0: the whole blob (a zero-byte leaf has none to copy)
        ops.append(
            Write.C(kt.ref(keys.data(leaf.number)), kt.ref(keys.data(number)), eb, 0, eb) if eb else Write.S(kt.ref(keys.data(number)), b"")
        )
    elif h.tracked:
        # the blobs stay: each segment's is checked, and allocated (zeros) where it was never
        # written, so that the tables below describe bytes that are there
        ops.append(Write.T(kt.ref(keys.data(leaf.number))))
    n = leaf.number if number is None else number
    ops += [
        Write.S(kt.ref(keys.offsets(n)), (np.arange(count + 1, dtype="<i8") * eb).tobytes()),
        Write.S(kt.ref(keys.shapes(n)), np.tile(np.asarray(leaf.shape, dtype="<i8"), count).tobytes()),
    ]
    return Leaf(leaf.path, n, leaf.dtype, leaf.ndim, None), ops


def het_payload(elems: list[torch.Tensor]) -> tuple[bytes, bytes, list[int]]:
    """Shape records, data and byte sizes of whole elements of a heterogeneous leaf, as 'E' and 'Y' ops take them."""
    data = b"".join(bytes(codec.to_bytes(t)) for t in elems)
    shapes = codec.pack_i64([s for t in elems for s in t.shape])
    return shapes, data, [t.numel() * t.element_size() for t in elems]


def splice_ops(kt: KeyTable, keys: StoreKeys, leaf: Leaf, order: list[int], elems: list[torch.Tensor]) -> list[list[Any]]:
    """'E' ops writing whole elements of a heterogeneous leaf, one op per run of consecutive ids."""
    last: dict[int, torch.Tensor] = {}
    for e, t in zip(order, elems):
        last[e] = t
    ids = np.array(sorted(last), dtype=np.int64)
    dk, ok, sk = kt.ref(keys.data(leaf.number)), kt.ref(keys.offsets(leaf.number)), kt.ref(keys.shapes(leaf.number))
    ops = []
    for lo, hi in index.runs(ids):
        shapes, data, sizes = het_payload([last[e] for e in range(lo, hi + 1)])
        ops.append(Write.E(dk, ok, sk, 8 * leaf.ndim, lo, hi, shapes, data, *sizes))
    return ops
