"""``StoreStorage.loads``: a checkpoint (``tdstore._checkpoint.export_import``) restored into a torchrl buffer's storage.

Which store the buffer ends up on:

* the checkpoint's own ``td_id`` when no store of that id holding anything is on the server (the
  buffer was emptied, the server lost it, was restarted without persistence, or is another server) or when it is this storage's
  own id (``rb.dumps(p); rb.empty(); rb.loads(p)``): other processes ``attach`` to the same id;
* this storage's ``td_id`` otherwise (the checkpointed buffer still lives there and belongs
  to someone else: it is left alone).

Whatever store the target id holds is replaced.  An empty store this storage opened under
another id (a new buffer's placeholder) is deleted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensordict import is_tensorclass

from tdstore._checkpoint.export_import import _lazy_handle, import_checkpoint, read_meta

if TYPE_CHECKING:
    from tdstore.torchrl.storage import StoreStorage


def _exists(td_id: str, conn: dict[str, Any]) -> bool:
    """Whether a store of ``td_id`` holds anything (an emptied buffer's new, empty store counts as none)."""
    from tdstore.store import TensorDictStore

    try:
        store = TensorDictStore.from_store(td_id=td_id, **conn)
    except KeyError:
        return False
    handle = _lazy_handle(store)
    try:
        return bool(handle._engine.header.leaves) or handle.write_count > 0
    finally:
        handle.close()


def _drop_if_empty(storage: StoreStorage) -> None:
    """Delete the store this storage opened when nothing was ever written to it (a new buffer's placeholder)."""
    ring = storage._ring
    if ring is None:
        return
    try:
        h = ring._engine.fetch_header()
        if not h.leaves and ring.write_count == 0:
            ring.clear_redis()
    except KeyError:
        pass


def load_checkpoint(storage: StoreStorage, path: Path) -> None:
    """Replace the buffer's content with the checkpoint in ``path`` (rows, ring state, priorities, policy)."""
    meta = read_meta(path)  # a malformed checkpoint is refused before anything changes
    if meta.count != storage.max_size:
        raise ValueError(f"the checkpoint in {path} holds a buffer of max_size {meta.count}, this storage has max_size {storage.max_size}")
    conn = storage._open_kwargs()
    own = storage._td_id
    target = meta.td_id if meta.td_id == own or not _exists(meta.td_id, conn) else own
    if target != own:
        _drop_if_empty(storage)
    store = import_checkpoint(path, td_id=target, replace=True, **conn)
    storage._td_id = target
    storage._ring = _lazy_handle(store)
    storage._pending = None
    storage._reopens += 1
    storage._is_tensor = None  # learned again from the keys
    state_file = path / "store.json"
    if state_file.is_file() and storage._tensorclass_type is None:
        try:
            saved = json.loads(state_file.read_text())
        except ValueError:
            saved = {}
        if isinstance(saved, dict):
            storage.adopt_treespec(saved.get("treespec"))
        name = saved.get("tensorclass") if isinstance(saved, dict) else None
        if isinstance(name, str):  # only a class this process imported already: nothing is imported
            module, _, attr = name.rpartition(".")
            cls = getattr(sys.modules.get(module), attr, None)
            if cls is not None and is_tensorclass(cls):
                storage._tensorclass_type = cls
