"""The torchrl ``Storage`` of :mod:`tdstore.torchrl`: a tdstore ring whose length, cursor and generations are the server's.

Every process that opens a :class:`StoreStorage` with the same ``td_id`` and server
shares one buffer.  The writer and samplers (:mod:`tdstore.torchrl.writer`,
:mod:`tdstore.torchrl.samplers`) reach the ring through :meth:`StoreStorage.with_store`,
which reopens it when another handle emptied the buffer.

The class is built in three steps, one module each: ``storage_base`` (the ring store, opened on first
use, and what torchrl reads of it), ``storage_writes`` (rows into the ring) and this module (reads,
emptying, state dicts, checkpoints and pickling).
"""

from __future__ import annotations

from copy import copy
from pathlib import Path
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass
from torch.utils._pytree import tree_map, tree_unflatten, treespec_loads
from torchrl.data.replay_buffers.storages import Storage

from tdstore.checkpoint import export_checkpoint
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import SamplingPolicy
from tdstore.store import TensorDictStore, known_tensorclass
from tdstore.torchrl.dumps_loads import load_checkpoint
from tdstore.torchrl.row_copy import write_through
from tdstore.torchrl.storage_base import _PUBLIC_CONN, TENSOR_KEY, TREE_KEY, Drawn, _eager, _spec_text
from tdstore.torchrl.storage_writes import StorageWrites


class StoreStorage(StorageWrites):
    """A torchrl ``Storage`` over a tdstore ring of ``max_size`` slots on a Redis-wire server.

    It subclasses torchrl's ``StoreStorage`` so that torchrl treats it alike (its default
    collate function), and ``TensorStorage``, whose contract it keeps (``_storage`` is a
    tensor collection of ``max_size`` rows, the store; ``get``/``set`` index it), so that
    what torchrl offers only to tensor storages works (``ConsumingSampler``, ``Sequence``
    sample units, staleness, dataset export); every method it uses is this class's own.  The ring store is
    opened (created when missing, attached to when it exists) on first use, with the id
    ``td_id`` (a new one unless given): every process that opens a ``StoreStorage`` with
    the same ``td_id`` and server shares one buffer.  Keys come from the first data written.

    The ring is a dense :class:`~tdstore.TensorDictStore` of batch size ``[max_size, *element
    dims]`` (as ``LazyTensorStorage``, the first write fixes every key's shape and dtype; rows
    read as TensorDicts, never a lazy stack): a later write of another shape raises
    ``DenseShapeError`` naming the key, the shapes and ``ragged=True``. With ``ragged=True``
    the ring is a :class:`~tdstore.LazyStackedTensorDictStore` whose elements may vary in
    shape, sampled as a ``LazyStackedTensorDict`` (as torchrl's ``LazyStackStorage``).
    Attaching by ``td_id`` opens either kind, as it was made.  Plain
    tensors are stored under the key ``"_tensor"``; tensorclass data is stored as its
    tensordict and rebuilt with the class on reads (a process that never wrote learns the
    class from ``tensorclass_cls=``, or from a pickled/state-dict-loaded storage).

    Args:
        max_size: the ring's capacity. ``None`` with ``td_id`` reads it from the server.

    Keyword Args:
        td_id: the store's id (attach to an existing buffer); a new id when ``None``.
        ragged: make the ring a lazy store, for rows that differ in shape (default: a dense one).
        tensorclass_cls: the tensorclass the data is read back as (when another process wrote it).
        url, host, port, db, unix_socket_path, prefix, password, password_provider, ...:
            tdstore's connection keywords (see ``LazyStackedTensorDictStore``). Secrets stay
            in this process: pickles and ``state_dict`` never hold a password (a child process
            gets it from ``password_provider`` or ``$TDSTORE_PASSWORD``).
    """

    # -- reads -----------------------------------------------------------------------------
    def stash(self, sample: Drawn) -> None:
        """Keep a batch ``store.sample`` read; ``get`` of these very indices returns it (no second round trip)."""
        self._pending = sample

    def stashed(self, index: Any) -> Drawn | None:
        """The batch :meth:`stash` kept when ``index`` is its very indices tensor (not consumed)."""
        p = self._pending
        return p if p is not None and index is p.indices else None

    @_eager
    def get(self, index: Any) -> Any:
        """The data at ``index``: the rows a ``StoreSampler`` just read, else one read of the store.

        A slice (``storage[:]``, through which torchrl's ``set_at_``, ``set_``, ``update_`` and
        ``rb[key] = value`` write) answers rows whose in-place writes reach the server too
        (:mod:`tdstore.torchrl.row_copy`)."""
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            return self._written_key(index)  # torchrl's sample units read a whole key (the written slots)
        if isinstance(index, tuple) and self.ndim > 1 and len(index) > 1:
            return self._get_cells(index)
        p = self.stashed(index)
        slots = None
        if p is not None:
            self._pending = None
            td = p.td
        else:
            if isinstance(index, slice):  # a slice covers the written slots only, as torchrl's storages do
                at = index

                def read_written(s: LazyStackedTensorDictStore) -> TensorDictBase:
                    nonlocal slots
                    written = self._sharded_written(s) if self.ndim == 1 else None
                    if written is not None:  # a sharded ring not full: its written slots are not range(len)
                        slots = written[at]
                    else:
                        slots = torch.arange(*at.indices(self._written_slots(s)))
                    return self._read(s, slots, written)

                td = self.with_store(read_written)
            else:
                td = self.with_store(lambda s: self._read(s, index, written_only=True))
        if isinstance(td, LazyStackedTensorDict) and self._store.kept_as_dense:
            td = TensorDictStore.dense_rows(td)  # non-tensor rows of a dense buffer: one TensorDict, as LazyTensorStorage gives
        self._data_kind()
        if self._is_tensor:
            if not isinstance(td, LazyStackedTensorDict):
                return td.get(TENSOR_KEY)
            return td.get(TENSOR_KEY, as_nested_tensor=False)  # type: ignore[call-overload]  # tensordict's overloads omit get's keywords
        if slots is not None:
            td = write_through(td, slots, self._write_rows)
        if self._tensorclass_type is not None:
            return self._tensorclass_type.from_tensordict(td)
        if self._treespec is not None:
            return tree_unflatten([td.get(f"{TREE_KEY}{i}") for i in range(self._treespec.num_leaves)], self._treespec)
        if self._tree:
            return td.to_dict()
        return td

    def _get_cells(self, index: tuple) -> Any:
        """``storage[(i, j, ...)]`` of an ndim>1 storage: the dim-0 rows ``i`` read (one call), the rest picked here."""
        first, rest = index[0], index[1:]
        rows = self.get(first)
        if isinstance(first, int) or (isinstance(first, torch.Tensor) and first.ndim == 0):
            sel: tuple = rest
        elif isinstance(first, torch.Tensor) and any(isinstance(r, torch.Tensor) for r in rest):
            sel = (torch.arange(first.numel()).reshape(first.shape), *rest)  # paired with the other index tensors
        else:
            sel = (slice(None), *rest)
        if isinstance(rows, torch.Tensor) or is_tensor_collection(rows):
            return rows[sel]
        return tree_map(lambda x: x[sel], rows)

    def _written_key(self, key: Any) -> torch.Tensor:
        """The values of ``key`` at the written slots (``storage.get("done")``, as a ``LazyTensorStorage`` answers)."""

        def read(s: LazyStackedTensorDictStore) -> TensorDictBase:
            written = self._sharded_written(s)
            if written is not None:  # positions in a whole key would not be slots (torchrl's SliceSampler takes them as slots)
                raise IndexError(
                    f"storage.get({key!r}): the sharded ring td_id={s.td_id!r} is not full, so its {written.numel()} written "
                    "slots are not range(len) and a key's values cannot stand for them; torchrl's SliceSampler and other "
                    "readers of whole keys work once every shard is full (tdstore's samplers and RandomSampler work now)"
                )
            n = self._written_slots(s)
            if n == 0:
                raise RuntimeError("Cannot get elements out of an empty storage (nothing was written yet)")
            return s[0:n]

        return self.with_store(read).get(key)

    @_eager
    def contains(self, item: Any) -> Any:
        n = self._len_along_dim0
        if isinstance(item, int):
            if item < 0:
                item += n
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            if item.dtype == torch.bool:
                return item.sum() <= n
            return (item >= -n) & (item < n) if item.ndim else torch.tensor(-n <= int(item) < n)  # negatives count from the end
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # -- emptying, state, pickling ---------------------------------------------------------
    def _empty(self) -> None:
        """Delete the buffer's store on the server (one atomic call) and make it again, empty, with the
        same ``td_id``.  The new store carries the generations over (its generation base is past every
        generation the old one gave, so an ``(index, generation)`` handle taken before never looks live
        again) and, after ``rb.empty(empty_write_count=False)``, the write count.  The ring has no
        server operation that empties it in place, so this is not safe while other processes write:
        a write racing the delete either lands before it (and is dropped) or recreates the store
        itself.  Other handles reopen the new store on their next call.  The new store keeps the old one's sampling
        policy (priorities, rate limiter, queue), as torchrl's samplers keep theirs across ``empty()``."""
        self._restore(self._delete_and_make_again())

    def _delete_and_make_again(self) -> list[SamplingPolicy]:
        """:meth:`_empty` without the policy: the store made again bare, and the policies the old one had."""
        self._pending = None
        keep, self._keep_write_count = self._keep_write_count, False
        m = self.marks()
        policies = self.with_store(_policies)
        self.with_store(lambda s: s.clear_redis())
        self._ring = None
        self._reopens += 1
        laps = (m.rw - 1) // self._dim0 + 1 if m.rw else 0
        self._carry(m.gb + laps, m.wb + m.rw if keep else 0)
        return policies

    def _restore(self, policies: list[SamplingPolicy]) -> None:
        """Give the store made again by :meth:`_empty` the policies the old one had (each shard its own)."""
        if any(p != SamplingPolicy() for p in policies):
            self.with_store(lambda s: _restore_policies(s, policies))

    def delete(self) -> None:
        """Delete the buffer's keys on the server (one atomic call).  Unlike ``empty()``, whose new store
        keeps the generations going, nothing stays: a later use makes the buffer again from 0."""
        self._pending = None
        self.with_store(lambda s: s.clear_redis())
        self._ring = None
        self._reopens += 1

    def state_dict(self) -> dict[str, Any]:
        """td_id, max_size and the non-secret connection fields (what another handle needs to attach),
        and the rows as a ``LazyTensorStorage``'s state dict holds them (``_storage``: ``max_size`` rows,
        the unwritten ones zeros; ``_len``; read in one call), so that it loads into one.  Rows whose
        shapes vary between elements are left out (``_storage`` is then ``{}``, as an empty storage's)."""
        n = self._len_along_dim0
        rows: Any = {}
        if n:
            got, m = self.get(slice(0, n)), self._dim0
            if isinstance(got, torch.Tensor):
                rows = torch.cat([got, got.new_zeros((m - n, *got.shape[1:]))])
            elif is_tensor_collection(got) and not isinstance(got, LazyStackedTensorDict) and not self._tree:
                td = got._tensordict if is_tensorclass(got) else got
                full = td.new_zeros((m, *td.batch_size[1:]))
                full[:n] = td
                rows = TensorDict(full.to_dict(), batch_size=full.batch_size).state_dict()  # (a plain TensorDict's)
        cells = n if self.ndim == 1 else n * self._lanes(self._inner_now())
        return {"_storage": rows, "initialized": True, "_len": cells, **self.reference()}

    def reference(self) -> dict[str, Any]:
        """What names the buffer (no rows, no round trip): td_id, max_size, the non-secret connection
        fields and the data kind; ``load_state_dict`` of it attaches to the buffer."""
        return {
            "td_id": self._td_id,
            "max_size": self.max_size,
            "conn": {k: v for k, v in self._conn.items() if k in _PUBLIC_CONN},
            "tensorclass": f"{self._tensorclass_type.__module__}.{self._tensorclass_type.__qualname__}"
            if self._tensorclass_type is not None
            else None,
            "is_tensor": self._is_tensor,
            "treespec": _spec_text(self._treespec),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Attach to the buffer ``state_dict`` names (by td_id; one round trip); when that buffer is gone
        (emptied, another server), write the state dict's rows into this one instead.

        Connection fields this handle was given win over the saved ones (its password
        for one stays in this process).  A tensorclass is only taken from the saved name
        when this process has imported that class already (nothing is imported).

        The state dict of a ``LazyTensorStorage`` (which holds its rows) is loaded too: its
        rows replace the buffer's (see :meth:`_load_memory_state`).  Any other raises.
        """
        if "td_id" not in state_dict or "max_size" not in state_dict:
            if "_storage" in state_dict and "_len" in state_dict:
                self._load_memory_state(state_dict)
                return
            raise ValueError(
                f"StoreStorage.load_state_dict got a state dict with keys {sorted(state_dict)[:8]}, neither a StoreStorage's "
                "(td_id, max_size: the buffer's name on its server; it holds no rows) nor a LazyTensorStorage's; "
                "move rows between storage kinds with dumps/loads (checkpoints)"
            )
        if int(state_dict["max_size"]) != self.max_size:
            raise ValueError(
                f"the state dict is of a buffer of max_size {state_dict['max_size']}, this storage has max_size {self.max_size}"
            )
        conn, td_id = self._conn, self._td_id
        self._conn = {**state_dict.get("conn", {}), **self._conn}
        self._td_id = state_dict["td_id"]
        self._pending = None
        try:
            self._ring = self._attach_existing()
        except KeyError:  # that buffer is gone (emptied, another server): its rows, when the state dict has them
            if not state_dict.get("_len") or not len(state_dict.get("_storage", ())):
                raise
            self._conn, self._td_id = conn, td_id
            self._load_memory_state(state_dict)
            return
        self._reopens += 1
        self._is_tensor = state_dict.get("is_tensor")
        self.adopt_treespec(state_dict.get("treespec"))
        path = state_dict.get("tensorclass")
        if isinstance(path, str) and self._tensorclass_type is None:  # as from_store resolves one: nothing is imported
            self._tensorclass_type = known_tensorclass(path)

    def adopt_treespec(self, text: Any) -> None:
        """Read the buffer's rows as the pytree ``text`` (``treespec_dumps``) describes, when this process wrote none."""
        if isinstance(text, str) and self._treespec is None:
            try:
                self._treespec, self._tree = treespec_loads(text), True
            except (ValueError, TypeError, KeyError):  # a tree of a type this process does not know: rows stay a TensorDict
                pass

    def _load_memory_state(self, state_dict: dict[str, Any]) -> None:
        """Replace the buffer's rows with those of a ``LazyTensorStorage.state_dict()`` (same ``max_size``).

        The rows are written by the ring in slot order (one ``extend`` call; the buffer is emptied
        first), so slot ``i`` holds the same row, ``len`` is the same and the cursor is ``len %
        max_size`` (a wrapped in-memory buffer's writer cursor is not in the storage's state dict).
        """
        stored, n = state_dict["_storage"], int(state_dict["_len"])
        if isinstance(stored, torch.Tensor):
            rows: TensorDictBase = TensorDict({TENSOR_KEY: stored}, batch_size=stored.shape[: self.ndim])
        elif isinstance(stored, dict):
            rows = TensorDict()
            rows.load_state_dict(stored, strict=False)  # type: ignore[arg-type]  # (a copy would drop its batch size metadata)
        else:
            raise ValueError(f"StoreStorage.load_state_dict: a LazyTensorStorage state dict whose _storage is {type(stored).__name__}")
        inner = tuple(rows.batch_size[1:])
        if rows.batch_dims < self.ndim or rows.batch_size[0] != self._count_for(inner):
            raise ValueError(
                f"the state dict is of a storage of batch size {list(rows.batch_size)}, this storage has max_size {self.max_size}"
                + (f" and ndim {self.ndim}" if self.ndim > 1 else "")
            )
        n = -(n // -self._lanes(inner))  # written cells -> dim-0 rows
        policies = self._delete_and_make_again()
        if n:
            self._extend_rows(self._to_rows(rows[:n] if TENSOR_KEY not in rows.keys() else rows[TENSOR_KEY][:n]), rows)
        self._restore(policies)  # after the rows: a limiter counts inserts from after the buffer's content

    def dumps(self, path: Any) -> None:
        """Write a checkpoint of the buffer into the directory ``path``: every row, the ring state
        (write count, cursor, generations), priorities and sampling policy (``tdstore.checkpoint``),
        plus the state dict as ``store.json``.  Homogeneous data is in torchrl's memmap layout:
        ``LazyTensorStorage(max_size).loads(path)`` reads it."""
        self._pending = None
        export_checkpoint(self._store, path, extra={"store.json": self.reference()})

    def loads(self, path: Any) -> None:
        """Restore the checkpoint ``dumps`` wrote in ``path`` (which store it lands on: :mod:`tdstore.torchrl.dumps_loads`)."""
        saved = load_checkpoint(self, Path(path))
        if saved is not None:
            self.adopt_treespec(saved.get("treespec"))

    def __getstate__(self) -> dict[str, Any]:
        """What ``Storage.__getstate__`` keeps, minus its ``multiprocessing.Value`` counters.

        torchrl's own StoreStorage forgets to drop them (``pickle.dumps(storage)`` raises
        "Synchronized objects should only be shared between processes through
        inheritance").  ``Storage.__getstate__`` itself would read them through this
        class's properties, i.e. ask the server, for values this class never uses: the
        revision and the last cursor are the server's.  Secrets are never pickled.
        """
        state = copy(self.__dict__)
        state["_rng"] = None
        state.pop("_mutation_revision_value", None)
        state.pop("_last_cursor_index_value", None)
        state["_secrets"] = {}  # a child gets the password from password_provider or $TDSTORE_PASSWORD
        state["_pending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__setstate__(self, state)  # makes fresh (unused) counters where torchrl expects them

    def __repr__(self) -> str:
        where = {k: v for k, v in self._conn.items() if k in _PUBLIC_CONN}
        return f"{type(self).__name__}(td_id={self._td_id!r}, max_size={self.max_size}, {where})"


def _policies(s: Any) -> list[SamplingPolicy]:
    """Each ring's sampling policy as the server holds it (one round trip each)."""
    return list(s.sampling_policies())


def _restore_policies(s: Any, policies: list[SamplingPolicy]) -> None:
    """Each ring of ``s`` gets its policy of ``policies`` (:func:`_policies` of the store it replaces)."""
    s.restore_sampling_policies(policies)
