"""Which store a handle is: the one place for the identity and schema properties of every handle.

A lazy store, an element view of it (``store[i]``), the dense ``TensorDictStore`` and its sub-tree
views are all handles on one lazy stack on the server (``_engine.engine``: its keys, server calls and
cached header), below a path (``_under``, ``()`` for the whole tree).  :class:`StoreIdentity`
answers from that alone: ``td_id``, ``prefix``, ``readonly``, the schema (``keys()``, ``len``,
``entry_class``) and the names ``tensordict.store`` gives it (``_td_id``, ``_meta_cache``,
``_full_key_path``, ``_tensorclass_cls``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore._engine.engine import Engine
from tdstore._format.schema import Header, NestedPath
from tdstore._front.common import KeysView, MixinBase
from tdstore._plan.values import as_path, display


class StoreIdentity(MixinBase):
    """The identity and schema of a handle, from its engine and the path it is under."""

    _engine: Engine  # the stack's engine (a view's is its store's)
    _cache_metadata: bool  # whether the handle keeps the schema (``cache_metadata=``)
    _under: NestedPath = ()  # the sub-tree the handle is (a view of a nested key), () for the whole tree

    @property
    def _header(self) -> Header:
        """The store's header: the cached one, or read again from the server when the handle keeps no metadata."""
        if not self._cache_metadata:
            self._engine.set_header(self._engine.fetch_header())
        return self._engine.header

    def _paths(self) -> list[NestedPath]:
        """The store's leaf paths, in the order their keys were created."""
        h = self._header
        return [leaf.path for leaf in sorted(h.leaves.values(), key=lambda leaf: leaf.number)]

    @property
    def td_id(self) -> str:
        """The identifier of the store on the server (read-only)."""
        return self._engine.keys.td_id

    @property
    def _td_id(self) -> str:
        return self._engine.keys.td_id

    @property
    def prefix(self) -> str:
        return self._engine.keys.prefix

    @property
    def readonly(self) -> bool:
        """Whether this handle refuses writes (``readonly=True``)."""
        return self._engine.readonly

    @property
    def _meta_cache(self) -> dict[str, tuple[list[int] | None, torch.dtype]] | None:
        """The cached schema as ``tensordict.store`` keeps it: ``{"dotted.key.path": (full shape, dtype)}``.

        The full shape is a list with the store's batch dims (``None`` for a heterogeneous key);
        every key of the store, whatever sub-tree the handle is; ``None`` as a whole when the
        handle keeps no metadata (``cache_metadata=False``).
        """
        if not self._cache_metadata:
            return None
        h = self._engine.header
        sp, lead = h.stack_pos, [] if h.batchless else [h.count]
        return {
            ".".join(p): ([*leaf.shape[:sp], *lead, *leaf.shape[sp:]] if leaf.shape is not None else None, leaf.dtype)
            for p, leaf in h.leaves.items()
        }

    def _full_key_path(self, key: Any) -> str:
        """The dotted path of ``key`` from the root of the store (``store["nested"]._full_key_path("b") == "nested.b"``)."""
        return ".".join(self._under + as_path(key))

    @property
    def tensorclass_path(self) -> str | None:
        """``module.QualName`` of the tensorclass the store was uploaded from, or ``None`` (a name only: never imported)."""
        return (self._engine.header.tensorclass or None) if not self._under else None

    @property
    def _tensorclass_cls(self) -> str | None:
        """The ``tensordict.store`` name of :attr:`tensorclass_path` (``None`` on a sub-tree view, as there)."""
        return self.tensorclass_path

    def keys(self, include_nested: bool = False, leaves_only: bool = False, is_leaf: Any = None, *, sort: bool = False) -> KeysView:  # type: ignore[override]  # a KeysView snapshot of the server's schema, with sort=
        return KeysView(self._paths, self._under, include_nested, leaves_only, sort)

    def __len__(self) -> int:
        return self._batch_size[0] if len(self._batch_size) else 0

    def _subtree_class(self, het: bool) -> type:
        """The class ``entry_class`` gives a nested key (``het``: some leaf below it differs between elements)."""
        return LazyStackedTensorDict if het else TensorDict

    def entry_class(self, key: Any) -> type:
        """``torch.Tensor`` for a leaf; for a nested key, the class reading it gives (see :meth:`_subtree_class`)."""
        path = self._under + as_path(key)
        h = self._header
        if path in h.leaves:
            return torch.Tensor
        under = [leaf for p, leaf in h.leaves.items() if p[: len(path)] == path]
        if not under:
            raise KeyError(f"key {display(path)!r} is not in the store")
        return self._subtree_class(any(leaf.het for leaf in under))
