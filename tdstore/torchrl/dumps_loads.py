"""``StoreStorage.loads``: a checkpoint (``tdstore._checkpoint.export_import``) restored into a torchrl buffer's storage.

Which store the buffer ends up on:

* the checkpoint's own ``td_id`` when no store of that id holding anything is on the server (the
  buffer was emptied, the server lost it, was restarted without persistence, or is another server) or when it is this storage's
  own id (``rb.dumps(p); rb.empty(); rb.loads(p)``): other processes ``attach`` to the same id;
* this storage's ``td_id`` otherwise (the checkpointed buffer still lives there and belongs
  to someone else: it is left alone).

Whatever store the target id holds is replaced.  An empty store this storage opened under
another id (a new buffer's placeholder) is deleted.

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

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensordict import is_tensorclass

from tdstore._checkpoint.disk_format import META_FILE, CheckpointMeta
from tdstore._checkpoint.export_import import _lazy_handle, import_narrowed, read_meta
from tdstore.torchrl.storage_base import METADATA_KEYS

#: Where ``ReplayBuffer.dumps`` puts its writer's state, beside the storage's directory (``storage``).
WRITER_STATE = ("writer", "metadata.json")

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


def _writer_state(path: Path) -> tuple[int | None, int | None]:
    """The cursor and write count a torchrl writer saved beside the storage checkpoint ``path`` (``rb.dumps``:
    ``<dir>/storage`` and ``<dir>/writer/metadata.json``, as torchrl's ``RoundRobinWriter.dumps`` writes it);
    ``(None, None)`` when there is none, or it holds no such numbers."""
    if path.name != "storage":
        return None, None
    try:
        saved = json.loads(path.parent.joinpath(*WRITER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(saved, dict):
        return None, None

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    return count(saved.get("cursor")), count(saved.get("write_count"))


def _ring_writes(meta: CheckpointMeta, cursor: int | None, write_count: int | None) -> tuple[int | None, int]:
    """The ring write count that continues a torchrl writer at ``cursor`` (None: the checkpoint's own) and the
    write base (``wb``) that makes ``rb.write_count`` the writer's ``write_count``.

    A ring's next slot is its write count modulo its slots, and its written slots are the first ``min(rw,
    slots)``: a full ring gets the largest count up to ``write_count`` that leaves its cursor at ``cursor``
    (``write_count`` itself for a writer never emptied with ``empty_write_count=False``, whose slots then have
    torchrl's generations), and at least one lap; a ring not full keeps its length (its cursor)."""
    n, written = meta.count, meta.written
    rw = None
    if written == n and cursor is not None and cursor < n:
        rw = n + cursor
        if write_count is not None and write_count > rw:
            rw += (write_count - rw) // n * n
    base = written if rw is None else rw
    return rw, (write_count - base if write_count is not None and write_count > base else 0)


def load_checkpoint(storage: StoreStorage, path: Path) -> None:
    """Replace the buffer's content with the checkpoint in ``path`` (rows, ring state, priorities, policy)."""
    meta = read_meta(path)  # a malformed checkpoint is refused before anything changes
    slots = storage._count_for(tuple(meta.inner))  # max_size, or with ndim > 1 the slots of max_size cells
    if meta.count != slots:
        held = meta.count * storage._lanes(tuple(meta.inner))
        raise ValueError(
            f"the checkpoint in {path} holds a buffer of max_size {held}, this storage has max_size {storage.max_size}"
            + (f" (ndim {storage.ndim}: {meta.count} slots of {tuple(meta.inner)}, this storage makes {slots})" if storage.ndim > 1 else "")
        )
    rw, write_base = None, 0
    if not (path / META_FILE).is_file():  # torchrl's checkpoint: the cursor is its writer's
        rw, write_base = _ring_writes(meta, *_writer_state(path))
    meta = meta.narrowed(drop=[(k,) for k in METADATA_KEYS], rw=rw)
    conn = storage._open_kwargs()
    own = storage._td_id
    target = meta.td_id if meta.td_id == own or not _exists(meta.td_id, conn) else own
    if target != own:
        _drop_if_empty(storage)
    store = import_narrowed(path, meta, td_id=target, replace=True, **conn)
    storage._td_id = target
    storage._ring = _lazy_handle(store)
    storage._pending = None
    storage._reopens += 1
    storage._is_tensor = None  # learned again from the keys
    storage._inner = tuple(storage._ring.batch_size[1:])  # what the store is made with again after empty()
    if storage.ndim > 1:
        storage.max_size = meta.count * storage._lanes(storage._inner)  # whole lanes, as torchrl's
    if write_base:
        storage._carry(0, write_base)
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
