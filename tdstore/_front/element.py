"""``store[i]``: the write-through view of one element of a lazy store (``ElementView``), a ``StackView``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from tdstore._format.schema import RAGGED, NestedPath
from tdstore._front.common import StackStore
from tdstore._front.stack_view import StackView
from tdstore._plan.index import normalize
from tdstore._plan.values import display


class ElementView(StackView):
    """``store[i]``: a write-through view of element ``i`` (or of a nested key of it).

    Each read or write is one atomic call: ``view[key]`` reads one leaf of the
    element, ``view.to_tensordict()`` all of them, ``view[key] = t`` writes one,
    ``view.update(td)`` writes all of ``td``'s leaves at once.  On a locked store
    the view writes existing keys and refuses new ones; the view itself is not
    locked (as in the reference).
    """

    def __init__(self, store: StackStore, element: int | None, under: NestedPath = ()) -> None:
        h = store.stack_ops.engine.header
        super().__init__(store, element, under, torch.Size((*h.inner, *h.subtree_dims(under))))

    _whole_stack = False  # writes cover one element of the stack

    # device (identity and schema: ``_front.identity.StoreIdentity``)
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
        inner = normalize(index, torch.Size(h.inner)) if index is not None else tuple(slice(0, n, 1) for n in h.inner)
        return inner[: h.stack_pos] + (self._element,) + inner[h.stack_pos :]

    # reads (``_front.stack_view.StackView``): a nested key of the element is a view of it
    def _subtree_view(self, path: NestedPath) -> Any:
        h = self._engine.header
        if path in h.classes or RAGGED in h.subtree_dims(path):
            # a sub-tree written as a tensorclass (a chat History) or whose dims vary between elements:
            # the element's copy of it (one read), in its class, as a local lazy stack's element gives it
            return self._read(None, under=path)
        return ElementView(self._store, self._element, path)

    def _missing_key(self, rel: NestedPath) -> KeyError:
        return KeyError(f"key {display(rel)!r} is not in element {self._element} of the store")

    def _clone(self, recurse: bool = True) -> TensorDictBase:
        """An in-memory copy of the element (clone(False) gives another view of it)."""
        if recurse:
            return self.to_tensordict()
        return ElementView(self._store, self._element, self._under)

    # writes (``_front.write_surface.WriteSurface``): the lock that governs them is the store's
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
        # through the store's public class (``LazyStackedTensorDictStore._element_view``): a pickle names no private class
        return (getattr(type(self._store), "_element_view", ElementView), (self._store, self._element, self._under))
