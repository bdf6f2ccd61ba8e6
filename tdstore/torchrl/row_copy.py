"""``storage[:]`` of a :class:`~tdstore.torchrl.StoreStorage`: a local copy whose in-place writes also reach the server.

torchrl's buffers write through the storage's slice: ``rb.set_at_``, ``rb.set_`` and
``rb.update_`` are ``storage[:].set_at_(...)`` and so on, and ``rb["key"] = value`` is
``storage[:]["key"] = value``.  A ``LazyTensorStorage`` answers a view of its memory, so
these write the buffer; a server's rows are read into a local copy, and writing that copy
alone would change nothing on the server, silently.  The copy returned here is of a
subclass whose in-place writes (``rows[key] = value`` of an existing key included; a new key
stays local, as on a ``LazyTensorStorage`` that is not full) are sent to the server first (one atomic call each, at the
slots the copy was read from), then applied to the copy.  Only that very object writes
through: tensordicts derived from it (``clone``, indexing...) are ordinary local copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.utils import unravel_key

#: The attribute holding the link to the server (``None`` on copies derived from the rows).
_LINK = "_tdstore_rows_link"


class _Link:
    """Where the rows came from: the slots they were read from, and how to write the store there."""

    def __init__(self, slots: torch.Tensor, write: Callable[[Callable[[Any], None]], None]) -> None:
        self.slots = slots
        self.write = write  # runs fn(store) on the buffer's store (reopening it when emptied), moving the revision in the same call


def _slots_at(link: _Link, index: Any) -> torch.Tensor:
    """The store slots of ``index`` taken along the rows (an index into the copy)."""
    if isinstance(index, np.ndarray):
        index = torch.from_numpy(index)
    if isinstance(index, tuple):
        if len(index) != 1:
            raise IndexError(f"StoreStorage rows are written along their first dim only, got the index {index!r}")
        index = index[0]
    return link.slots[index]


class _WriteThrough:
    """The in-place writes of a tensordict read by ``storage[:]``, sent to the server first (see the module docstring)."""

    def _link(self) -> _Link | None:
        return self.__dict__.get(_LINK)

    def _locally(self, fn: Callable[[], Any]) -> Any:
        """Run the tensordict's own write without the link (it may call another of these methods: one server write each)."""
        link = self.__dict__.pop(_LINK, None)
        try:
            return fn()
        finally:
            if link is not None:
                self.__dict__[_LINK] = link

    def set_at_(self, key: Any, value: Any, index: Any, **kwargs: Any) -> Any:
        link = self._link()
        if link is not None:
            slots = _slots_at(link, index)
            link.write(lambda s: s.set_at_(key, value, slots))
        return self._locally(lambda: super(_WriteThrough, self).set_at_(key, value, index, **kwargs))  # type: ignore[misc]  # a tensordict method

    def set_(self, key: Any, value: Any, **kwargs: Any) -> Any:
        link = self._link()
        if link is not None:
            slots = link.slots
            link.write(lambda s: s.set_at_(key, value, slots))
        return self._locally(lambda: super(_WriteThrough, self).set_(key, value, **kwargs))  # type: ignore[misc]

    def update_(self, input_dict_or_td: Any, clone: bool = False, *, keys_to_update: Any = None, **kwargs: Any) -> Any:
        link = self._link()
        if link is not None:
            slots = link.slots
            link.write(lambda s: s.update_at_(input_dict_or_td, slots, keys_to_update=keys_to_update))
        return self._locally(
            lambda: super(_WriteThrough, self).update_(input_dict_or_td, clone=clone, keys_to_update=keys_to_update, **kwargs)  # type: ignore[misc]
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        link = self._link()
        if link is not None:
            if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
                key = unravel_key(index)
                if key in cast(TensorDictBase, self).keys(include_nested=True):  # an existing key is written in place; a new one stays
                    slots = link.slots  # local (a transform adding keys to rows it reads must not add them to the buffer)
                    link.write(lambda s: s.set_at_(key, value, slots))
            else:
                slots = _slots_at(link, index)
                link.write(lambda s: s.__setitem__(slots, value))
        self._locally(lambda: super(_WriteThrough, self).__setitem__(index, value))  # type: ignore[misc]


class WrittenRows(_WriteThrough, TensorDict):  # type: ignore[misc]  # the overrides take what tensordict's do, by keyword
    """Homogeneous rows read by ``storage[:]`` (see the module docstring)."""


class WrittenLazyRows(_WriteThrough, LazyStackedTensorDict):  # type: ignore[misc]  # (see WrittenRows)
    """Rows of varying shapes read by ``storage[:]`` (see the module docstring)."""


def write_through(td: TensorDictBase, slots: torch.Tensor, write: Callable[[Callable[[Any], None]], None]) -> TensorDictBase:
    """``td`` (rows read at ``slots``) made to write its in-place changes through ``write`` too."""
    if type(td) is TensorDict:
        td.__class__ = WrittenRows
    elif type(td) is LazyStackedTensorDict:
        td.__class__ = WrittenLazyRows
    else:
        return td
    td.__dict__[_LINK] = _Link(slots, write)
    return td
