"""``StoreStorage.loads``: a checkpoint (``tdstore._checkpoint.export_import``) restored into a torchrl buffer's storage.

Which store the buffer ends up on (``rb.loads`` never replaces a store it did not make):

* the checkpoint's own ``td_id`` when it is this storage's own id (``rb.dumps(p); rb.empty();
  rb.loads(p)``), or when no store of that id is on the server at all (the server lost it, was
  restarted without persistence, or is another server): other processes ``attach`` to the same id;
* this storage's ``td_id`` otherwise: a store of the checkpoint's id exists and belongs to someone
  else (the checkpointed buffer, emptied or not, or another user's store): it is left alone. To
  restore under that id, open the buffer with it (``replay_buffer(..., td_id=...)``) and load.

The checkpoint is checked whole (``export_import.prepare``) before anything changes: a refused one
leaves the buffer as it was.  Only this storage's own store is replaced; an empty store it opened
under another id (a new buffer's placeholder) is deleted once the checkpoint is restored.

What is restored is what a ``LazyTensorStorage`` would hold after torchrl's ``loads``, as far as a
ring can hold it:

* the keys torchrl's writers put into each row (``METADATA_KEYS``: ``"index"``, which
  ``TensorDictRoundRobinWriter`` stores) are left out, as every write of this storage leaves them out
  (a ring write must hold every key of the store);
* the cursor of a torchrl buffer's checkpoint is its writer's (``writer/metadata.json`` beside
  ``storage/``, which ``ReplayBuffer.loads`` hands to ``StoreWriter.loads`` after this): a full ring
  gets the write count that puts its cursor there (the newest rows are the ones before it), in the
  call that restores the ring, and ``rb.write_count`` is the writer's;
* an ``ndim`` > 1 storage's checkpoint holds ``max_size`` cells in slots of ``lanes`` cells each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tdstore._checkpoint.disk_format import is_torchrl_dump, torchrl_ring_writes, writer_state
from tdstore._checkpoint.export_import import import_narrowed, read_meta
from tdstore._checkpoint.folder import CheckpointError, load_json
from tdstore._engine.connection import open_client
from tdstore._format.keys import StoreKeys
from tdstore.dense import _connection_kwargs
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.store import known_tensorclass
from tdstore.torchrl.storage_base import METADATA_KEYS, StorageBase


def _taken(td_id: str, conn: dict[str, Any]) -> bool:
    """Whether any store of ``td_id`` is on the server (its header exists: ready, uploading, emptied or damaged)."""
    client, _, owned = open_client(**_connection_kwargs(conn))
    try:
        return bool(client.exists(StoreKeys(conn.get("prefix", "tensordict"), td_id).meta))
    finally:
        if owned:
            client.close()


def _drop_if_empty(storage: StorageBase) -> None:
    """Delete the store this storage opened when nothing was ever written to it (a new buffer's placeholder)."""
    ring = storage._ring
    if ring is None:
        return
    try:
        if not ring.key_specs(fresh=True) and ring.write_count == 0:
            ring.clear_redis()
    except KeyError:
        pass


def load_checkpoint(storage: StorageBase, path: Path) -> dict[str, Any] | None:
    """Replace the buffer's content with the checkpoint in ``path`` (rows, ring state, priorities, policy).
    Returns the storage's own document beside it (``store.json``: its pytree and tensorclass), if any; a
    tensorclass it names is taken here (as ``from_store`` resolves one: registered, or of a module imported
    already; nothing is imported)."""
    meta = read_meta(path)  # a malformed checkpoint is refused before anything changes
    slots = storage._count_for(tuple(meta.inner))  # max_size, or with ndim > 1 the slots of max_size cells
    if meta.count != slots:
        held = meta.count * storage._lanes(tuple(meta.inner))
        raise ValueError(
            f"the checkpoint in {path} holds a buffer of max_size {held}, this storage has max_size {storage.max_size}"
            + (f" (ndim {storage.ndim}: {meta.count} slots of {tuple(meta.inner)}, this storage makes {slots})" if storage.ndim > 1 else "")
        )
    rw, write_base = None, 0
    if is_torchrl_dump(path):  # torchrl's checkpoint: the cursor is its writer's
        rw, write_base = torchrl_ring_writes(meta, *writer_state(path))
    meta = meta.narrowed(drop=[(k,) for k in METADATA_KEYS], rw=rw)
    conn = storage._open_kwargs()
    own = storage._td_id
    target = meta.td_id if meta.td_id == own or not _taken(meta.td_id, conn) else own
    # (another store of the target id made meanwhile is refused, FileExistsError, not replaced)
    store = import_narrowed(path, meta, td_id=target, replace=target == own, **conn)
    if target != own:
        _drop_if_empty(storage)
    storage._td_id = target
    storage._ring = LazyStackedTensorDictStore.stack_of(store)
    storage._pending = None
    storage._reopens += 1
    storage._is_tensor = None  # learned again from the keys
    storage._inner = tuple(storage._ring.batch_size[1:])  # what the store is made with again after empty()
    if storage.ndim > 1:
        storage.max_size = meta.count * storage._lanes(storage._inner)  # whole lanes, as torchrl's
    if write_base:
        storage._carry(0, write_base)
    try:
        saved = load_json(path, "store.json", "store.json")
    except (OSError, CheckpointError):
        saved = None
    if not isinstance(saved, dict) or storage._tensorclass_type is not None:
        return None
    name = saved.get("tensorclass")
    if isinstance(name, str):
        storage._tensorclass_type = known_tensorclass(name)
    return saved
