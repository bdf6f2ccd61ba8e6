"""``TensorDictStore``: the dense front class, and the entry point that puts any tensordict on a server.

``TensorDictStore.from_tensordict`` dispatches on what it is given: a lazy stack
becomes a :class:`~tdstore.LazyStackedTensorDictStore`, any other tensordict (or
tensorclass) a dense :class:`~tdstore.TensorDictStore`. ``register_tensorclass`` names a tensorclass a
store may be read back as; ``known_tensorclass`` is the one a stored name resolves to without importing
anything (an adapter restoring a state dict that names one: ``tdstore.torchrl``).
"""

from __future__ import annotations

from tdstore._format.tensorclass import known as known_tensorclass
from tdstore._format.tensorclass import register_tensorclass
from tdstore.dense import TensorDictStore

__all__ = ["TensorDictStore", "register_tensorclass", "known_tensorclass"]
