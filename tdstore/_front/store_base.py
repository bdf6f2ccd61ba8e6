"""``StoreBase``: what every handle on a store is, whichever part of the store it writes.

The lazy store (``lazy``), its element views (``_front.element``) and the dense ``TensorDictStore``
(``dense``) are each a ``StoreBase`` plus what is theirs (the lazy store's reads, key changes,
lifetime and ring; a view's reads through its store).  A ``StoreBase`` is a ``TensorDictBase``
answered on a server, made of four concepts:

* :class:`~tdstore._front.write_surface.WriteSurface`: every write, with one rule for keys and locks,
  over :class:`~tdstore._front.identity.StoreIdentity` (which store, which sub-tree, its schema);
* :class:`~tdstore._front.common.StoreCommon`: tensordict's class flags, a fixed batch size, no dim names;
* :class:`~tdstore._front.tensordict_api.SurfaceMixin`: the rest of tensordict's methods, on local copies;
* :class:`~tdstore._front.unsupported.StoreUnsupported`: the hooks a server cannot honour, as clear errors.
"""

from __future__ import annotations

from tensordict import TensorDictBase

from tdstore._front.common import StoreCommon
from tdstore._front.tensordict_api import SurfaceMixin
from tdstore._front.unsupported import StoreUnsupported
from tdstore._front.write_surface import WriteSurface


class StoreBase(WriteSurface, StoreCommon, SurfaceMixin, StoreUnsupported, TensorDictBase):
    """A handle on (part of) a store on the server: its identity, its writes and tensordict's surface."""


__all__ = ["StoreBase"]
