"""Step 1 of an upload (see ``_front.upload``): the elements' keys, dtypes and shapes, checked and
collected before anything is written.

Keys present in only some elements, a key with two dtypes or two numbers of dims, and
values that are neither tensors nor non-tensor data raise here, naming the key and the
element.  :func:`scan` is the general walk and words every error; :func:`scan_plain`,
:func:`scan_lazy` and :func:`scan_dense` are fast paths for the common inputs that hand
anything unusual to it.

The fast paths never call Python code per element: each check is one pass of a C-level
``map``/``set`` over a block of elements or a key's tensors in it (their classes, batch sizes,
numbers of keys, dtypes), and a key's data is gathered by ``torch.stack``/``torch.cat``, which
also checks that every element has one shape.  Gathered columns are kept
(:attr:`LeafScan.packed`, at most ``budget`` bytes in all: an upload of one chunk holds them
anyway); the chunks slice them instead of gathering again.  What is left is torch's and
Python's cost per tensor (tools/README.md, "Uploads against the floor").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_non_tensor, is_tensorclass
from tensordict.base import _is_leaf_nontensor

from tdstore._format import codec
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.schema import NestedPath, check_paths
from tdstore._plan.values import as_path, display

__all__ = ["LeafScan", "scan", "scan_dense", "scan_lazy", "scan_plain", "stack_elements"]

_BATCH = attrgetter("_batch_size")
_DICT = attrgetter("_tensordict")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


@dataclass(eq=False)
class LeafScan:
    """One leaf across the stack: its dtype, every element's tensor (references, no copies) and
    their shapes: ``shape`` when every element has that one shape (the leaf is one blob of
    fixed-size elements), else ``shapes``, one row of dims per element (a heterogeneous or a
    non-tensor leaf)."""

    path: NestedPath
    dtype: torch.dtype
    tensors: Sequence[torch.Tensor] = field(repr=False)  # empty when ``packed`` holds every element
    shape: tuple[int, ...] | None
    shapes: np.ndarray | None = None  # (count, ndim) int64 when ``shape`` is None
    json: bool = False  # a non-tensor key: each tensor is an element's JSON document
    packed: torch.Tensor | None = field(default=None, repr=False)  # every element's data: (count, *shape), or flat if heterogeneous

    @classmethod
    def of(
        cls, path: NestedPath, dtype: torch.dtype, tensors: list[torch.Tensor], shapes: list[torch.Size], json: bool = False
    ) -> LeafScan:
        """A leaf from its elements' tensors and shapes (the general scans)."""
        if not json and len(set(shapes)) == 1:  # torch.Size hashes as a tuple: one pass in C
            return cls(path, dtype, tensors, tuple(shapes[0]))
        ndim = len(shapes[0])
        return cls(path, dtype, tensors, None, np.array(shapes, dtype=np.int64).reshape(len(shapes), ndim), json=json)

    @property
    def homogeneous(self) -> bool:
        return self.shape is not None

    @property
    def ndim(self) -> int:
        if self.shape is not None:
            return len(self.shape)
        assert self.shapes is not None
        return self.shapes.shape[1]

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Bytes of each element of this leaf (int64)."""
        item = self.dtype.itemsize
        if self.shape is not None:
            count = len(self.packed) if self.packed is not None else len(self.tensors)
            return np.full(count, math.prod(self.shape) * item, dtype=np.int64)
        assert self.shapes is not None
        return np.prod(self.shapes, axis=1, dtype=np.int64) * item

    def element_bytes(self) -> np.ndarray:
        return self.sizes

    @functools.cached_property
    def _ends(self) -> np.ndarray:
        """Where each element ends in :attr:`packed` of a heterogeneous leaf (items; a 0 first)."""
        return np.concatenate(([0], np.cumsum(self.sizes // self.dtype.itemsize)))

    def data(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` as one tensor whose bytes are theirs, one after the other."""
        if self.packed is not None:
            if self.shape is not None:
                return self.packed[lo:hi]
            ends = self._ends
            return self.packed[int(ends[lo]) : int(ends[hi])]
        part = self.tensors[lo:hi]
        with torch.inference_mode():
            if self.shape is not None:
                return _stack(part)
            return _cat(part, self.sizes[lo:hi] // self.dtype.itemsize)

    def shape_rows(self, lo: int, hi: int) -> np.ndarray:
        """The dims of elements ``[lo, hi)`` of a heterogeneous leaf, ``(hi - lo, ndim)`` int64."""
        assert self.shapes is not None
        return np.asarray(self.shapes[lo:hi], dtype=np.int64)


def stack_elements(td: Any) -> tuple[list[TensorDictBase], int]:
    """The elements of the stack and the stack dim: a lazy stack's members, or any other tensordict unbound along dim 0."""
    if is_tensorclass(td):
        td = td._tensordict
    if isinstance(td, LazyStackedTensorDict):
        return list(td.tensordicts), td.stack_dim
    if isinstance(td, TensorDictBase):
        if not td.batch_dims:
            raise ValueError("from_lazy_stack needs a tensordict with at least one batch dim (the stack dim)")
        return list(td.unbind(0)), 0
    raise TypeError(f"from_lazy_stack expects a LazyStackedTensorDict, got {type(td).__name__}")


@dataclass
class _Column:
    """A leaf while :func:`scan` walks the elements."""

    dtype: torch.dtype
    tensors: list[torch.Tensor]
    shapes: list[torch.Size]
    json: bool = False


def scan(elements: list[TensorDictBase]) -> tuple[tuple[int, ...], list[LeafScan]]:
    """Check every element's keys, dtypes and shapes, and collect each leaf's tensors; nothing is copied."""
    if not elements:
        raise ValueError("cannot upload an empty stack (no elements)")
    inner = elements[0].batch_size
    leaves: dict[NestedPath, _Column] = {}
    paths: dict[Any, NestedPath] = {}
    for i, el in enumerate(elements):
        if el.batch_size != inner:
            raise ValueError(f"element {i} has batch size {list(el.batch_size)}, element 0 has {list(inner)}")
        for key, value in el.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
            path = paths.get(key)
            if path is None:
                path = paths[key] = as_path(key)
            col = leaves.get(path)
            if is_non_tensor(value):
                if col is not None and not col.json:
                    raise TypeError(f"key {display(path)!r} holds a tensor in element 0 but non-tensor data in element {i}")
                doc = element_docs(path, NonTensor(value), None, 0)[0]
                if col is None:
                    leaves[path] = _Column(torch.uint8, [doc], [doc.shape], json=True)
                else:
                    col.tensors.append(doc)
                    col.shapes.append(doc.shape)
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"key {display(path)!r} of element {i} is a {type(value).__name__}; a store holds tensors and NonTensorData"
                )
            if col is not None and col.json:
                raise TypeError(f"key {display(path)!r} holds non-tensor data in element 0 but a tensor in element {i}")
            if col is None:
                codec.dtype_name(value.dtype)
                leaves[path] = _Column(value.dtype, [value], [value.shape])
                continue
            if value.dtype != col.dtype:
                raise TypeError(
                    f"key {display(path)!r} has dtype {col.dtype} in element 0 but {value.dtype} in element {i}; "
                    "every element must use one dtype per key"
                )
            shape = value.shape
            if len(shape) != len(col.shapes[0]):
                raise ValueError(f"key {display(path)!r} has {len(col.shapes[0])} dims in element 0 but shape {list(shape)} in element {i}")
            col.tensors.append(value)
            col.shapes.append(shape)
    partial = [path for path, c in leaves.items() if len(c.tensors) != len(elements)]
    if partial:
        missing = {}
        for path in partial:
            name = path if len(path) > 1 else path[0]
            missing[display(path)] = [i for i, el in enumerate(elements) if name not in el.keys(include_nested=True, leaves_only=True)][:5]
        raise ValueError(f"keys present in only some elements (missing from elements {missing}); every element must hold the same keys")
    check_paths(list(leaves))
    return tuple(inner), [LeafScan.of(path, c.dtype, c.tensors, c.shapes, c.json) for path, c in leaves.items()]


def scan_plain(elements: list[TensorDictBase], budget: int = 0) -> tuple[tuple[int, ...], list[LeafScan]] | None:
    """:func:`scan` for elements that are all plain TensorDicts of one key tree holding plain tensors
    (the common upload), gathering each key's data while ``budget`` bytes last (:attr:`LeafScan.packed`).

    Reads the elements' key dicts directly, :data:`_BLOCK` elements at a time: for each block,
    one C-level pass per check (classes, batch sizes, numbers of keys, dtypes) and one
    ``torch.stack`` per key into its gathered column, while the block's objects are still in
    the CPU's cache (a pass over all 10,000 elements of a key would find them evicted by the
    previous key's).  Returns None for anything else (other classes, non-tensor data, keys in
    some elements only, mixed dtypes or ndims, sub-trees whose batch sizes differ): :func:`scan`
    handles those and words the errors.
    """
    first = elements[0]
    plan = _Plan.of(first)
    if plan is None:
        return None
    n = len(elements)
    plan.left = budget
    for slot in plan.slots:
        codec.dtype_name(slot.dtype)
        est = slot.first.nbytes * n
        if not _same_shapes(elements, slot):
            slot.shapes, slot.pieces = [], []  # heterogeneous: shapes and bytes gathered block by block
        elif est <= plan.left:
            slot.out = torch.empty((n, *slot.first.shape), dtype=slot.dtype, device=slot.first.device)
            plan.left -= est
    with torch.inference_mode():
        for a in range(0, n, _BLOCK):
            if not plan.block(elements[a : a + _BLOCK], a):
                return None
    leaves = []
    for slot in plan.slots:
        leaf = slot.leaf(plan.left)
        if leaf is None:
            return None
        if slot.shapes is None and leaf.packed is not None and leaf.shape is None:
            plan.left -= leaf.packed.nbytes
        leaves.append(leaf)
    check_paths([leaf.path for leaf in leaves])
    return tuple(first.batch_size), leaves


_BLOCK = 512
"""Elements per block of :func:`scan_plain`: their objects (a few KiB each) stay in a core's cache."""


def _same_shapes(elements: list[TensorDictBase], slot: _Slot) -> bool:
    """Whether a few elements (a third, half way, the last) have the first one's shape for ``slot``."""
    shape = slot.first.shape
    for i in (len(elements) // 3, len(elements) // 2, -1):
        node: Any = elements[i]
        try:
            for part in slot.path:
                node = node._tensordict[part]
            if node.shape != shape:
                return False
        except (AttributeError, KeyError):
            return True  # not one tree: the scan finds it and returns None
    return True


@dataclass(eq=False)
class _Slot:
    """A key of :func:`scan_plain`: where it sits (``level``, ``key``), its first element, and its column."""

    path: NestedPath
    level: int
    key: Any
    first: torch.Tensor
    column: list[torch.Tensor] = field(default_factory=list, repr=False)
    out: torch.Tensor | None = field(default=None, repr=False)  # the gathered column, while every block stacks into it
    shapes: list[np.ndarray] | None = None  # a heterogeneous key's shapes, block by block
    pieces: list[torch.Tensor] | None = None  # and its bytes, while the budget lasts

    @property
    def dtype(self) -> torch.dtype:
        return self.first.dtype

    def add(self, col: list[torch.Tensor], a: int, plan: _Plan) -> bool:
        """One block's tensors (elements ``a..``): checked, kept, and gathered if the key is."""
        kinds = set(map(type, col))
        if len(kinds) != 1 or not issubclass(kinds.pop(), torch.Tensor) or set(map(_DTYPE, col)) != {self.dtype}:
            return False
        self.column += col
        if self.out is not None:
            per = max(1, _SERIAL // max(1, self.first.numel()))
            try:
                for c in range(0, len(col), per):
                    part = col[c : c + per]
                    torch.stack(part, out=self.out[a + c : a + c + len(part)])
            except RuntimeError:  # shapes differ: a heterogeneous key, gathered at the end
                self.out = None
        elif self.shapes is not None:
            return self._add_ragged(col, plan)
        return True

    def _add_ragged(self, col: list[torch.Tensor], plan: _Plan) -> bool:
        assert self.shapes is not None
        ndim = self.first.ndim
        shapes_list = list(map(_SHAPE, col))
        if ndim == 0 or set(map(len, shapes_list)) != {ndim}:
            return False
        shapes = np.fromiter(chain.from_iterable(shapes_list), dtype=np.int64, count=len(col) * ndim).reshape(len(col), ndim)
        self.shapes.append(shapes)
        if self.pieces is not None:
            numels = np.prod(shapes, axis=1)
            nbytes = int(numels.sum()) * self.dtype.itemsize
            if nbytes > plan.left:  # over the budget: the chunks gather it
                plan.left += sum(p.nbytes for p in self.pieces)
                self.pieces = None
                return True
            try:
                self.pieces.append(_cat(col, numels))
            except RuntimeError:  # tensors on several devices: the general scan and chunks handle them
                return False
            plan.left -= nbytes
        return True

    def leaf(self, left: int) -> LeafScan | None:
        """The key's :class:`LeafScan` once every block is in (None: the general scan must look)."""
        column, first = self.column, self.first
        if self.out is not None:
            return LeafScan(self.path, self.dtype, column, tuple(first.shape), packed=self.out)
        if self.shapes is not None:
            packed = torch.cat(self.pieces) if self.pieces else None
            return LeafScan(self.path, self.dtype, column, None, np.concatenate(self.shapes), packed=packed)
        if len(set(map(_SHAPE, column))) == 1:
            return LeafScan(self.path, self.dtype, column, tuple(first.shape))
        return _ragged_leaf(self.path, self.dtype, column, left)


@dataclass(eq=False)
class _Plan:
    """The key tree of the first element: its levels (the element and its sub-trees, parents first:
    ``(parent level, key in it, number of keys, batch size)``) and its keys (:class:`_Slot`)."""

    levels: list[tuple[int, Any, int, torch.Size]]
    slots: list[_Slot]
    left: int = 0  # bytes the scan may still gather

    @classmethod
    def of(cls, first: TensorDictBase) -> _Plan | None:
        if type(first) is not TensorDict:
            return None
        plan = cls([], [])
        return plan if plan._walk(first, -1, None, ()) else None

    def _walk(self, td: TensorDict, parent: int, key: Any, prefix: NestedPath) -> bool:
        level = len(self.levels)
        self.levels.append((parent, key, len(td._tensordict), td._batch_size))
        for k, value in td._tensordict.items():
            if type(value) is TensorDict:
                if not self._walk(value, level, k, (*prefix, k)):
                    return False
            elif isinstance(value, torch.Tensor):
                self.slots.append(_Slot((*prefix, k), level, k, value))
            else:
                return False
        return True

    def block(self, blk: list[TensorDictBase], a: int) -> bool:
        """Check elements ``a..`` (``blk``) against the plan and add their tensors to each key's column."""
        dicts: list[list[dict]] = []
        for parent, key, n_keys, batch in self.levels:
            if parent < 0:
                nodes: list[Any] = blk
            else:
                try:
                    nodes = [d[key] for d in dicts[parent]]
                except KeyError:
                    return False
            if set(map(type, nodes)) != {TensorDict} or set(map(_BATCH, nodes)) != {batch}:
                return False
            level = list(map(_DICT, nodes))
            if sum(map(len, level)) != n_keys * len(level):  # each holds the first's keys (found below), so no other
                return False
            dicts.append(level)
        for slot in self.slots:
            try:
                col = [d[slot.key] for d in dicts[slot.level]]
            except KeyError:
                return False
            if not slot.add(col, a, self):
                return False
        return True


def _ragged_leaf(path: NestedPath, dtype: torch.dtype, column: list[torch.Tensor], left: int) -> LeafScan | None:
    """A key whose elements differ in shape: their shapes (one number of dims, else None) and, if
    ``left`` bytes allow, their bytes gathered."""
    first, n = column[0], len(column)
    ndim = first.ndim
    if ndim == 0:
        return None
    shapes_list = list(map(_SHAPE, column))
    if set(map(len, shapes_list)) != {ndim}:
        return None
    shapes = np.fromiter(chain.from_iterable(shapes_list), dtype=np.int64, count=n * ndim).reshape(n, ndim)
    numels = np.prod(shapes, axis=1)
    packed: torch.Tensor | None = None
    if int(numels.sum()) * dtype.itemsize <= left:
        try:
            with torch.inference_mode():
                packed = _cat(column, numels)
        except RuntimeError:  # tensors on several devices: the general scan and chunks handle them
            return None
    return LeafScan(path, dtype, column, None, shapes, packed=packed)


_SERIAL = 16384
"""Items per ``torch.stack``/``torch.cat`` in :func:`_stack` and :func:`_cat`: torch copies a smaller
result in one loop, but a larger one on its thread pool, 1.2x slower for tensors of one size and
5x for tensors that differ in size (copied one by one), measured on 10,000 elements of 2 to 300 bytes."""


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, in pieces of at most :data:`_SERIAL` items (raises as it does)."""
    first = tensors[0]
    per = max(1, _SERIAL // max(1, first.numel()))
    if len(tensors) <= per:
        return torch.stack(list(tensors))
    out = torch.empty((len(tensors), *first.shape), dtype=first.dtype, device=first.device)
    for a in range(0, len(tensors), per):
        torch.stack(list(tensors[a : a + per]), out=out[a : a + per])
    return out


def _cat(tensors: Sequence[torch.Tensor], numels: np.ndarray) -> torch.Tensor:
    """The elements' bytes one after the other, as one flat tensor (``numels``: their numbers of items)."""
    flat = [t.reshape(-1) for t in tensors] if tensors[0].ndim != 1 else list(tensors)
    ends = np.cumsum(numels)
    if not len(ends) or ends[-1] < _SERIAL:
        return torch.cat(flat)
    cuts = np.unique(np.searchsorted(ends, np.arange(_SERIAL, int(ends[-1]) + _SERIAL, _SERIAL), side="right")).tolist()
    bounds = [0, *(c for c in cuts if 0 < c < len(flat)), len(flat)]
    return torch.cat([torch.cat(flat[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)])


def scan_lazy(stack: LazyStackedTensorDict, elements: list[TensorDictBase]) -> tuple[tuple[int, ...], list[LeafScan]]:
    """:func:`scan` for a lazy stack whose members are not all plain (:func:`scan_plain`), one key
    at a time (tensordict collects each key's member tensors in C-level loops), else :func:`scan`,
    which also words the errors (keys in only some members, nested lazy stacks, non-tensor data)."""
    if not elements:
        return scan(elements)
    if any(isinstance(el, LazyStackedTensorDict) for el in elements) or stack._has_exclusive_keys:
        return scan(elements)
    leaves = []
    for key in stack.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        path = as_path(key)
        tensors = stack.get(key, as_list=True)  # type: ignore[call-overload]  # TensorDictBase.get's overloads omit the keywords
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return scan(elements)  # non-tensor leaves: scan names the element
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            return scan(elements)
        shapes = [t.shape for t in tensors]
        ndim = len(shapes[0])
        if any(len(sh) != ndim for sh in shapes):
            return scan(elements)
        codec.dtype_name(dtype)
        leaves.append(LeafScan.of(path, dtype, list(tensors), shapes))
    check_paths([leaf.path for leaf in leaves])
    return tuple(elements[0].batch_size), leaves


def scan_dense(td: TensorDictBase) -> tuple[tuple[int, ...], list[LeafScan]] | None:
    """The leaves of a dense tensordict ``td`` (batch dims ``[count, *inner]``) straight from its
    columns, none unbound into elements: every leaf is homogeneous and its column is
    :attr:`LeafScan.packed`.  None when a leaf is not a tensor (non-tensor data goes element
    by element through :func:`scan`)."""
    if not td.batch_size[0]:
        return None  # no elements: scan says so
    leaves = []
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        if not isinstance(value, torch.Tensor) or isinstance(value, TensorDictBase):
            return None
        codec.dtype_name(value.dtype)
        leaves.append(LeafScan(as_path(key), value.dtype, [], tuple(value.shape[1:]), packed=value))
    check_paths([leaf.path for leaf in leaves])
    return tuple(td.batch_size[1:]), leaves
