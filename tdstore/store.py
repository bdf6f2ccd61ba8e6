"""``TensorDictStore``: the entry point that puts any tensordict on a server.

``TensorDictStore.from_tensordict`` dispatches on what it is given: a lazy stack
(or a tensordict with a batch dim, stacked along dim 0) becomes a
:class:`~tdstore.LazyStackedTensorDictStore`.
"""

from __future__ import annotations

from typing import Any

from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensorclass

from .lazy import LazyStackedTensorDictStore


class TensorDictStore:
    """Factory for server-backed tensordicts.

    The dense front class (one blob per key for a non-stacked tensordict) is not
    implemented yet; ``from_tensordict`` of a lazy stack returns a
    :class:`LazyStackedTensorDictStore`, as in the reference.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the dense TensorDictStore is not available yet; use LazyStackedTensorDictStore "
            "or TensorDictStore.from_tensordict(lazy_stack)"
        )

    @classmethod
    def from_tensordict(cls, td: Any, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Upload ``td``: a lazy stack becomes a :class:`LazyStackedTensorDictStore`."""
        if is_tensorclass(td):
            td = td._tensordict
        if isinstance(td, LazyStackedTensorDict):
            return LazyStackedTensorDictStore.from_lazy_stack(td, **kwargs)
        if isinstance(td, TensorDictBase):
            raise NotImplementedError(
                "uploading a dense TensorDict needs the dense TensorDictStore, which is not available yet; "
                "upload it as a stack of its rows with LazyStackedTensorDictStore.from_lazy_stack(td)"
            )
        raise TypeError(f"from_tensordict expects a tensordict, got {type(td).__name__}")

    @classmethod
    def from_store(cls, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Reconnect to a stored lazy stack by ``td_id``."""
        return LazyStackedTensorDictStore.from_store(**kwargs)
