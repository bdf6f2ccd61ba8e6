"""Step 1 of an upload (see ``_upload``): the elements' keys, dtypes and shapes, checked and
collected before anything is written, without copying any data.

Keys present in only some elements, a key with two dtypes or two numbers of dims, and
values that are neither tensors nor non-tensor data raise here, naming the key and the
element.  :func:`scan` is the general walk and words every error; :func:`scan_plain` and
:func:`scan_lazy` are fast paths for the common inputs that hand anything unusual to it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_non_tensor, is_tensorclass
from tensordict.base import _is_leaf_nontensor

from . import _codec
from ._nontensor import NonTensor, element_docs
from ._schema import NestedPath, check_paths
from ._values import as_path, display

__all__ = ["LeafScan", "scan", "scan_lazy", "scan_plain", "stack_elements"]


@dataclass
class LeafScan:
    """One leaf across the stack: its dtype and every element's tensor (references, no copies)."""

    path: NestedPath
    dtype: torch.dtype
    tensors: list[torch.Tensor]
    shapes: list[torch.Size]
    json: bool = False  # a non-tensor key: each tensor is an element's JSON document

    @functools.cached_property
    def homogeneous(self) -> bool:
        """Every element has one shape: the leaf is one blob of fixed-size elements (never a non-tensor leaf)."""
        if self.json:
            return False
        return len(set(self.shapes)) == 1  # torch.Size hashes as a tuple: one pass in C

    def element_bytes(self) -> np.ndarray:
        """Bytes of each element of this leaf (int64)."""
        item = self.dtype.itemsize
        if self.homogeneous:
            return np.full(len(self.shapes), math.prod(self.shapes[0]) * item, dtype=np.int64)
        return np.array([math.prod(shape) for shape in self.shapes], dtype=np.int64) * item


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


def scan(elements: list[TensorDictBase]) -> tuple[tuple[int, ...], list[LeafScan]]:
    """Check every element's keys, dtypes and shapes, and collect each leaf's tensors; nothing is copied."""
    if not elements:
        raise ValueError("cannot upload an empty stack (no elements)")
    inner = elements[0].batch_size
    leaves: dict[NestedPath, LeafScan] = {}
    paths: dict[Any, NestedPath] = {}
    for i, el in enumerate(elements):
        if el.batch_size != inner:
            raise ValueError(f"element {i} has batch size {list(el.batch_size)}, element 0 has {list(inner)}")
        for key, value in el.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
            path = paths.get(key)
            if path is None:
                path = paths[key] = as_path(key)
            scan_ = leaves.get(path)
            if is_non_tensor(value):
                if scan_ is not None and not scan_.json:
                    raise TypeError(f"key {display(path)!r} holds a tensor in element 0 but non-tensor data in element {i}")
                doc = element_docs(path, NonTensor(value), None, 0)[0]
                if scan_ is None:
                    leaves[path] = LeafScan(path, torch.uint8, [doc], [doc.shape], json=True)
                else:
                    scan_.tensors.append(doc)
                    scan_.shapes.append(doc.shape)
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"key {display(path)!r} of element {i} is a {type(value).__name__}; a store holds tensors and NonTensorData"
                )
            if scan_ is not None and scan_.json:
                raise TypeError(f"key {display(path)!r} holds non-tensor data in element 0 but a tensor in element {i}")
            if scan_ is None:
                _codec.dtype_name(value.dtype)
                leaves[path] = LeafScan(path, value.dtype, [value], [value.shape])
                continue
            if value.dtype != scan_.dtype:
                raise TypeError(
                    f"key {display(path)!r} has dtype {scan_.dtype} in element 0 but {value.dtype} in element {i}; "
                    "every element must use one dtype per key"
                )
            shape = value.shape
            if len(shape) != len(scan_.shapes[0]):
                raise ValueError(
                    f"key {display(path)!r} has {len(scan_.shapes[0])} dims in element 0 but shape {list(shape)} in element {i}"
                )
            scan_.tensors.append(value)
            scan_.shapes.append(shape)
    partial = [path for path, s in leaves.items() if len(s.tensors) != len(elements)]
    if partial:
        missing = {}
        for path in partial:
            name = path if len(path) > 1 else path[0]
            missing[display(path)] = [i for i, el in enumerate(elements) if name not in el.keys(include_nested=True, leaves_only=True)][:5]
        raise ValueError(f"keys present in only some elements (missing from elements {missing}); every element must hold the same keys")
    check_paths(list(leaves))
    return tuple(inner), list(leaves.values())


def _plain_paths(td: TensorDict, prefix: NestedPath, out: list[NestedPath]) -> bool:
    """Collect the leaf paths of a tree of plain TensorDicts holding plain tensors; False for anything else."""
    for key, value in td._tensordict.items():
        if type(value) is TensorDict:
            if not _plain_paths(value, (*prefix, key), out):
                return False
        elif isinstance(value, torch.Tensor) and not isinstance(value, TensorDictBase):
            out.append((*prefix, key))
        else:
            return False
    return True


def _all_same_tree(elements: list[TensorDictBase], first: TensorDict, inner: torch.Size) -> bool:
    """Whether every element is a plain TensorDict with exactly ``first``'s keys at every level (nested
    plain TensorDicts where it has them) and its batch size; no Python call per element and level
    (this loop is the per-element cost of an upload's scan)."""
    nested: list[tuple[NestedPath, Any]] = []  # each sub-tree of ``first`` (parents first) and its keys

    def walk(td: TensorDict, prefix: NestedPath) -> None:
        for key, value in td._tensordict.items():
            if type(value) is TensorDict:
                nested.append(((*prefix, key), value._tensordict.keys()))
                walk(value, (*prefix, key))

    walk(first, ())
    top = first._tensordict.keys()
    for el in elements:
        if type(el) is not TensorDict or el._tensordict.keys() != top or el.batch_size != inner:
            return False
        for path, keys in nested:
            node: Any = el
            for part in path:  # present: the parent's keys matched just before
                node = node._tensordict[part]
            if type(node) is not TensorDict or node._tensordict.keys() != keys:
                return False
    return True


def scan_plain(elements: list[TensorDictBase]) -> tuple[tuple[int, ...], list[LeafScan]] | None:
    """:func:`scan` for elements that are all plain TensorDicts of one key tree (the common upload).

    Reads each element's key dicts directly, about 10x faster than tensordict's
    lazy-stack walk (``_has_exclusive_keys`` and ``get(as_list=True)``), which
    dominated uploads.  Returns None for anything else (other classes, non-tensor
    data, keys in some elements only, mixed dtypes or ndims): :func:`scan` handles
    those and words the errors.
    """
    first = elements[0]
    paths: list[NestedPath] = []
    if type(first) is not TensorDict or not _plain_paths(first, (), paths):
        return None
    inner = first.batch_size
    if not _all_same_tree(elements, first, inner):
        return None
    leaves = []
    for path in paths:
        if len(path) == 1:
            key = path[0]
            tensors = [el._tensordict[key] for el in elements]
        else:
            tensors = []
            for el in elements:
                node = el
                for part in path:
                    node = node._tensordict[part]
                tensors.append(node)
        dtype = tensors[0].dtype
        shapes = [t.shape for t in tensors]
        # sets built in C: one dtype and one number of dims across the stack
        if len({t.dtype for t in tensors}) != 1 or len({len(sh) for sh in shapes}) != 1:
            return None
        _codec.dtype_name(dtype)
        leaves.append(LeafScan(path, dtype, tensors, shapes))
    check_paths(paths)
    return tuple(inner), leaves


def scan_lazy(stack: LazyStackedTensorDict, elements: list[TensorDictBase]) -> tuple[tuple[int, ...], list[LeafScan]]:
    """:func:`scan` for a lazy stack of plain tensordicts, one key at a time (5-10x faster).

    tensordict collects each key's member tensors in C-level loops; anything unusual
    (keys in only some members, nested lazy stacks) goes through :func:`scan`, which
    also words the errors.
    """
    if not elements:
        return scan(elements)
    plain = scan_plain(elements)
    if plain is not None:
        return plain
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
        leaves.append(LeafScan(path, dtype, list(tensors), shapes))
    check_paths([leaf.path for leaf in leaves])
    return tuple(elements[0].batch_size), leaves
