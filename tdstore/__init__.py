"""tdstore: TensorDicts shared between processes and machines through a Redis-wire server.

Every operation is one atomic round trip: a Lua script call (EVALSHA), or for reads whose byte
ranges the client can name (homogeneous keys, heterogeneous rows whose offset tables it keeps) one
MULTI/EXEC that checks the schema versions in the same transaction.
Handles keep a cached view of the schema that the server validates on every call.

The store classes are imported on first use (``tdstore.TensorDictStore``), not
with the package: ``python -m tdstore`` and the ``tdstore`` command import this
package first, and ``tdstore --help``, ``ls``, ``info`` and ``rm`` must not wait
for torch and tensordict to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tdstore import _moved
from tdstore._errors import (
    AmbiguousTimeoutError,
    DenseShapeError,
    LeaseLostError,
    QueueOverrunError,
    ShardedRingIdError,
    ShardUnavailableError,
    StoreDamagedError,
)
from tdstore._format.header_info import StoreFormatError

_moved.install()  # old module paths still import: pickles made before the layout step load

if TYPE_CHECKING:
    from tdstore._engine.connection import PasswordError
    from tdstore._plan.padded_batch import check_padding, pad_rows
    from tdstore._shards.ring import ShardedRing
    from tdstore.checkpoint import export_checkpoint, import_checkpoint, import_reference
    from tdstore.lazy import LazyStackedTensorDictStore
    from tdstore.ring_interface import Ring
    from tdstore.store import TensorDictStore, register_tensorclass

__all__ = [
    "LazyStackedTensorDictStore",
    "TensorDictStore",
    "StoreDamagedError",
    "AmbiguousTimeoutError",
    "StoreFormatError",
    "PasswordError",
    "QueueOverrunError",
    "LeaseLostError",
    "DenseShapeError",
    "ShardUnavailableError",
    "ShardedRingIdError",
    "ShardedRing",
    "Ring",
    "register_tensorclass",
    "export_checkpoint",
    "import_checkpoint",
    "import_reference",
    "pad_rows",
    "check_padding",
]
__version__ = "0.1.0"

_LAZY = {
    "LazyStackedTensorDictStore": "lazy",
    "TensorDictStore": "store",
    "ShardedRing": "_shards.ring",
    "Ring": "ring_interface",
    "register_tensorclass": "store",
    "PasswordError": "_engine.connection",
    "export_checkpoint": "checkpoint",
    "import_checkpoint": "checkpoint",
    "import_reference": "checkpoint",
    "pad_rows": "_plan.padded_batch",
    "check_padding": "_plan.padded_batch",
}


def __getattr__(name: str) -> Any:
    """Import a store class when it is first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tdstore' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
