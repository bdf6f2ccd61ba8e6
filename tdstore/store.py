"""``TensorDictStore``: the dense front class, and the entry point that puts any tensordict on a server.

``TensorDictStore.from_tensordict`` dispatches on what it is given: a lazy stack
becomes a :class:`~tdstore.LazyStackedTensorDictStore`, any other tensordict (or
tensorclass) a dense :class:`~tdstore.TensorDictStore`. ``register_tensorclass`` names a tensorclass a
store may be read back as; ``known_tensorclass`` is the one a stored name resolves to without importing
anything (an adapter restoring a state dict that names one: ``tdstore.torchrl``). For adapters that keep the
arguments a store is opened with: ``SECRET_KWARGS``, the connection keywords that are secrets (never pickled,
logged or put in a state dict), and ``td_id_or_new(td_id)``, the id a constructor's ``td_id=`` names (a fresh
one for None, else the one given, checked: an empty id is refused).
"""

from __future__ import annotations

from tdstore._engine.connection import SECRET_KWARGS
from tdstore._engine.engine import td_id_or_new
from tdstore._format.tensorclass import known as known_tensorclass
from tdstore._format.tensorclass import register_tensorclass
from tdstore.dense import TensorDictStore

__all__ = ["TensorDictStore", "register_tensorclass", "known_tensorclass", "SECRET_KWARGS", "td_id_or_new"]
