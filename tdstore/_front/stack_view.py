"""``StackView``: a handle on a lazy store it wraps, which it reads through the store's ``StackAccess``.

The element view of a lazy store (``store[i]``, ``_front.element``) and the dense
``TensorDictStore`` (``dense``, a view of a whole stack) are stack views: each reads through the
store's public members and its :class:`~tdstore._front.common.StackAccess` (``store.stack_ops``), and
writes with the ``WriteSurface`` every handle has (``_front.store_base``), on the store's engine.  A
view says how its indices map onto the stack (``_stack_index``) and what a nested key gives
(``_subtree_view``); the reads of keys, indices and the whole view are the same code here.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.base import NO_DEFAULT

from tdstore._format import nontensor
from tdstore._format.schema import NestedPath
from tdstore._front.common import StackStore, refuse_ellipsis_into_features
from tdstore._front.store_base import StoreBase
from tdstore._plan.values import as_path, display


class StackView(StoreBase):
    """A handle on (part of) the stack of a lazy store: one element, or the whole of it, below ``_under``."""

    def __init__(self, store: StackStore, element: int | None, under: NestedPath, batch_size: torch.Size) -> None:
        self._store = store
        self._ops = store.stack_ops
        self._engine = self._ops.engine
        self._cache_metadata = self._ops.cache_metadata
        self._element = element
        self._under = under
        self._batch_size = batch_size
        self._device = store.device
        self._init_tensordict_state()

    def _subtree_view(self, path: NestedPath) -> TensorDictBase:
        """What reading the nested key ``path`` (from the root of the store) gives: a view of that sub-tree."""
        raise NotImplementedError

    def _missing_key(self, rel: NestedPath) -> KeyError:
        return KeyError(f"key {display(rel)!r} is not in the store ({self._engine.where()})")

    # reads
    def _read(self, paths: list[NestedPath] | None, index: Any = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """One read of the view: ``paths``, or every leaf below ``under`` when ``paths`` is None."""
        return self._ops.read(self._stack_index(index), paths, under=under, strip=strip)

    def _read_key(self, rel: NestedPath, default: Any, **kwargs: Any) -> Any:
        path = self._under + rel
        h = self._header
        if path in h.leaves:
            try:
                return self._read([path]).get(display(path))
            except KeyError:
                if default is not NO_DEFAULT:
                    return default
                raise
        if any(p[: len(path)] == path for p in h.leaves):
            return self._subtree_view(path)
        if default is not NO_DEFAULT:
            return default
        raise self._missing_key(rel)

    def _get_str(self, key: str, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key((key,), default, **kwargs)

    def _get_tuple(self, key: tuple, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key(as_path(key), default, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
            return nontensor.content(self._read_key(as_path(index), NO_DEFAULT))
        if index is Ellipsis or (isinstance(index, tuple) and not index):
            return self
        return self._index_tensordict(index)

    def _get_at_str(self, key: str, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._get_at_tuple((key,), idx, default, **kwargs)

    def _get_at_tuple(self, key: tuple, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        path = self._under + as_path(key)
        refuse_ellipsis_into_features(self._engine.header, path, idx, "get_at")
        try:
            td = self._read(None, idx, under=path, strip=False)
        except KeyError:
            if default is not NO_DEFAULT:
                return default
            raise
        return td.get(display(path))

    def _index_tensordict(self, index: Any, new_batch_size: Any = None, names: Any = None) -> TensorDictBase:
        return self._read(None, index, under=self._under)

    def _to_tensordict(self, *, retain_none: bool | None = None) -> TensorDictBase:
        return self._read(None, under=self._under)

    def to_local(self) -> TensorDictBase:
        warnings.warn("to_local() is deprecated; use to_tensordict()", DeprecationWarning, stacklevel=2)
        return self.to_tensordict()
