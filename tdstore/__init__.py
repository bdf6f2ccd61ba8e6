"""tdstore: TensorDicts shared between processes and machines through a Redis-wire server.

Every operation is one atomic Lua script call (EVALSHA) on the server; handles
keep a cached, server-validated view of the schema.
"""

from ._schema import StoreFormatError
from .lazy import LazyStackedTensorDictStore
from .store import TensorDictStore, register_tensorclass

__all__ = ["LazyStackedTensorDictStore", "TensorDictStore", "StoreFormatError", "register_tensorclass"]
__version__ = "0.1.0"
