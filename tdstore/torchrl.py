"""torchrl replay buffers whose storage, cursor, length and generations live on the server.

torchrl's own ``StoreStorage`` keeps the buffer's length in a ``multiprocessing.Value``
and the writer's cursor in the process, so two machines' buffers on one store overwrite
each other's rows and disagree on ``len``.  Here everything that must agree between
processes is the tdstore ring's (:mod:`tdstore._ring`): one header counter ``rw`` on the
server, from which the cursor, the written length and each slot's generation follow.

* :class:`StoreStorage` (a torchrl ``Storage``) holds a
  :class:`~tdstore.LazyStackedTensorDictStore` of ``max_size`` elements; ``len()`` is the
  number of slots the ring has written, read from the server (the same in every process).
* :class:`StoreWriter` (a torchrl ``Writer``): ``add``/``extend`` are one ``store.extend``
  call each, which reserves the slots at the server's cursor and writes them atomically,
  so any number of writer processes on any number of machines share one cursor.
* :class:`StoreSampler` (a torchrl ``Sampler``): uniform sampling over the written slots
  in one round trip (``store.sample``, whose rows it hands to ``StoreStorage.get``);
  :class:`StoreSamplerWithoutReplacement` (``StoreSampler(replacement=False)``);
  :class:`StorePrioritizedSampler`: torchrl's ``PrioritizedSampler`` API with the sum tree
  on the server, so actors' data gets its priority as it is written and learners share it.
* :func:`replay_buffer` wires the three into a ``TensorDictReplayBuffer`` (or a
  ``ReplayBuffer``) in one line; a second process or machine attaches by ``td_id``.

torchrl is imported only by this module: ``import tdstore`` never imports it.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
from copy import copy
from pathlib import Path
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass, lazy_stack
from torchrl.data.replay_buffers.replay_buffers import ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.samplers.base import _REPLACEMENT_DISPATCH
from torchrl.data.replay_buffers.storages import Storage
from torchrl.data.replay_buffers.storages.store import StoreStorage as _TorchrlStoreStorage
from torchrl.data.replay_buffers.writers import Writer

from . import _ring
from ._connection import SECRET_KWARGS
from ._engine import new_td_id
from ._reads import DenseResult
from ._values import build_td
from .lazy import LazyStackedTensorDictStore

__all__ = [
    "StoreStorage",
    "StoreWriter",
    "StoreSampler",
    "StoreSamplerWithoutReplacement",
    "StorePrioritizedSampler",
    "replay_buffer",
    "attach",
]

#: The key plain-tensor data is stored under (torchrl's own StoreStorage uses the same name).
TENSOR_KEY = "_tensor"
#: Keys a TensorDictReplayBuffer puts into the data it is given or returns; buffer metadata, never stored.
METADATA_KEYS = ("index", "index_generation")
#: Connection keywords kept in ``state_dict`` (never a secret: see ``SECRET_KWARGS``).
_PUBLIC_CONN = ("url", "host", "port", "db", "unix_socket_path", "prefix", "backend", "username", "ssl")
_EMPTY_ERROR = "Cannot sample from an empty storage: nothing has been written to the replay buffer yet."


def _public_url(url: str) -> str:
    """``url`` without a password (user info or ``?password=``), for pickles and state dicts."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{parts.username}@{host}" if parts.username else host
    query = urllib.parse.urlencode([(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "password"])
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _is_reattach_error(err: KeyError) -> bool:
    """The store was emptied (deleted and created again) by another handle since this one opened it."""
    text = str(err)
    return "created again" in text or "it was deleted, expired, or never created" in text


def _has_keys(s: LazyStackedTensorDictStore) -> bool:
    """Whether the store has keys; a handle that saw none asks the server again (another process may have written the first ones)."""
    if not s._engine.header.leaves:
        s._engine.set_header(s._engine.fetch_header())
    return bool(s._engine.header.leaves)


class StoreStorage(_TorchrlStoreStorage):
    """A torchrl ``Storage`` over a tdstore ring of ``max_size`` slots on a Redis-wire server.

    It subclasses torchrl's ``StoreStorage`` only so that torchrl treats it alike (its
    default collate function); every method is this class's own.  The ring store is
    opened (created when missing, attached to when it exists) on first use, with the id
    ``td_id`` (a new one unless given): every process that opens a ``StoreStorage`` with
    the same ``td_id`` and server shares one buffer.  Keys come from the first data written.

    Homogeneous data samples as a ``TensorDict``; data whose elements vary in shape
    samples as a ``LazyStackedTensorDict`` (as torchrl's ``LazyStackStorage``).  Plain
    tensors are stored under the key ``"_tensor"``; tensorclass data is stored as its
    tensordict and rebuilt with the class on reads (a process that never wrote learns the
    class from ``tensorclass_cls=``, or from a pickled/state-dict-loaded storage).

    Args:
        max_size: the ring's capacity. ``None`` with ``td_id`` reads it from the server.

    Keyword Args:
        td_id: the store's id (attach to an existing buffer); a new id when ``None``.
        tensorclass_cls: the tensorclass the data is read back as (when another process wrote it).
        url, host, port, db, unix_socket_path, prefix, password, password_provider, ...:
            tdstore's connection keywords (see ``LazyStackedTensorDictStore``). Secrets stay
            in this process: pickles and ``state_dict`` never hold a password (a child process
            gets it from ``password_provider`` or ``$TDSTORE_PASSWORD``).
    """

    def __init__(
        self, max_size: int | None = None, *, td_id: str | None = None, tensorclass_cls: type | None = None, **store_kwargs: Any
    ) -> None:
        self._secrets = {k: store_kwargs.pop(k) for k in list(store_kwargs) if k in SECRET_KWARGS}
        if "url" in store_kwargs and store_kwargs["url"] is not None:
            self._secrets["url"] = store_kwargs["url"]
            store_kwargs["url"] = _public_url(store_kwargs["url"])
        self._conn = store_kwargs
        self._td_id = td_id or new_td_id()
        self._ring: LazyStackedTensorDictStore | None = None
        self._pending: _ring.Sample | None = None
        self._reopens = 0
        if max_size is None:
            if td_id is None:
                raise ValueError("StoreStorage needs max_size (or the td_id of an existing buffer, whose size is read from the server)")
            self._ring = self._attach_existing()
            max_size = self._ring._count
        Storage.__init__(self, max_size=max_size)
        self._tensorclass_type = tensorclass_cls
        self._is_tensor: bool | None = None  # None: not known in this process yet (read from the store's keys)
        self.initialized = True

    # -- the ring store --------------------------------------------------------------------
    def _open_kwargs(self) -> dict[str, Any]:
        return {**self._conn, **self._secrets}

    def _attach_existing(self) -> LazyStackedTensorDictStore:
        return LazyStackedTensorDictStore.from_store(td_id=self._td_id, **self._open_kwargs())

    @property
    def _store(self) -> LazyStackedTensorDictStore:
        """The ring store, created (or attached to, by td_id) on first use: one round trip."""
        if self._ring is None:
            self._ring = LazyStackedTensorDictStore(count=self.max_size, inner_batch_size=(), td_id=self._td_id, **self._open_kwargs())
        return self._ring

    @property
    def _storage(self) -> LazyStackedTensorDictStore:
        """The store (torchrl's samplers, SliceSampler for one, look for the data under ``_storage``)."""
        return self._store

    @property
    def td_id(self) -> str:
        """The id other processes attach to this buffer with (``replay_buffer(td_id=...)``).

        Asking for it creates the store on the server when it is not there yet, so that
        ``attach(td_id)`` finds it (and reads its size) before anything is written.
        """
        self._store  # noqa: B018
        return self._td_id

    def _call(self, fn: Callable[[LazyStackedTensorDictStore], Any]) -> Any:
        """Run ``fn`` on the store; when another handle emptied the buffer (deleted and
        recreated the store), reopen it once and run ``fn`` on the new one."""
        try:
            return fn(self._store)
        except KeyError as err:
            if not _is_reattach_error(err):
                raise
        self._ring = None
        self._reopens += 1
        return fn(self._store)

    # -- what torchrl reads ----------------------------------------------------------------
    def __len__(self) -> int:
        """The number of written slots, read from the server (one round trip)."""
        return self._call(lambda s: s.ring_state().written)

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        """Ignored: the length is the server's (torchrl's writers assign it after a write)."""

    @property
    def _last_cursor_index(self) -> int | None:
        """The slot written last, from the server (SliceSampler cuts trajectories there)."""
        rw = self._call(lambda s: s.write_count)
        return None if rw == 0 else (rw - 1) % self.max_size

    def _set_last_cursor(self, cursor: Any) -> None:
        """Ignored: the cursor is the server's."""

    @property
    def _mutation_revision(self) -> int:
        """Changes whenever any process writes (the server's ring write count) or the buffer is emptied."""
        return (self._reopens << 40) + self._call(lambda s: s.write_count)

    def _bump_mutation_revision(self) -> None:
        """Nothing to bump: the revision is derived from the server's write count."""

    def _data_kind(self) -> None:
        """Learn from the store's keys whether it holds plain tensors (a process that never wrote)."""
        if self._is_tensor is None and _has_keys(self._store):
            self._is_tensor = list(self._store._engine.header.leaves) == [(TENSOR_KEY,)]

    # -- writes ----------------------------------------------------------------------------
    def _to_rows(self, data: Any) -> TensorDictBase:
        """``data`` (a batch) as the tensordict the ring stores; remembers the data kind."""
        if isinstance(data, list):
            data = lazy_stack(list(data)) if data and is_tensor_collection(data[0]) else torch.stack(list(data))
        if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            self._is_tensor = True
            return TensorDict({TENSOR_KEY: data}, batch_size=data.shape[:1])
        if not is_tensor_collection(data):
            raise TypeError(f"StoreStorage stores TensorDicts, tensorclasses and tensors, not {type(data).__name__}")
        self._is_tensor = False
        if is_tensorclass(data):
            self._tensorclass_type = type(data)
            data = data._tensordict
        present = [k for k in METADATA_KEYS if k in data.keys()]
        return data.exclude(*present) if present else data

    def extend_ring(self, data: Any) -> torch.Tensor:
        """Write a batch at the server's cursor; returns its slots (``StoreWriter.extend``).

        One atomic ``store.extend`` call per ``max_size`` rows: a batch longer than the
        ring is written in ``max_size`` chunks, the later ones overwriting the earlier
        ones, as torchrl's own writer does with ``index % max_size``.
        """
        rows = self._to_rows(data)
        n = rows.batch_size[0] if rows.batch_dims else 0
        if n == 0:
            raise RuntimeError(f"Expected at least one element in extend. Got {data=}")
        if n <= self.max_size:
            return self._call(lambda s: s.extend(rows).indices)
        out = [self._call(lambda s, i=i: s.extend(rows[i : i + self.max_size]).indices) for i in range(0, n, self.max_size)]
        return torch.cat(out)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write ``data`` at explicit slots (``rb[index] = data``): one atomic call.

        A writer that picks its own slots (torchrl's ``RoundRobinWriter``) would keep its
        cursor in its process and never advance the server's: it is refused.  Slots written
        this way keep their generation (only ring writes count), and ``len`` is unchanged.
        """
        if set_cursor:
            raise RuntimeError(
                "StoreStorage is written through StoreWriter, whose add/extend reserve slots on the server "
                "(a writer that keeps its cursor in its process, like RoundRobinWriter, would make processes "
                "overwrite each other's rows); build the buffer with tdstore.torchrl.replay_buffer(...) or "
                "writer=StoreWriter()"
            )
        if isinstance(cursor, int) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0):
            rows = self._to_rows(data.unsqueeze(0) if hasattr(data, "unsqueeze") else [data])
            cursor = torch.as_tensor([int(cursor)])
        else:
            rows = self._to_rows(data)

        def write(s: LazyStackedTensorDictStore) -> None:
            s[cursor] = rows

        self._call(write)

    # -- reads -----------------------------------------------------------------------------
    def _stash(self, sample: _ring.Sample) -> None:
        """Keep a batch ``store.sample`` read; ``get`` of these very indices returns it (no second round trip)."""
        self._pending = sample

    def _stashed(self, index: Any) -> _ring.Sample | None:
        p = self._pending
        return p if p is not None and index is p.indices else None

    def get(self, index: Any) -> Any:
        """The data at ``index``: the rows a ``StoreSampler`` just read, else one read of the store."""
        p = self._stashed(index)
        if p is not None:
            self._pending = None
            td = p.td
        else:
            td = self._call(lambda s: self._read(s, index))
        self._data_kind()
        if self._is_tensor:
            return td.get(TENSOR_KEY) if not isinstance(td, LazyStackedTensorDict) else td.get(TENSOR_KEY, as_nested_tensor=False)
        if self._tensorclass_type is not None:
            return self._tensorclass_type.from_tensordict(td)
        return td

    def _read(self, s: LazyStackedTensorDictStore, index: Any) -> TensorDictBase:
        if not _has_keys(s):
            raise RuntimeError("Cannot get elements out of an empty storage (nothing was written yet)")
        if isinstance(index, slice):  # a slice covers the written slots only, as torchrl's storages do
            index = slice(*index.indices(len(self)))
            if index.step == 1:
                return s._read_index(index)
            index = torch.arange(index.start, index.stop, index.step)
        if isinstance(index, int) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            return s._read_index(torch.as_tensor([int(index)]))[0]
        return s._read_index(index)

    def contains(self, item: Any) -> Any:
        n = len(self)
        if isinstance(item, int):
            if item < 0:
                item += n
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            if item.dtype == torch.bool:
                return item.sum() <= n
            return (item >= 0) & (item < n) if item.ndim else torch.tensor(0 <= int(item) < n)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # -- emptying, state, pickling ---------------------------------------------------------
    def _empty(self) -> None:
        """Delete the buffer's store on the server (one atomic call); the next use recreates it
        with the same ``td_id``, empty.  The ring has no server operation that empties it in
        place, so this is not safe while other processes write: a write racing the delete
        either lands before it (and is dropped) or recreates the store itself.  Other
        handles reopen the new store on their next call."""
        self._pending = None
        self._call(lambda s: s.clear_redis())
        self._ring = None
        self._reopens += 1

    def state_dict(self) -> dict[str, Any]:
        """td_id, max_size and the non-secret connection fields: what another handle needs to attach."""
        return {
            "td_id": self._td_id,
            "max_size": self.max_size,
            "conn": {k: v for k, v in self._conn.items() if k in _PUBLIC_CONN},
            "tensorclass": f"{self._tensorclass_type.__module__}.{self._tensorclass_type.__qualname__}"
            if self._tensorclass_type is not None
            else None,
            "is_tensor": self._is_tensor,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Attach to the buffer ``state_dict`` names (by td_id; one round trip).

        Connection fields this handle was given win over the saved ones (its password
        for one stays in this process).  A tensorclass is only taken from the saved name
        when this process has imported that class already (nothing is imported).
        """
        if int(state_dict["max_size"]) != self.max_size:
            raise ValueError(
                f"the state dict is of a buffer of max_size {state_dict['max_size']}, this storage has max_size {self.max_size}"
            )
        self._conn = {**state_dict.get("conn", {}), **self._conn}
        self._td_id = state_dict["td_id"]
        self._pending = None
        self._ring = self._attach_existing()
        self._reopens += 1
        self._is_tensor = state_dict.get("is_tensor")
        path = state_dict.get("tensorclass")
        if path is not None and self._tensorclass_type is None:
            import sys

            module, _, name = path.rpartition(".")
            cls = getattr(sys.modules.get(module), name, None)
            if cls is not None and is_tensorclass(cls):
                self._tensorclass_type = cls

    def dumps(self, path: Any) -> None:
        """Write the state dict as JSON in ``path`` (the data stays on the server)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "store.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path: Any) -> None:
        """Attach to the buffer a ``dumps`` saved in ``path``."""
        self.load_state_dict(json.loads((Path(path) / "store.json").read_text()))

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


class StoreWriter(Writer):
    """A torchrl ``Writer`` whose slots are reserved on the server, in the call that writes them.

    ``add`` and ``extend`` are one ``store.extend`` each (see :class:`StoreStorage`), so
    writers in any number of processes and machines share one cursor and never write the
    same slot in one lap.  The cursor and write count are read from the server.
    Generations come from the server's write counter too, in torchrl's convention (the
    first write of a slot is generation 0, a never-written slot -1), whatever
    ``track_generations`` says; that flag only makes samples carry ``"index_generation"``.
    """

    def __init__(self, *, track_generations: bool = False) -> None:
        super().__init__()
        self._track_generations = track_generations

    @property
    def tracks_generations(self) -> bool:  # type: ignore[override]
        return self._track_generations

    def _ring_storage(self) -> StoreStorage:
        if not isinstance(self._storage, StoreStorage):
            raise TypeError(f"StoreWriter writes a tdstore.torchrl.StoreStorage, got {type(self._storage).__name__}")
        return self._storage

    def add(self, data: Any) -> int:
        storage = self._ring_storage()
        one = data.unsqueeze(0) if hasattr(data, "unsqueeze") else [data]
        index = int(storage.extend_ring(one)[0])
        self._mark_update_entities(index)
        return index

    def extend(self, data: Any) -> torch.Tensor:
        index = self._ring_storage().extend_ring(data)
        self._mark_update_entities(index)
        return index

    def _mark_update_entities(self, index: Any) -> None:
        for ent in self._storage._attached_entities_iter():
            ent.mark_update(index)

    def generations_of(self, index: Any) -> torch.Tensor:
        """Each slot's generation: from the batch a ``StoreSampler`` just drew, else one round trip."""
        storage = self._ring_storage()
        p = storage._stashed(index)
        if p is not None:
            return p.generations - 1
        if isinstance(index, tuple):
            index = index[0]
        idx = torch.as_tensor(index, dtype=torch.long)
        rw = storage._call(lambda s: s.write_count)
        slots = idx.clamp(0, storage.max_size - 1)
        gen = _ring.generations(slots, rw, storage.max_size) - 1
        return torch.where((idx >= 0) & (idx < storage.max_size), gen, torch.full_like(gen, -1))

    @property
    def _cursor(self) -> int:
        return self._ring_storage()._call(lambda s: s.cursor)

    @property
    def _write_count(self) -> int:
        return self._ring_storage()._call(lambda s: s.write_count)

    def _empty(self, empty_write_count: bool = True) -> None:
        """Nothing here: ``StoreStorage._empty`` empties the store, and with it the cursor and the write count."""

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        """Nothing to load: the cursor and write count are the server's."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the cursor and write count are the server's."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(track_generations={self._track_generations})"


class StoreSampler(Sampler):
    """Uniform sampling (with replacement) over the slots the ring has written, in one round trip.

    The sampler reads the rows itself and hands them to ``StoreStorage.get`` for the
    indices it returns (so ``rb.sample()`` is one round trip, generations included).
    The random numbers come from the buffer's generator (``rb.set_rng``) when one is set.

    How: the slots are drawn on the client, below the written length the previous
    sample saw, and read in one transaction of plain ``GETRANGE``s together with the
    ring's write counter (which gives the generations and the bound for the next
    call).  Written slots stay written (the ring only grows until ``empty``), so every
    drawn slot holds a written row; the counter read with the rows proves it, and a
    batch that drew a slot beyond it (the buffer was emptied meanwhile) is drawn
    again by the server.  Rows written since the previous sample are drawn from the
    next one on.  The first sample of a sampler reads the length first (two round
    trips).  Heterogeneous data, and servers that refuse transactions, use
    ``store.sample`` (the server draws; one script call, slower on the server).
    ``StoreSampler(replacement=False)`` is :class:`StoreSamplerWithoutReplacement`.
    """

    requires_shared_state = False

    def __init__(self) -> None:
        self._bound = 0  # the written length the last sample saw
        self._bound_of: tuple[str, int] | None = None  # of which store (td_id, reopen count)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if not isinstance(storage, StoreStorage):
            raise TypeError(
                f"StoreSampler samples a tdstore.torchrl.StoreStorage, got {type(storage).__name__}; use RandomSampler for other storages"
            )
        got = storage._call(lambda s: self._draw(storage, s, int(batch_size)))
        storage._stash(got)
        return got.indices, {}

    def _draw(self, storage: StoreStorage, s: LazyStackedTensorDictStore, batch_size: int) -> _ring.Sample:
        if not _has_keys(s):
            raise RuntimeError(_EMPTY_ERROR)
        engine, h = s._engine, s._engine.header
        m = h.count
        if self._bound_of != (storage._td_id, storage._reopens):
            self._bound_of, self._bound = (storage._td_id, storage._reopens), 0
        if engine.tx_reads and h.stack_pos == 0 and h.sampling is None and not any(leaf.het for leaf in h.leaves.values()):
            if self._bound == 0:
                self._bound = s.ring_state().written
            if self._bound > 0:
                slots = torch.randint(0, self._bound, (batch_size,), generator=self._rng)
                _, res = engine.read(slots, fields=("rw", "sc"))
                fields = res.fields if isinstance(res, DenseResult) and res.fields is not None else {}
                rw = fields.get("rw")
                if rw is not None and fields.get("sc") is None:  # (under a sampling policy set since, the server draws)
                    self._bound = min(int(rw), m)
                    if int(slots.max()) < self._bound:
                        return _ring.Sample(build_td(res.leaves, res.batch_size, s._device), slots, _ring.generations(slots, int(rw), m))
        try:
            return s.sample(batch_size, generator=self._rng, prioritized=False)
        except ValueError as err:
            if "nothing" in str(err).lower() or "written" in str(err).lower():
                raise RuntimeError(_EMPTY_ERROR) from err
            raise

    def _empty(self) -> None:
        pass

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return


class StoreSamplerWithoutReplacement(SamplerWithoutReplacement):
    """torchrl's ``SamplerWithoutReplacement`` for a buffer that others keep extending.

    torchrl's reshuffles everything whenever the storage length changes, which, with
    actors extending all the time, makes every batch a fresh draw.  This one keeps the
    slots not drawn yet and adds the newly written ones, so within one pass every written
    slot is drawn once.  Two round trips per batch (the server's length, then the rows).
    The permutation is this process's: two learners each draw every slot once.
    """

    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        n = len(storage)
        if n == 0:
            raise RuntimeError(_EMPTY_ERROR)
        if self._sample_list is not None and 0 < self.len_storage < n:
            grown = torch.arange(self.len_storage, n)
            rest = torch.cat([self._sample_list, grown])
            self._sample_list = rest[torch.randperm(rest.numel(), generator=self._rng)] if self.shuffle else rest
            self.len_storage = n
        return super().sample(_KnownLength(storage, n), batch_size)


class _KnownLength:
    """The storage as ``SamplerWithoutReplacement`` sees it, with the length already read (no second round trip)."""

    ndim = 1

    def __init__(self, storage: Storage, n: int) -> None:
        self._inner = storage
        self._n = n
        self.device = None

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> torch.Size:
        return self._inner.shape


class StorePrioritizedSampler(PrioritizedSampler):
    """torchrl's ``PrioritizedSampler`` API with the sum tree on the server, shared by every process.

    torchrl's ``PrioritizedSampler`` keeps its tree in the learner's process: actors cannot
    give new data a priority, and two learners cannot share one. Here the tree is the
    store's (``store.enable_priorities``): a slot written by any actor gets the largest
    priority so far in the same atomic call, ``update_priority`` sets
    ``(|priority| + eps) ** alpha`` on the server (only where the slot still holds the
    generation the last sample read), and ``sample`` draws on the server in one round
    trip, returning torchrl's ``{"priority_weight": ...}`` (``(P(i) / min P) ** -beta``).
    ``max_times_sampled`` retires a slot after that many draws (Reverb's).

    It subclasses torchrl's ``PrioritizedSampler`` so that torchrl's buffers treat it as one
    (``update_tensordict_priority`` checks the type), without its in-process trees: every
    method torchrl calls is this class's own.
    """

    requires_shared_state = False

    def __init__(
        self, alpha: float, beta: float, eps: float = 1e-8, *, max_times_sampled: int | None = None, timeout: float | None = None
    ) -> None:  # noqa: D107 (no trees here)
        if alpha < 0 or beta < 0 or eps < 0:
            raise ValueError(f"alpha, beta and eps must be >= 0, got alpha={alpha}, beta={beta}, eps={eps}")
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self._max_times = max_times_sampled
        self.reduction = "max"  # how torchrl's buffers reduce a multi-dim priority to one per row
        self.timeout = timeout
        """How long a sample waits for the store's rate limiter (``None``: as long as it takes), then ``TimeoutError``."""
        self._last: tuple[StoreStorage, _ring.Sample] | None = None

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)  # annealing beta is the learner's: only sampling uses it

    def prepare(self, storage: StoreStorage) -> None:
        """Turn the store's priorities on (idempotent; a store keeps the alpha it got first)."""
        storage._call(lambda s: s.enable_priorities(self._alpha, max_times_sampled=self._max_times))

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if not isinstance(storage, StoreStorage):
            raise TypeError(f"StorePrioritizedSampler samples a tdstore.torchrl.StoreStorage, got {type(storage).__name__}")

        def draw(s: LazyStackedTensorDictStore) -> Any:
            if not _has_keys(s):
                raise RuntimeError(_EMPTY_ERROR)
            s.enable_priorities(self._alpha, max_times_sampled=self._max_times)
            try:
                return s.sample(int(batch_size), generator=self._rng, prioritized=True, beta=self._beta, timeout=self.timeout)
            except ValueError as err:
                if "no written slot" in str(err) or "nothing" in str(err).lower():
                    raise RuntimeError(_EMPTY_ERROR) from err
                raise

        got = storage._call(draw)
        storage._stash(got)
        self._last = (storage, got)
        return got.indices, {"priority_weight": got.weights}

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        """Set ``(|priority| + eps) ** alpha`` for ``index``: where it is the last batch drawn, only
        for slots that still hold the rows it read (an actor may have overwritten some since)."""
        if isinstance(index, tuple):
            index = index[0]
        idx = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        p = torch.as_tensor(priority, dtype=torch.float64).detach().reshape(-1)
        if p.numel() and bool(p.isnan().all()):
            return  # torchrl seeding a new buffer's existing rows with default_priority: the server's stand
        p = p.abs() + self._eps
        if p.numel() == 1 and idx.numel() > 1:
            p = p.expand(idx.numel())
        last = self._last
        target = storage if isinstance(storage, StoreStorage) else (last[0] if last is not None else None)
        if target is None:
            raise RuntimeError("update_priority needs the storage: sample first, or pass storage=")
        gens = None
        if last is not None and last[0] is target and last[1].indices.shape == idx.shape and torch.equal(last[1].indices, idx):
            gens = last[1].generations
        target._call(lambda s: s.update_priority(idx, p, generation=gens))

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        """Nothing to do: the server gives a written slot its priority in the call that writes it."""

    def add(self, index: Any) -> None:
        """Nothing to do (torchrl's sampler tracks its max priority here; the server does)."""

    def extend(self, index: Any) -> None:
        """Nothing to do (see :meth:`add`)."""

    @property
    def default_priority(self) -> float:
        """NaN: "the server's default". A torchrl buffer built over rows already written seeds them
        with this value through ``update_priority``, which leaves the server's priorities as they are
        (a slot written without a priority gets the largest so far, on the server)."""
        return float("nan")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_last"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._last = None

    def _empty(self) -> None:
        self._last = None

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        """Nothing to load: the priorities are the server's."""

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps, "max_times_sampled": self._max_times}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._beta = float(state_dict.get("beta", self._beta))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, max_times_sampled={self._max_times})"


_REPLACEMENT_DISPATCH[StoreSampler] = StoreSamplerWithoutReplacement

_SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "uniform": StoreSampler,
    "without_replacement": StoreSamplerWithoutReplacement,
}


def replay_buffer(
    max_size: int | None = None,
    *,
    td_id: str | None = None,
    batch_size: int | None = None,
    sampler: str | Sampler = "uniform",
    tensordict: bool = True,
    track_generations: bool = False,
    tensorclass_cls: type | None = None,
    buffer_kwargs: dict[str, Any] | None = None,
    alpha: float = 0.6,
    beta: float = 0.4,
    eps: float = 1e-8,
    max_times_sampled: int | None = None,
    **store_kwargs: Any,
) -> ReplayBuffer:
    """A torchrl replay buffer on a tdstore server, in one line.

    ``replay_buffer(10_000, url="redis://host:6379", batch_size=256)`` makes a new
    buffer; ``replay_buffer(url=..., td_id=rb.storage.td_id)`` (in another process or on
    another machine) attaches to it, with its size read from the server.

    Args:
        max_size: the capacity; ``None`` when attaching by ``td_id``.
        td_id: the id of the buffer to attach to (``rb.storage.td_id``).
        batch_size: the default sample size.
        sampler: ``"uniform"`` (:class:`StoreSampler`, one round trip),
            ``"without_replacement"`` (:class:`StoreSamplerWithoutReplacement`),
            ``"prioritized"`` (:class:`StorePrioritizedSampler` with ``alpha``, ``beta``,
            ``eps`` and ``max_times_sampled``: priorities on the server), or any torchrl
            ``Sampler`` (``RandomSampler()``, ``SliceSampler(...)``...).
        tensordict: a ``TensorDictReplayBuffer`` (default) or a plain ``ReplayBuffer``
            (for tensorclass or plain-tensor data).
        track_generations: samples carry ``"index_generation"`` (free with ``"uniform"``).
        tensorclass_cls: the tensorclass the data is read back as, in a process that did
            not write it.
        buffer_kwargs: more keyword arguments for the buffer (``transform``, ``prefetch``...).
        **store_kwargs: tdstore's connection keywords (``url``, ``host``, ``port``,
            ``unix_socket_path``, ``prefix``, ``password_provider``...).
    """
    storage = StoreStorage(max_size, td_id=td_id, tensorclass_cls=tensorclass_cls, **store_kwargs)
    if isinstance(sampler, str):
        if sampler == "prioritized":
            sampler = StorePrioritizedSampler(alpha, beta, eps, max_times_sampled=max_times_sampled)
        elif sampler not in _SAMPLERS:
            raise ValueError(f"sampler must be one of {sorted([*_SAMPLERS, 'prioritized'])} or a torchrl Sampler, got {sampler!r}")
        else:
            sampler = _SAMPLERS[sampler]()
    if isinstance(sampler, StorePrioritizedSampler):
        sampler.prepare(storage)
    cls = TensorDictReplayBuffer if tensordict else ReplayBuffer
    return cls(
        storage=storage,
        writer=StoreWriter(track_generations=track_generations),
        sampler=sampler,
        batch_size=batch_size,
        **(buffer_kwargs or {}),
    )


def attach(td_id: str, **kwargs: Any) -> ReplayBuffer:
    """``replay_buffer(td_id=td_id, **kwargs)``: the buffer another process made, by its id."""
    return replay_buffer(td_id=td_id, **kwargs)
