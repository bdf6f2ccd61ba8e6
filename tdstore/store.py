"""``TensorDictStore``: the dense front class, and the entry point that puts any tensordict on a server.

``TensorDictStore.from_tensordict`` dispatches on what it is given: a lazy stack
becomes a :class:`~tdstore.LazyStackedTensorDictStore`, any other tensordict (or
tensorclass) a dense :class:`~tdstore.TensorDictStore`.
"""

from __future__ import annotations

from tdstore._format.tensorclass import register_tensorclass
from tdstore.dense import TensorDictStore

__all__ = ["TensorDictStore", "register_tensorclass"]
