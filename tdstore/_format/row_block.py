"""The row block: small homogeneous leaves of a store kept side by side, one row per element.

Without it, every homogeneous leaf is its own blob, so reading the elements of a
random batch costs one ``GETRANGE`` per element *and leaf* inside the script, and
the server's per-call cost (about 1-2 microseconds each on Redis 7) is most of the
time of a batch read.  With it, the leaves chosen when a store gets its first keys
share one blob per segment whose element ``i`` is the row ``[i * width, (i + 1) * width)``
holding each grouped leaf's element bytes at the leaf's ``col``: a batch of 256
elements is 256 ``GETRANGE`` calls whatever the number of leaves, and ``store[i] = td``
writes one range.

The block is addressed like a homogeneous uint8 leaf of ``width`` bytes per element
(:attr:`Header.block`), so every read planner, segment localizer and script op that
handles homogeneous leaves handles it unchanged: planners swap the grouped leaves for
the block (:func:`units`) and cut the columns out of the rows they get back
(:func:`split`).  Writes of whole rows (every live column) go to the block as rows
(:func:`join`); writes of some columns become one range per element and column.

Which leaves group (:func:`choose`): homogeneous tensor leaves of a store without an
inner batch size, each at most :data:`MAX_COLUMN_BYTES` per element, while the row
stays within :data:`MAX_ROW_BYTES`, and only when at least two qualify (one leaf alone
gains nothing).  Larger leaves keep blobs of their own: reading one of them whole
(or a slice of it) would otherwise move every other column too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tdstore._format import codec
from tdstore._format.schema import Header, Leaf, NestedPath

MAX_COLUMN_BYTES = 4096
"""Largest element (bytes) of a leaf that joins the row block."""

MAX_ROW_BYTES = 16384
"""Largest row: the block's bytes per element."""


def choose(leaves: list[Leaf], inner: tuple[int, ...]) -> tuple[dict[NestedPath, int], int]:
    """Columns ``{path: byte offset}`` and row width for the leaves a new store groups (``({}, 0)``: no block)."""
    if inner:
        return {}, 0
    cols: dict[NestedPath, int] = {}
    width = 0
    for leaf in leaves:
        if leaf.het or leaf.json:
            continue
        eb = leaf.element_nbytes
        if 0 < eb <= MAX_COLUMN_BYTES and width + eb <= MAX_ROW_BYTES:
            cols[leaf.path] = width
            width += eb
    if len(cols) < 2:
        return {}, 0
    return cols, width


def grouped_header(h: Header, block_number: int) -> Header:
    """``h`` (a store getting its first keys) with the row block chosen, under leaf number ``block_number``."""
    cols, width = choose(list(h.leaves.values()), h.inner)
    if not cols:
        return h
    leaves = {path: replace(leaf, col=cols[path]) if path in cols else leaf for path, leaf in h.leaves.items()}
    return replace(h, leaves=leaves, row=(block_number, width), next_leaf=max(h.next_leaf, block_number + 1))


def units(h: Header, leaves: list[Leaf]) -> tuple[list[Leaf], Leaf | None, list[Leaf]]:
    """What a read fetches for ``leaves``: the leaves with the grouped ones swapped for the block
    (in the place of the first of them), the block (or ``None``), and the grouped leaves asked for."""
    grouped = [leaf for leaf in leaves if leaf.col is not None]
    if not grouped:
        return leaves, None, []
    block = h.block
    assert block is not None
    out: list[Leaf] = []
    for leaf in leaves:
        if leaf.col is None:
            out.append(leaf)
        elif leaf is grouped[0]:
            out.append(block)
    return out, block, grouped


_NUMPY = {dtype: torch.empty(0, dtype=dtype).numpy().dtype for dtype in codec.NUMPY_NATIVE}


def split(rows: torch.Tensor | np.ndarray, grouped: list[Leaf]) -> dict[NestedPath, torch.Tensor]:
    """Columns of ``rows`` (uint8, ``(..., width)``; a read-only view of a reply will do) as each
    grouped leaf's tensor ``(..., *shape)``.

    Each column is copied once into storage of its own (aligned for its dtype); numpy
    does it where it knows the dtype, at a third of the cost of the torch ops.
    """
    lead = tuple(rows.shape[:-1])
    flat = rows if isinstance(rows, np.ndarray) else rows.numpy()
    out = {}
    for leaf in grouped:
        col, leaf_shape = leaf.col, leaf.shape
        assert col is not None and leaf_shape is not None  # a grouped leaf: a homogeneous leaf with a column
        eb = leaf.element_nbytes
        shape = lead + tuple(leaf_shape)
        np_dtype = _NUMPY.get(leaf.dtype)
        if np_dtype is not None:
            out[leaf.path] = torch.from_numpy(flat[..., col : col + eb].copy().view(np_dtype).reshape(shape))
        else:
            t = torch.from_numpy(flat[..., col : col + eb].copy())
            out[leaf.path] = t.view(leaf.dtype).reshape(shape)
    return out


def join(width: int, columns: list[tuple[Leaf, np.ndarray]]) -> np.ndarray:
    """Rows ``(n, width)`` uint8 with each ``(leaf, data (n, element bytes))`` at its column (dead gaps zero)."""
    n = columns[0][1].shape[0]
    whole = sum(data.shape[1] for _, data in columns) == width  # no dead gap to zero
    rows = (np.empty if whole else np.zeros)((n, width), dtype=np.uint8)
    for leaf, data in columns:
        col = leaf.col
        assert col is not None  # a grouped leaf
        rows[:, col : col + data.shape[1]] = data
    return rows


def covers_block(h: Header, paths: Any) -> bool:
    """Whether ``paths`` name every leaf of the row block (a write of them can write whole rows)."""
    live = [leaf.path for leaf in h.leaves.values() if leaf.col is not None]
    return bool(live) and all(p in paths for p in live)
