"""``StoreBase``: what every handle on a store is, whichever part of the store it writes.

The lazy store (``lazy``), its element views (``_lazy_element``) and the dense ``TensorDictStore``
(``dense``) are each a ``StoreBase`` plus what is theirs (the lazy store's reads, key changes,
lifetime and ring; a view's reads through its store).  A ``StoreBase`` is a ``TensorDictBase``
answered on a server, made of four concepts:

* :class:`~tdstore._write_surface.WriteSurface`: every write, with one rule for keys and locks,
  over :class:`~tdstore._identity.StoreIdentity` (which store, which sub-tree, its schema);
* :class:`~tdstore._common.StoreCommon`: tensordict's class flags, a fixed batch size, no dim names;
* :class:`~tdstore._surface.SurfaceMixin`: the rest of tensordict's methods, on local copies;
* :class:`~tdstore._unsupported.StoreUnsupported`: the hooks a server cannot honour, as clear errors.
"""

from __future__ import annotations

from tensordict import TensorDictBase

from ._common import StoreCommon
from ._surface import SurfaceMixin
from ._unsupported import StoreUnsupported
from ._write_surface import WriteSurface


class StoreBase(WriteSurface, StoreCommon, SurfaceMixin, StoreUnsupported, TensorDictBase):
    """A handle on (part of) a store on the server: its identity, its writes and tensordict's surface."""


__all__ = ["StoreBase"]
