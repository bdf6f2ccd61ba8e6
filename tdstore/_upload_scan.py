"""Step 1 of an upload (see ``_upload``): the elements' keys, dtypes and shapes, checked and
collected before anything is written.

Keys present in only some elements, a key with two dtypes or two numbers of dims, and
values that are neither tensors nor non-tensor data raise here, naming the key and the
element.  :func:`scan` is the general walk and words every error; :func:`scan_plain`,
:func:`scan_lazy` and :func:`scan_dense` are fast paths for the common inputs that hand
anything unusual to it.

The fast paths never call Python code per element: each check is one pass of a C-level
``map``/``set`` over a key's column of tensors (their types, dtypes, batch sizes), and a
key's data is gathered by one ``torch.stack``/``torch.cat`` of the column, which also checks
that every element has one shape.  Gathered columns are kept (:attr:`LeafScan.packed`, at
most ``budget`` bytes in all: an upload of one chunk holds them anyway); the chunks slice
them instead of gathering again.
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

from . import _codec
from ._nontensor import NonTensor, element_docs
from ._schema import NestedPath, check_paths
from ._values import as_path, display

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
                _codec.dtype_name(value.dtype)
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

    Reads each element's key dicts directly, a C-level pass per key and check (see the module
    docstring).  Returns None for anything else (other classes, non-tensor data, keys in some
    elements only, mixed dtypes or ndims, sub-trees whose batch sizes differ): :func:`scan`
    handles those and words the errors.
    """
    first = elements[0]
    if type(first) is not TensorDict or set(map(type, elements)) != {TensorDict} or len(set(map(_BATCH, elements))) != 1:
        return None
    leaves: list[LeafScan] = []
    left = [budget]
    if not _plain_level(list(map(_DICT, elements)), first._tensordict, (), leaves, left):
        return None
    check_paths([leaf.path for leaf in leaves])
    return tuple(first.batch_size), leaves


def _plain_level(dicts: list[dict], top: dict, prefix: NestedPath, out: list[LeafScan], left: list[int]) -> bool:
    """The leaves under one level of the tree: ``dicts`` are the elements' key dicts there, ``top`` the first's.
    Every element holds exactly ``top``'s keys: each of them (else a ``KeyError``), and as many in all."""
    if sum(map(len, dicts)) != len(dicts) * len(top):
        return False
    for key, value in top.items():
        try:
            column = [d[key] for d in dicts]
        except KeyError:
            return False
        kinds = set(map(type, column))
        if len(kinds) != 1:
            return False
        kind = kinds.pop()
        path = (*prefix, key)
        if kind is TensorDict:
            if len(set(map(_BATCH, column))) != 1 or not _plain_level(list(map(_DICT, column)), value._tensordict, path, out, left):
                return False
        elif issubclass(kind, torch.Tensor):
            leaf = _plain_leaf(path, column, left)
            if leaf is None:
                return False
            out.append(leaf)
        else:
            return False
    return True


def _plain_leaf(path: NestedPath, column: list[torch.Tensor], left: list[int]) -> LeafScan | None:
    """One key's tensors checked (one dtype, one number of dims) and gathered if ``left[0]`` bytes
    allow; None when the general scan must look at them."""
    dtypes = set(map(_DTYPE, column))
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    _codec.dtype_name(dtype)
    first = column[0]
    n = len(column)
    if first.nbytes * n <= left[0] and all(column[i].shape == first.shape for i in (n // 3, n // 2, -1)):
        try:
            with torch.inference_mode():
                stacked = _stack(column)  # checks that every element has one shape
        except RuntimeError:  # shapes differ (or devices: then the cat below fails too)
            pass
        else:
            left[0] -= stacked.nbytes
            return LeafScan(path, dtype, column, tuple(first.shape), packed=stacked)
    elif len(set(map(_SHAPE, column))) == 1:
        return LeafScan(path, dtype, column, tuple(first.shape))
    ndim = first.ndim
    if ndim == 0:
        return None
    shapes_list = list(map(_SHAPE, column))
    if set(map(len, shapes_list)) != {ndim}:
        return None
    shapes = np.fromiter(chain.from_iterable(shapes_list), dtype=np.int64, count=n * ndim).reshape(n, ndim)
    numels = np.prod(shapes, axis=1)
    total = int(numels.sum()) * dtype.itemsize
    packed: torch.Tensor | None = None
    if total <= left[0]:
        try:
            with torch.inference_mode():
                packed = _cat(column, numels)
        except RuntimeError:  # tensors on several devices: the general scan and chunks handle them
            return None
        left[0] -= total
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
        _codec.dtype_name(dtype)
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
        _codec.dtype_name(value.dtype)
        leaves.append(LeafScan(as_path(key), value.dtype, [], tuple(value.shape[1:]), packed=value))
    check_paths([leaf.path for leaf in leaves])
    return tuple(td.batch_size[1:]), leaves
