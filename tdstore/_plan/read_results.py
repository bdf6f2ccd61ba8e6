"""What a planned read gives back: a dense result (one tensor per key) or one tensor per element, and the
bytes of heterogeneous elements split into tensors (checked against the element count and shapes first).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tdstore._errors import StoreDamagedError
from tdstore._format import codec, nontensor, row_block
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.offsets import OffsetTables
from tdstore._format.schema import Header, Leaf, NestedPath


class ReadHost(Protocol):
    """What the planners use of the engine that runs their calls."""

    keys: StoreKeys
    transactions: bool  # the server takes MULTI/EXEC (off for good once it refuses it)
    offsets: OffsetTables

    @property
    def tx_reads(self) -> bool: ...  # this thread's reads may go as transactions now

    def key_table(self, h: Header) -> KeyTable: ...

    def where(self) -> str: ...


class NotRagged(Exception):
    """The leaf a ragged read was planned for holds no heterogeneous tensor data (any more)."""


@dataclass
class DenseResult:
    """Leaves read as tensors of the indexed batch shape (every leaf homogeneous)."""

    batch_size: torch.Size
    leaves: dict[NestedPath, torch.Tensor]
    fields: dict[str, bytes | None] | None = None
    """Header fields read in the same transaction (``read(..., fields=...)``); None when the read went through a script."""


@dataclass
class ElementsResult:
    """Leaves read per element: ``columns[path][k]`` holds element ``ids[k]``'s tensor (or value) of leaf ``path``."""

    ids: list[int]
    paths: list[NestedPath]
    """The keys in the order the store lists them."""
    columns: Mapping[NestedPath, Sequence[Any]]


def _shape(leaf: Leaf) -> tuple[int, ...]:
    """The element shape of a homogeneous leaf (a heterogeneous one has none)."""
    assert leaf.shape is not None, leaf.path
    return leaf.shape


def _columns(leaf: Leaf, rows: torch.Tensor, block: Leaf | None, grouped: list[Leaf]) -> Iterable[tuple[NestedPath, torch.Tensor]]:
    """(path, tensor of the rows read) for a homogeneous leaf read, or for each grouped leaf when it is the row block."""
    if leaf is block:
        return row_block.split(rows, grouped).items()
    return ((leaf.path, rows),)


def het_rows(leaf: Leaf, inner: tuple[int, ...], n: int, bounds: bytes, shapes: bytes, data: bytes) -> list[Any]:
    """The ``n`` elements of a heterogeneous leaf read by row ('Y' of ``read.lua``): packed (start,
    end) byte bounds, shape records and the data joined; non-tensor leaves decode their JSON."""
    b = codec.unpack_i64(bounds).reshape(n, 2)
    return split_elements(leaf, inner, n, (b[:, 1] - b[:, 0]).tolist(), shapes, data)


def split_elements(leaf: Leaf, inner: tuple[int, ...], n: int, sizes: list[int], shapes: bytes, data: bytes) -> list[Any]:
    """The ``n`` elements of a heterogeneous leaf whose bytes are ``data``, back to back (``sizes``
    bytes each), and whose shape records are ``shapes``: one view of one buffer each (non-tensor
    leaves decode their JSON)."""
    check_elements(leaf, n, sizes, None if leaf.json else shapes, len(data))
    if leaf.json:
        ends = np.cumsum([0, *sizes]).tolist()
        return [nontensor.decode(data[ends[k] : ends[k + 1]], inner) for k in range(n)]
    item = leaf.dtype.itemsize
    if leaf.ndim == 1 and data and not any(size % item for size in sizes):
        # one-dim elements: split the typed buffer into its rows, one view each, already shaped
        return list(torch.frombuffer(bytearray(data), dtype=leaf.dtype).split([size // item for size in sizes]))
    dims = codec.unpack_i64(shapes).reshape(n, leaf.ndim).tolist() if leaf.ndim else [[]] * n
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return [piece.view(leaf.dtype).reshape(dim) for piece, dim in zip(buf.split(sizes), dims)]


#: Up to this many elements, :func:`check_elements` checks in plain Python first (numpy's per-call cost
#: was a fifth of an element read).
_FEW_ELEMENTS = 8


def _few_elements_agree(leaf: Leaf, n: int, sizes: list[int] | None, shapes: bytes | None, nbytes: int) -> bool:
    """Whether a few elements' sizes and shape records agree with the ``nbytes`` read, in plain Python;
    False sends the caller to the full check, which names what disagrees."""
    if sizes is not None and (len(sizes) != n or min(sizes, default=0) < 0 or sum(sizes) != nbytes):
        return False
    if shapes is None:
        return True
    if len(shapes) != 8 * n * leaf.ndim:
        return False
    dims = struct.unpack(f"<{n * leaf.ndim}q", shapes)
    if any(d < 0 or d >= 2**53 for d in dims):
        return False
    total = 0
    for i in range(n):
        size = leaf.dtype.itemsize
        for d in dims[i * leaf.ndim : (i + 1) * leaf.ndim]:
            size *= d
        if sizes is not None and size != sizes[i]:
            return False
        total += size
    return total == nbytes


def check_elements(leaf: Leaf, n: int, sizes: list[int] | np.ndarray | None, shapes: bytes | np.ndarray | None, nbytes: int) -> None:
    """Check that ``n`` elements of a heterogeneous leaf hold what their offsets (``sizes``, bytes each;
    None: not read) and shape records (``shapes``, ``ndim`` int64 each; None: not checked) say, and that
    together they are the ``nbytes`` read: a table edited by hand (offsets shuffled or out of the data,
    records that disagree with the data) raises ``StoreDamagedError``, never torch's split or view errors.
    Vectorised: a padded read of many elements makes no Python object per element."""
    if n <= _FEW_ELEMENTS and not isinstance(shapes, np.ndarray) and not isinstance(sizes, np.ndarray):
        if _few_elements_agree(leaf, n, sizes, shapes, nbytes):
            return
    key = leaf.path[0] if len(leaf.path) == 1 else leaf.path
    what = f"the offset and shape tables of key {key!r} disagree with its data (written by another client?)"
    if sizes is not None:
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.size != n or (sizes < 0).any() or int(sizes.sum()) != nbytes:
            raise StoreDamagedError(f"{what}: element sizes {sizes[:8].tolist()} for {nbytes} bytes", named=False)
    if shapes is None:
        return
    dims = shapes if isinstance(shapes, np.ndarray) else codec.unpack_i64(shapes)
    if dims.size != n * leaf.ndim or (dims < 0).any() or (dims >= 2**53).any():
        raise StoreDamagedError(f"{what}: bad shape records", named=False)
    elements = dims.reshape(n, leaf.ndim).astype(np.float64).prod(axis=1) * leaf.dtype.itemsize
    if sizes is not None and not np.array_equal(elements, np.asarray(sizes, dtype=np.float64)):
        raise StoreDamagedError(f"{what}: shape records give {elements[:8].tolist()} bytes, the offsets {sizes[:8].tolist()}", named=False)
    if sizes is None and float(elements.sum()) != nbytes:
        raise StoreDamagedError(f"{what}: shape records give {float(elements.sum()):.0f} bytes, {nbytes} were read", named=False)
