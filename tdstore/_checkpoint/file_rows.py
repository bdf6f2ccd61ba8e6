"""A checkpoint's files read back as the upload's leaf scans: a dense key's rows, a ragged key's rows with its
offsets and shapes, each checked against the metadata before anything is sent.

No file stays open: a chunk of rows is read by opening its file (``folder.open_file``: no symlink
followed, a regular file only), reading the chunk's bytes and closing it, so a checkpoint of any number
of keys imports under any limit of open files (a memory map per key held one descriptor per key: 1,500
keys failed with "Too many open files").  A ragged key's offsets and shapes are read whole (8 bytes per
element and dim, as the upload's element sizes are).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tdstore._checkpoint.disk_format import CheckpointMeta, KeyEntry
from tdstore._checkpoint.folder import CheckpointError, file_size, opened, read_at, read_range
from tdstore._format import codec
from tdstore._format.header_info import MAX_INT
from tdstore._format.nontensor import decode
from tdstore._format.sampling_policy import TREE_FAN, WEIGHT_SUM
from tdstore._front.upload_scan import LeafScan

#: Elements of a ragged key whose offsets and shapes are checked at a time.
CHECK_ELEMENTS = 10_000
#: Nodes of the priority tree checked at a time (their children read in one piece).
TREE_NODES = 1 << 16


def _bad(root: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{root} is not a valid tdstore checkpoint: {what}")


class _DenseRows:
    """The rows of a homogeneous key's file, read a chunk at a time as one tensor (the upload sends a
    chunk's bytes as they are; a tensor per row would cost more than the upload)."""

    def __init__(self, root: Path, e: KeyEntry, count: int) -> None:
        assert e.shape is not None
        self._root, self._e, self._count = root, e, count

    def __len__(self) -> int:
        return self._count

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        e = self._e
        assert e.shape is not None
        nb = e.element_nbytes
        raw = read_range(self._root, e.file, lo * nb, (hi - lo) * nb, f"key {e.path!r}") if nb and hi > lo else bytearray()
        return codec.from_bytes(raw, codec.DTYPES[e.dtype], (hi - lo, *e.shape))


def _int64s(root: Path, rel: str, n: int, what: str) -> np.ndarray:
    """The ``n`` little-endian int64 of the file ``rel`` (its size checked already)."""
    return np.frombuffer(read_range(root, rel, 0, 8 * n, what), dtype="<i8").astype(np.int64) if n else np.zeros(0, np.int64)


class _RaggedRows:
    """The elements of a heterogeneous or non-tensor key's files, read a chunk at a time as one flat
    tensor of the chunk's bytes (see :class:`_DenseRows`), and their shapes (``shapes``)."""

    def __init__(self, root: Path, e: KeyEntry, count: int) -> None:
        what = f"key {e.path!r}"
        self._root, self._e, self._count = root, e, count
        self.offsets = _int64s(root, f"{e.file}.offsets", count + 1, what)
        self.shapes = _int64s(root, f"{e.file}.shapes", count * e.ndim, what).reshape(count, e.ndim)
        self.data_size = file_size(root, f"{e.file}.data", what)

    def __len__(self) -> int:
        return self._count

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        raw = read_range(self._root, f"{self._e.file}.data", a, b - a, f"key {self._e.path!r}") if b > a else bytearray()
        dtype = codec.DTYPES[self._e.dtype]
        return codec.from_bytes(raw, dtype, (len(raw) // dtype.itemsize,))


class _FileLeaf(LeafScan):
    """A leaf of the upload whose elements come from the checkpoint's files, a chunk at a time."""

    def __init__(self, e: KeyEntry, rows: _DenseRows | _RaggedRows, sizes: np.ndarray) -> None:
        shapes = rows.shapes if isinstance(rows, _RaggedRows) else None
        super().__init__(e.path, codec.DTYPES[e.dtype], [], e.shape if e.layout == "dense" else None, shapes, json=e.layout == "json")
        self.__dict__["sizes"] = sizes  # the cached property, known from the files
        self._rows = rows

    def data(self, lo: int, hi: int) -> torch.Tensor:
        return self._rows.chunk(lo, hi)


def _check_ragged(root: Path, e: KeyEntry, rows: _RaggedRows, count: int, inner: tuple[int, ...]) -> np.ndarray:
    """Every element's offsets, shape (each dim and their product at most 2**53, the store's inner batch
    size first) and (non-tensor) JSON document checked; returns the element sizes."""
    off = rows.offsets
    what = f"key {e.path!r}"
    if off[0] != 0 or off[count] != rows.data_size:
        raise _bad(root, f"{what}: its offsets run from {int(off[0])} to {int(off[count])}, its data holds {rows.data_size} bytes")
    sizes = np.diff(off)
    itemsize = codec.DTYPES[e.dtype].itemsize
    lead = np.asarray(inner, dtype=np.int64) if e.layout != "json" else np.zeros(0, np.int64)
    if e.layout != "json" and e.ndim < len(inner):
        raise _bad(root, f"{what}: its elements have {e.ndim} dims, fewer than the inner batch size {list(inner)}")
    for lo in range(0, count, CHECK_ELEMENTS):
        hi = min(count, lo + CHECK_ELEMENTS)
        dims = rows.shapes[lo:hi]
        items = np.prod(dims.astype(np.float64), axis=1)  # no int64 overflow: a product past 2**53 is refused as a float
        bad = (sizes[lo:hi] < 0) | (dims < 0).any(1) | (dims > MAX_INT).any(1) | (items > MAX_INT)
        bad |= ~bad & (np.prod(np.where(bad[:, None], 0, dims), axis=1) * itemsize != sizes[lo:hi])
        if lead.size:
            bad |= (dims[:, : lead.size] != lead).any(1)
        found = np.flatnonzero(bad)
        if found.size:
            i = lo + int(found[0])
            shape = dims[i - lo].tolist()
            raise _bad(root, f"{what}: element {i} has shape {shape} but {int(sizes[i])} bytes (its dims must start with {list(inner)})")
        if e.layout == "json":
            chunk = rows.chunk(lo, hi).numpy().tobytes()
            ends = off[lo : hi + 1] - int(off[lo])
            for i in range(hi - lo):
                try:
                    decode(chunk[ends[i] : ends[i + 1]], inner)
                except ValueError as err:
                    raise _bad(root, f"{what}: element {lo + i}: {err}") from None
    return sizes


def _tree_levels(count: int) -> list[tuple[int, int, int]]:
    """``(nodes, byte offset, bytes per node)`` of each level of a tree of ``count`` leaves (``tds_tree_layout``)."""
    levels, at, n = [(count, 0, 8)], 8 * count, count
    while n > 1:
        n = -(-n // TREE_FAN)
        levels.append((n, at, 16))
        at += 16 * n
    return levels


def _nodes(fd: int, level: tuple[int, int, int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Sums and mins of nodes ``lo .. hi - 1`` of a level (a leaf's min is its weight)."""
    n, at, width = level
    raw = np.frombuffer(read_at(fd, at + lo * width, (hi - lo) * width), dtype="<f8")
    if width == 8:
        return raw, raw
    pairs = raw.reshape(hi - lo, 2)
    return pairs[:, 0], pairs[:, 1]


def check_tree(root: Path, rel: str, count: int, written: int) -> None:
    """The priority tree as the server would draw from it: every weight finite, >= 0 and at most
    ``WEIGHT_SUM / count`` (what ``lua/_tree.lua`` accepts), none on a slot never written (``written``
    and on: a draw would return a slot of zeros), every node's sum its children's (within the
    tolerance a draw checks) and its min within its sum, positive exactly when its sum is."""
    levels = _tree_levels(count)
    cap = WEIGHT_SUM / max(count, 1)
    with opened(root, rel, "the priority tree") as fd:
        for k, level in enumerate(levels):
            n = level[0]
            for lo in range(0, n, TREE_NODES * TREE_FAN):
                hi = min(n, lo + TREE_NODES * TREE_FAN)
                sums, mins = _nodes(fd, level, lo, hi)
                if not (np.isfinite(sums).all() and np.isfinite(mins).all() and (mins >= 0).all() and (mins <= sums).all()):
                    raise _bad(root, f"its priority tree holds a negative or non-finite weight (level {k + 1})")
                if ((sums > 0) != (mins > 0)).any():
                    raise _bad(root, f"its priority tree holds a node whose smallest weight and sum disagree (level {k + 1})")
                if k == 0:
                    if (sums > cap).any():
                        raise _bad(root, f"its priority tree holds a weight above {cap:.6g} (a sum of {count} of them could overflow)")
                    if hi > written and (sums[max(0, written - lo) :] != 0).any():
                        raise _bad(root, f"its priority tree gives weight to a slot never written (slot {written} or later)")
                if k + 1 < len(levels):
                    parents = levels[k + 1]
                    p_lo, p_hi = lo // TREE_FAN, -(-hi // TREE_FAN)
                    p_sums, p_mins = _nodes(fd, parents, p_lo, p_hi)
                    pad = (p_hi - p_lo) * TREE_FAN - (hi - lo)
                    total = np.concatenate([sums, np.zeros(pad)]).reshape(-1, TREE_FAN).sum(axis=1)
                    positive = np.where(mins > 0, mins, np.inf)
                    low = np.concatenate([positive, np.full(pad, np.inf)]).reshape(-1, TREE_FAN).min(axis=1)
                    low = np.where(np.isinf(low), 0.0, low)
                    near = np.abs(total - p_sums) <= 1e-9 * np.maximum(total, p_sums)
                    near &= np.abs(low - p_mins) <= 1e-9 * np.maximum(low, p_mins)
                    if not near.all():
                        raise _bad(root, f"its priority tree holds a node (level {k + 2}) that disagrees with its children")


def leaf_scans(root: Path, meta: CheckpointMeta) -> list[LeafScan]:
    """The checkpoint's keys as the upload's leaves, every ragged key's offsets, shapes and documents checked."""
    out: list[LeafScan] = []
    for e in meta.keys:
        if e.layout == "dense":
            assert e.shape is not None
            sizes = np.full(meta.count, e.element_nbytes, dtype=np.int64)
            out.append(_FileLeaf(e, _DenseRows(root, e, meta.count), sizes))
        else:
            ragged = _RaggedRows(root, e, meta.count)
            out.append(_FileLeaf(e, ragged, _check_ragged(root, e, ragged, meta.count, meta.inner)))
    return out
