"""Checkpoints: a store written to a directory on disk and restored from it, and stores of ``tensordict.store``
copied in. The public face of :mod:`tdstore._checkpoint` (the format: ``_checkpoint.disk_format``), for users,
the command line (``tdstore export``/``import``/``import-reference``) and adapters (``tdstore.torchrl``).

``export_checkpoint(store, path)`` writes every row, the ring state (write count, cursor, generations),
priorities and sampling policy; homogeneous keys are in torchrl's memmap layout. ``import_checkpoint(path,
url=...)`` makes a new store of it (refusing a malformed checkpoint before anything is sent), and also
restores the folder ``rb.dumps`` wrote or a torchrl ``LazyTensorStorage`` dump. ``read_checkpoint(path)``
checks a checkpoint without a server: ``(folder, CheckpointMeta)``, what ``import_checkpoint`` would restore.
"""

from __future__ import annotations

from tdstore._checkpoint.disk_format import TORCHRL_ROW_KEYS, CheckpointMeta
from tdstore._checkpoint.disk_format import read_restorable as read_checkpoint
from tdstore._checkpoint.export_import import CheckpointError, export_checkpoint, import_checkpoint
from tdstore._checkpoint.reference import ReferenceStoreError, import_reference, is_reference_store

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "ReferenceStoreError",
    "TORCHRL_ROW_KEYS",
    "export_checkpoint",
    "import_checkpoint",
    "import_reference",
    "is_reference_store",
    "read_checkpoint",
]
