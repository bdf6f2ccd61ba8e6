"""A checkpoint's files read back as the upload's leaf scans: a dense key's rows by memory map, a ragged
key's rows with its offsets and shapes, each checked against the metadata before anything is sent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tdstore._checkpoint.disk_format import (
    CheckpointError,
    CheckpointMeta,
    KeyEntry,
    inside,
)
from tdstore._format import codec as _codec
from tdstore._format.nontensor import decode
from tdstore._front.upload_scan import LeafScan

#: Elements of a ragged key whose offsets and shapes are checked at a time.
CHECK_ELEMENTS = 10_000
#: Bytes per read of the priority tree's file when it is checked.
TREE_PIECE = 1 << 20


class _DenseRows:
    """The rows of a homogeneous key's memmap file, read a chunk at a time as one tensor (the
    upload sends a chunk's bytes as they are; a tensor per row would cost more than the upload)."""

    def __init__(self, file: Path, e: KeyEntry, count: int) -> None:
        assert e.shape is not None
        self._mm = np.memmap(file, dtype=np.uint8, mode="r") if count * e.element_nbytes else None
        self._e, self._count = e, count

    def __len__(self) -> int:
        return self._count

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        e = self._e
        assert e.shape is not None
        nb = e.element_nbytes
        raw = bytearray(self._mm[lo * nb : hi * nb]) if self._mm is not None else bytearray()
        return _codec.from_bytes(raw, _codec.DTYPES[e.dtype], (hi - lo, *e.shape))


class _RaggedRows:
    """The elements of a heterogeneous or non-tensor key's files, read a chunk at a time as one flat
    tensor of the chunk's bytes (see :class:`_DenseRows`), and their shapes (``shapes``, a memmap)."""

    def __init__(self, root: Path, e: KeyEntry, count: int) -> None:
        self._e, self._count = e, count
        self.offsets = np.memmap(root / f"{e.file}.offsets", dtype="<i8", mode="r")
        self.shapes = np.memmap(root / f"{e.file}.shapes", dtype="<i8", mode="r").reshape(count, e.ndim)
        size = (root / f"{e.file}.data").stat().st_size
        self._data = np.memmap(root / f"{e.file}.data", dtype=np.uint8, mode="r") if size else None

    def __len__(self) -> int:
        return self._count

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        off = self.offsets[lo : hi + 1].astype(np.int64)
        raw = bytearray(self._data[off[0] : off[-1]]) if self._data is not None else bytearray()
        dtype = _codec.DTYPES[self._e.dtype]
        return _codec.from_bytes(raw, dtype, (len(raw) // dtype.itemsize,))


class _FileLeaf(LeafScan):
    """A leaf of the upload whose elements come from the checkpoint's files, a chunk at a time."""

    def __init__(self, e: KeyEntry, rows: _DenseRows | _RaggedRows, sizes: np.ndarray) -> None:
        shapes = rows.shapes if isinstance(rows, _RaggedRows) else None
        super().__init__(e.path, _codec.DTYPES[e.dtype], [], e.shape if e.layout == "dense" else None, shapes, json=e.layout == "json")
        self.__dict__["sizes"] = sizes  # the cached property, known from the files
        self._rows = rows

    def data(self, lo: int, hi: int) -> torch.Tensor:
        return self._rows.chunk(lo, hi)


def _check_ragged(root: Path, e: KeyEntry, rows: _RaggedRows, count: int, inner: tuple[int, ...]) -> np.ndarray:
    """Every element's offsets, shape and (non-tensor) JSON document checked; returns the element sizes."""
    off = rows.offsets
    what = f"{root} is not a valid tdstore checkpoint: key {e.path!r}"
    data_size = (root / f"{e.file}.data").stat().st_size
    if off[0] != 0 or off[count] != data_size:
        raise CheckpointError(f"{what}: its offsets run from {int(off[0])} to {int(off[count])}, its data holds {data_size} bytes")
    sizes = np.diff(np.asarray(off, dtype=np.int64))
    itemsize = _codec.DTYPES[e.dtype].itemsize
    for lo in range(0, count, CHECK_ELEMENTS):
        hi = min(count, lo + CHECK_ELEMENTS)
        dims = np.asarray(rows.shapes[lo:hi])
        bad = np.flatnonzero((sizes[lo:hi] < 0) | (dims < 0).any(1) | (np.prod(dims, axis=1) * itemsize != sizes[lo:hi]))
        if bad.size:
            i = lo + int(bad[0])
            raise CheckpointError(f"{what}: element {i} has shape {dims[i - lo].tolist()} but {int(sizes[i])} bytes")
        if e.layout == "json":
            chunk = rows.chunk(lo, hi).numpy().tobytes()
            ends = np.asarray(off[lo : hi + 1], dtype=np.int64) - int(off[lo])
            for i in range(hi - lo):
                try:
                    decode(chunk[ends[i] : ends[i + 1]], inner)
                except ValueError as err:
                    raise CheckpointError(f"{what}: element {lo + i}: {err}") from None
    return sizes


def check_tree(root: Path, rel: str) -> None:
    """Every weight and sum of the priority tree finite and >= 0 (the server would refuse to draw from it otherwise)."""
    mm = np.memmap(inside(root, rel, "the priority tree"), dtype="<f8", mode="r")
    step = TREE_PIECE // 8
    for lo in range(0, mm.size, step):
        part = np.asarray(mm[lo : lo + step])
        if not (np.isfinite(part).all() and (part >= 0).all()):
            raise CheckpointError(f"{root} is not a valid tdstore checkpoint: its priority tree holds a negative or non-finite weight")


def leaf_scans(root: Path, meta: CheckpointMeta) -> list[LeafScan]:
    out: list[LeafScan] = []
    for e in meta.keys:
        if e.layout == "dense":
            assert e.shape is not None
            rows = _DenseRows(inside(root, e.file, f"key {e.path!r}"), e, meta.count)
            sizes = np.full(meta.count, e.element_nbytes, dtype=np.int64)
            out.append(_FileLeaf(e, rows, sizes))
        else:
            ragged = _RaggedRows(root, e, meta.count)
            sizes = _check_ragged(root, e, ragged, meta.count, meta.inner)
            out.append(_FileLeaf(e, ragged, sizes))
    return out
