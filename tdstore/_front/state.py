"""What a lazy store handle is, and the accessors every part of ``LazyStackedTensorDictStore`` uses.

``LazyStackedTensorDictStore`` (``lazy``) is a ``StoreBase`` (``_front.store_base``: identity, writes,
tensordict's surface) with what only the lazy store does, one mixin each: reads
(``_front.reading``), key changes (``_front.key_changes``), the handle's lifetime (``_front.lifecycle``) and
the ring (``_ring.lazy_methods``).  They all build on :class:`LazyState`, which holds the handle's state:
its engine (server calls and the cached header), the label of the server kind, where reads land,
and the layout of the stack.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from tdstore._engine.engine import Engine
from tdstore._front.identity import StoreIdentity
from tdstore._plan.values import check_device, usable_device


class LazyState(StoreIdentity):
    """The state of a handle on a lazy store, set by :meth:`_init_handle` (construction and unpickling)."""

    _engine: Engine
    _backend: str
    _device: torch.device | None
    _cache_metadata: bool
    _count: int
    _stack_dim: int
    _inner_batch_size: torch.Size
    _batch_size: torch.Size

    def _init_handle(self, engine: Engine, *, backend: str, device: torch.device | None, cache_metadata: bool) -> None:
        h = engine.header
        engine.limits  # noqa: B018  (read once per server and process: warns when the server may evict a store's keys)
        self._engine = engine
        self._backend = backend
        self._device = device
        self._cache_metadata = cache_metadata
        self._count = h.count
        self._stack_dim = h.stack_dim
        self._inner_batch_size = torch.Size(h.inner)
        self._batch_size = h.batch_size
        self._init_tensordict_state()

    @classmethod
    def _from_engine(cls, engine: Engine, *, backend: str = "redis", device: Any = None, cache_metadata: bool = True) -> Self:
        self = cls.__new__(cls)
        h = engine.header
        # a device the caller names must exist here; the store's own (written where it was made) is used when it does
        dev = (
            check_device(torch.device(device))
            if device is not None
            else (torch.device(h.device) if h.device and usable_device(h.device) else None)
        )
        self._init_handle(engine, backend=backend, device=dev, cache_metadata=cache_metadata)
        return self

    def _stack_index(self, index: Any) -> Any:
        """An index of the lazy store is an index of the stack."""
        return index
