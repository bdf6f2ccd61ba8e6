"""tdstore: TensorDicts shared between processes and machines through a Redis-wire server.

Every operation is one atomic round trip: a Lua script call (EVALSHA), or for plain reads of
homogeneous keys one MULTI/EXEC that checks the schema versions in the same transaction.
Handles keep a cached view of the schema that the server validates on every call.
"""

from ._errors import StoreDamagedError
from ._schema import StoreFormatError
from .lazy import LazyStackedTensorDictStore
from .store import TensorDictStore, register_tensorclass

__all__ = ["LazyStackedTensorDictStore", "TensorDictStore", "StoreDamagedError", "StoreFormatError", "register_tensorclass"]
__version__ = "0.1.0"
