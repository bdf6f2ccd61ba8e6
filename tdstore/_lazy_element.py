"""``store[i]``: the write-through view of one element of a lazy store (``ElementView``).

The dense ``TensorDictStore`` is an ``ElementView`` of a whole stack.  A view reads through the
store's public members and its :class:`~tdstore._common.StackOps` (``store.stack_ops``), and
writes with the ``WriteSurface`` every handle has (``_store_base``), on the store's engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.base import NO_DEFAULT

from . import _index, _nontensor
from ._common import StackStore
from ._schema import NestedPath
from ._store_base import StoreBase
from ._values import as_path, display


class ElementView(StoreBase):
    """``store[i]``: a write-through view of element ``i`` (or of a nested key of it).

    Each read or write is one atomic call: ``view[key]`` reads one leaf of the
    element, ``view.to_tensordict()`` all of them, ``view[key] = t`` writes one,
    ``view.update(td)`` writes all of ``td``'s leaves at once.  On a locked store
    the view writes existing keys and refuses new ones; the view itself is not
    locked (as in the reference).
    """

    def __init__(self, store: StackStore, element: int | None, under: NestedPath = ()) -> None:
        self._store = store
        self._ops = store.stack_ops
        self._engine = self._ops.engine
        self._cache_metadata = self._ops.cache_metadata
        self._element = element
        self._under = under
        self._batch_size = torch.Size((*self._ops.engine.header.inner, *self._ops.engine.header.subtree_dims(under)))
        self._device = store.device
        self._init_tensordict_state()

    _whole_stack = False  # writes cover one element of the stack

    # device (identity and schema: ``_identity.StoreIdentity``)
    @property
    def device(self) -> torch.device | None:
        return self._store.device

    @device.setter
    def device(self, value: Any) -> None:
        raise RuntimeError("the device of a store element cannot be set; call .to(device) for a local copy")

    def __repr__(self) -> str:
        keys = list(self.keys(include_nested=True, leaves_only=True))
        return f"{type(self._store).__name__}[{self._element}](keys={keys}, batch_size={self._batch_size}, td_id={self._store.td_id!r})"

    # index composition: the view's index, as an index of the stack (its element at the stack dim)
    def _stack_index(self, index: Any = None) -> tuple:
        h = self._engine.header
        inner = _index.normalize(index, torch.Size(h.inner)) if index is not None else tuple(slice(0, n, 1) for n in h.inner)
        return inner[: h.stack_pos] + (self._element,) + inner[h.stack_pos :]

    # reads
    def _read(self, paths: list[NestedPath] | None, index: Any = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """One read of this element: ``paths``, or every leaf below ``under`` when ``paths`` is None."""
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
            return ElementView(self._store, self._element, path)
        if default is not NO_DEFAULT:
            return default
        raise KeyError(f"key {display(rel)!r} is not in element {self._element} of the store")

    def _get_str(self, key: str, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key((key,), default, **kwargs)

    def _get_tuple(self, key: tuple, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key(as_path(key), default, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
            return _nontensor.content(self._read_key(as_path(index), NO_DEFAULT))
        if index is Ellipsis or (isinstance(index, tuple) and not index):
            return self
        return self._index_tensordict(index)

    def _get_at_str(self, key: str, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._get_at_tuple((key,), idx, default, **kwargs)

    def _get_at_tuple(self, key: tuple, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        path = self._under + as_path(key)
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

    def _clone(self, recurse: bool = True) -> TensorDictBase:
        """An in-memory copy of the element (clone(False) gives another view of it)."""
        if recurse:
            return self.to_tensordict()
        return ElementView(self._store, self._element, self._under)

    # writes (``_write_surface.WriteSurface``): the lock that governs them is the store's
    @property
    def _writes_locked(self) -> bool:
        return self._store.is_locked

    def _del(self, key: tuple) -> None:
        raise RuntimeError("a key cannot be deleted from one element of a store; use del store[key] to delete it everywhere")

    def _delete_keys(self, keys: Sequence[Any]) -> Any:
        raise RuntimeError(
            "keys cannot be deleted from one element of a store; delete them from the store (store.exclude(..., inplace=True))"
        )

    def _rename_key(self, old_key: Any, new_key: Any) -> None:
        raise RuntimeError("a key cannot be renamed in one element of a store; use store.rename_key_(old, new)")

    @classmethod
    def from_dict(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("store elements are made by indexing a store: store[i]")

    def __reduce__(self) -> Any:
        return (ElementView, (self._store, self._element, self._under))
