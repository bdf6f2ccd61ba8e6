"""The torchrl ``Storage`` of :mod:`tdstore.torchrl`: a tdstore ring whose length, cursor and generations are the server's.

Every process that opens a :class:`StoreStorage` with the same ``td_id`` and server
shares one buffer.  The writer and samplers (:mod:`tdstore.torchrl.writer`,
:mod:`tdstore.torchrl.samplers`) reach the ring through :meth:`StoreStorage.with_store`,
which reopens it when another handle emptied the buffer.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from copy import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass, lazy_stack
from tensordict.utils import unravel_key_list
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten, treespec_dumps, treespec_loads
from torchrl.data.replay_buffers.storages import Storage, TensorStorage
from torchrl.data.replay_buffers.storages.store import StoreStorage as _TorchrlStoreStorage

from tdstore._engine.connection import SECRET_KWARGS
from tdstore._engine.engine import new_td_id
from tdstore._errors import DenseShapeError
from tdstore._plan import index as _index
from tdstore._ring import extend as _ring
from tdstore._ring.dense_methods import dense_rows
from tdstore._ring.policy_calls import PrioritizedSample
from tdstore._shards import layout as _sharded
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.torchrl import marks as _torchrl_marks
from tdstore.torchrl.row_copy import write_through

#: The key plain-tensor data is stored under (torchrl's own StoreStorage uses the same name).
TENSOR_KEY = "_tensor"
#: The keys the leaves of a pytree other than a dict of tensors are stored under: ``_tree0``, ``_tree1``...
TREE_KEY = "_tree"
#: Keys a TensorDictReplayBuffer puts into the data it is given or returns; buffer metadata, never stored.
METADATA_KEYS = ("index", "index_generation")
#: Connection keywords kept in ``state_dict`` (never a secret: see ``SECRET_KWARGS``).
_PUBLIC_CONN = ("url", "host", "port", "db", "unix_socket_path", "prefix", "backend", "username", "ssl")
#: The message of the ``RuntimeError`` that sampling a buffer nothing was written to raises.
EMPTY_ERROR = "Cannot sample from an empty storage: nothing has been written to the replay buffer yet."
#: A batch a sampler read: ``StoreStorage.get`` of its very indices returns it without reading again.
Drawn = _ring.Sample | PrioritizedSample


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


def _only_dicts(tree: Any) -> bool:
    """Whether every container of the pytree ``tree`` is a plain dict of string keys (a TensorDict holds it as it is)."""
    if isinstance(tree, torch.Tensor):
        return True
    return type(tree) is dict and all(isinstance(k, str) and _only_dicts(v) for k, v in tree.items())


def _spec_text(spec: TreeSpec | None) -> str | None:
    """``spec`` as JSON text for state dicts and checkpoints (None when none, or not serializable)."""
    if spec is None:
        return None
    try:
        return treespec_dumps(spec)
    except (TypeError, ValueError, NotImplementedError):
        return None


def _flip(items: list) -> Any:
    """A list of pytrees of one structure as one pytree of stacked leaves (as torchrl's storages take a list)."""
    flat = [tree_flatten(item) for item in items]
    odd = [type(x).__name__ for x in flat[0][0] if not isinstance(x, torch.Tensor)]
    if odd:
        raise TypeError(
            f"StoreStorage stores TensorDicts, tensorclasses, tensors and pytrees of tensors, not a {type(items[0]).__name__} "
            f"holding {odd[0]} (wrap non-tensor values in a TensorDict as NonTensorData)"
        )
    specs = {str(spec) for _, spec in flat}
    if len(specs) != 1:
        raise ValueError(f"StoreStorage: the list's items must have one tree structure, got {len(specs)} different ones")
    try:
        return tree_unflatten([torch.stack(list(col)) for col in zip(*(leaves for leaves, _ in flat))], flat[0][1])
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"StoreStorage: the list's items cannot be stacked leaf by leaf: {err}") from None


#: What reaches the server runs outside ``torch.compile``'s graphs (torch.compile through a buffer on this
#: storage graph-breaks at the storage, as torchrl's own storages do around their shared counters).
_eager = torch.compiler.disable


def _from_the_end(index: Any) -> bool:
    """Whether ``index`` counts from the end or is a mask (so means something else below the capacity)."""
    if isinstance(index, int):
        return index < 0
    if isinstance(index, (list, np.ndarray)):
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool or bool((index < 0).any())
    return False


def has_keys(s: LazyStackedTensorDictStore) -> bool:
    """Whether the store has keys; a handle that saw none asks the server again (another process may have written the first ones)."""
    engine = s.stack_ops.engine
    if not engine.header.leaves:
        engine.set_header(engine.fetch_header())
    return bool(engine.header.leaves)


class StoreStorage(_TorchrlStoreStorage, TensorStorage):
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

    def __init__(
        self,
        max_size: int | None = None,
        *,
        td_id: str | None = None,
        tensorclass_cls: type | None = None,
        ndim: int = 1,
        ragged: bool = False,
        compilable: bool = False,
        checkpointer: Any = None,
        consolidated: bool = False,
        shared_init: bool = False,
        **store_kwargs: Any,
    ) -> None:
        # consolidated and shared_init are LazyTensorStorage's memory layout and fork-time set-up:
        # a server's store is one layout, shared by every process already (accepted, nothing to do)
        if int(ndim) < 1:
            raise ValueError(f"StoreStorage(ndim={ndim}): ndim is at least 1")
        if store_kwargs.get("device") == "auto":  # TensorStorage's "the data's device": a server's rows read to CPU
            store_kwargs.pop("device")
        self._secrets = {k: store_kwargs.pop(k) for k in list(store_kwargs) if k in SECRET_KWARGS}
        if "url" in store_kwargs and store_kwargs["url"] is not None:
            self._secrets["url"] = store_kwargs["url"]
            store_kwargs["url"] = _public_url(store_kwargs["url"])
        self._conn = store_kwargs
        self._td_id = td_id or new_td_id()
        self._ragged = bool(ragged)  # the kind of store a new buffer is made as (an existing one is opened as it is)
        self._ring: LazyStackedTensorDictStore | None = None
        self._pending: Drawn | None = None
        self._reopens = 0
        self._inner: tuple[int, ...] = ()  # the elements' batch size a new store is made with (the first write's)
        self._tree = False  # this process wrote dicts of tensors (read back as dicts, as torchrl's storages do)
        self.ndim = int(ndim)
        if max_size is None:
            if td_id is None:
                raise ValueError("StoreStorage needs max_size (or the td_id of an existing buffer, whose size is read from the server)")
            self._ring = self._attach_existing()
            self._inner = tuple(self._ring.batch_size[1:])
            max_size = self._ring.capacity * self._lanes(self._inner)
        self._cells = int(max_size)  # what was asked for: an ndim>1 storage's dim 0 is cells / lanes, rounded up
        Storage.__init__(self, max_size=max_size, checkpointer=checkpointer, compilable=compilable)
        self._gen_base: tuple[tuple[str, int], int] | None = None  # (store_identity, gb) read once per store
        self._keep_write_count = False  # set by StoreWriter._empty(empty_write_count=False) for the next _empty
        self._treespec: TreeSpec | None = None  # the pytree this process wrote (other than dicts of tensors)
        self._tensorclass_type: type[Any] | None = tensorclass_cls  # any @tensorclass: its methods come from the decorator
        self._is_tensor: bool | None = None  # None: not known in this process yet (read from the store's keys)
        self.initialized = True

    # -- the ring store --------------------------------------------------------------------
    def _open_kwargs(self) -> dict[str, Any]:
        return {**self._conn, **self._secrets}

    def _attach_existing(self) -> LazyStackedTensorDictStore:
        """The existing store ``td_id`` names, dense or lazy: the stack it is kept as."""
        from tdstore._checkpoint.export_import import _lazy_handle
        from tdstore._shards.layout import wants_shards
        from tdstore.store import TensorDictStore

        if wants_shards(self._open_kwargs()):  # a sharded ring (spread=True on a cluster): see _sharded
            return LazyStackedTensorDictStore.from_store(td_id=self._td_id, **self._open_kwargs())
        return _lazy_handle(TensorDictStore.from_store(td_id=self._td_id, **self._open_kwargs()))

    @property
    @_eager
    def _store(self) -> LazyStackedTensorDictStore:
        """The ring store (the stack a dense store is kept as), created (or attached to, by td_id) on first use: one round trip."""
        if self._ring is None:
            try:
                if self._ragged or _sharded.wants_shards(self._open_kwargs()):  # a sharded ring is lazy rings
                    self._ring = LazyStackedTensorDictStore(
                        count=self._count_for(self._inner), inner_batch_size=self._inner, td_id=self._td_id, **self._open_kwargs()
                    )
                else:
                    from tdstore.dense import TensorDictStore

                    count = self._count_for(self._inner)
                    dense = TensorDictStore(batch_size=[count, *self._inner], td_id=self._td_id, **self._open_kwargs())
                    self._ring = dense._store  # a LazyStackedTensorDictStore whose header says dense
            except (ValueError, TypeError):  # the store exists with another layout or kind: attach to it as it is
                self._ring = self._attach_existing()
            if self.ndim > 1 and len(self._ring.batch_size) >= self.ndim:  # (attached to a store written already)
                self.max_size = self._ring.capacity * self._lanes(tuple(self._ring.batch_size[1:]))
        return self._ring

    def _lanes(self, inner: tuple[int, ...]) -> int:
        """Cells per ring slot: the element dims an ndim>1 storage counts (``inner[:ndim-1]``), 1 for ndim=1."""
        return int(torch.Size(inner[: self.ndim - 1]).numel())

    def _count_for(self, inner: tuple[int, ...]) -> int:
        """The ring's slots for elements of batch size ``inner``: ``max_size``; with ndim>1, ``max_size``
        cells over the lanes, rounded up (as torchrl's ``LazyTensorStorage`` makes its dim 0)."""
        if self.ndim == 1 or len(inner) < self.ndim - 1:
            return self._cells
        return -(self._cells // -self._lanes(inner))

    @property
    def _dim0(self) -> int:
        """The ring's slots (dim 0 of the storage): ``max_size`` when ndim=1 (no round trip)."""
        return self.max_size if self.ndim == 1 else self._store.capacity

    def _fit_layout(self, rows: TensorDictBase) -> None:
        """Make the store's element batch size that of ``rows``' elements (``rows.batch_size[1:]``).

        A store nothing was written to yet (made by ``len`` or ``td_id`` before the first write)
        is made again with it; a store holding rows of another element batch size refuses the
        write, naming both.  Free when the sizes agree (the cached header)."""
        self.with_store(lambda s: self._fit_store(s, tuple(rows.batch_size[1:]), rows.batch_size))

    def _fit_store(self, s: LazyStackedTensorDictStore, inner: tuple[int, ...], batch: torch.Size) -> None:
        if len(inner) < self.ndim - 1:
            raise ValueError(f"StoreStorage(ndim={self.ndim}) stores data of at least {self.ndim} batch dims, got batch size {list(batch)}")
        have = tuple(s.batch_size[1:])
        if have == inner and (self.ndim == 1 or s.capacity == self._count_for(inner)):
            if self.ndim > 1:
                self.max_size = s.capacity * self._lanes(inner)
            return
        if not has_keys(s) and s.write_count == 0:  # an empty placeholder: made again (with what empty() carried)
            m = _torchrl_marks.read(s.stack_ops.engine)
            s.clear_redis()
            self._inner, self._ring = inner, None
            self._reopens += 1
            self._store  # noqa: B018
            self._carry(m.gb, m.wb)
            if self.ndim > 1:
                self.max_size = self._count_for(inner) * self._lanes(inner)  # as torchrl's: whole lanes
            return
        raise ValueError(
            f"StoreStorage: the buffer's elements have batch size {list(have)}, this data's elements {list(inner)} "
            f"(data of batch size {list(batch)}); the element batch size is fixed by the first write"
        )

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

    @property
    def store_identity(self) -> tuple[str, int]:
        """Which store this handle is on: ``(td_id, reopen count)``, which changes when the buffer is emptied
        or another one is loaded (a sampler forgets what it knew of the old one).  No round trip."""
        return self._td_id, self._reopens

    @_eager
    def with_store(self, fn: Callable[[LazyStackedTensorDictStore], Any]) -> Any:
        """Run ``fn`` on the store; when another handle emptied the buffer (deleted and
        recreated the store), reopen it once and run ``fn`` on the new one.  The writer and
        samplers reach the store through this, so that they follow a reopen too."""
        try:
            try:
                return fn(self._store)
            except KeyError as err:
                if not _is_reattach_error(err):
                    raise
            self._ring = None
            self._reopens += 1
            return fn(self._store)
        except DenseShapeError as err:
            raise DenseShapeError(
                f"{err}. This buffer is dense (its first write fixed each key's shape, as LazyTensorStorage does): "
                "for rows that differ in shape make it with ragged=True (replay_buffer(..., ragged=True), StoreStorage(..., ragged=True))"
            ) from None

    # -- what torchrl reads ----------------------------------------------------------------
    @_eager
    def written_slots(self) -> torch.Tensor | None:
        """The written slots of a sharded ring not yet full (one round trip), which ``range(len(self))`` does not
        name (it numbers its slots shard after shard, and shards fill in turn); None for any other ring, whose
        written slots are ``range(len(self))``. Samplers draw from these (``StoreSamplerWithoutReplacement``,
        torchrl's ``RandomSampler`` through ``_rand_given_ndim``)."""
        from tdstore._shards.ring import ShardedRing

        def written(s: Any) -> torch.Tensor | None:
            if not isinstance(s, ShardedRing):
                return None
            got = s.written  # one round trip until every shard is full (then none)
            if len(got) == s.capacity:
                return None
            return torch.tensor(list(got), dtype=torch.int64)

        return self.with_store(written) if self.ndim == 1 else None

    def _rand_given_ndim(self, batch_size: int) -> Any:
        """torchrl's uniform draw (``RandomSampler``): over the written slots (see :meth:`written_slots`)."""
        slots = self.written_slots()
        if slots is None:
            return super()._rand_given_ndim(batch_size)
        if not slots.numel():
            raise RuntimeError(EMPTY_ERROR)
        return slots[torch.randint(0, slots.numel(), (batch_size,), generator=self._rng)]

    @_eager
    def __len__(self) -> int:
        """The number of written cells (slots, times the lanes when ndim>1), read from the server (one round trip)."""
        return self._len_along_dim0 * (1 if self.ndim == 1 else self._lanes(self._inner_now()))

    @property
    @_eager
    def _len_along_dim0(self) -> int:
        """The written slots, read from the server (one round trip)."""
        return self.with_store(lambda s: self._written_slots(s, ask=True))

    @staticmethod
    def _written_slots(s: LazyStackedTensorDictStore, *, ask: bool = False) -> int:
        """The written slots of ``s``: once this handle has seen its ring full, its capacity without a round trip
        (the ring's write count only grows; a buffer emptied meanwhile is another creation of the store, which
        the read that follows finds, and ``with_store`` reopens it); else, or with ``ask``, read from the server."""
        engine = s.stack_ops.engine
        if engine.ring_full and not ask:
            return s.capacity
        n = s.ring_state().written
        engine.ring_full = engine.ring_full or n >= s.capacity
        return n

    def _inner_now(self) -> tuple[int, ...]:
        return tuple(self._store.batch_size[1:])

    @property
    @_eager
    def _is_full(self) -> bool:
        return self._len_along_dim0 == self._dim0

    @_eager
    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        """The ring's slots; for an ndim>1 storage not written yet, what the data's lanes make of ``max_size`` (no round trip)."""
        if self.ndim == 1:
            return self.max_size
        ring = self._ring
        if ring is not None and len(ring.batch_size) >= self.ndim:
            return ring.capacity
        data = single_data if single_data is not None else batched_data
        if data is None:
            raise ValueError("single_data or batched_data must be passed.")
        shape = data.shape if hasattr(data, "shape") else tree_flatten(data)[0][0].shape
        return self._count_for(tuple(shape[1 if batched_data is not None else 0 :]))

    @property
    def device(self) -> torch.device | None:
        """Where reads land (the ``device=`` the storage was given; ``None``: CPU, no device), as a ``LazyTensorStorage``'s."""
        d = self._conn.get("device")
        return torch.device(d) if d is not None else None

    @device.setter
    def device(self, value: Any) -> None:
        """``"auto"`` (TensorStorage's "the data's device") reads to CPU, the server's side of any device."""
        self._conn["device"] = None if value in (None, "auto") else value

    # TensorStorage's bookkeeping of in-process memory, which a server's store has no use for
    @property
    def _storage_keys(self) -> None:
        """No key filter: the store takes new keys (TensorStorage filters only a locked shared-memory storage's)."""
        return None

    @_storage_keys.setter
    def _storage_keys(self, value: Any) -> None:
        """Ignored (see the getter)."""

    @property
    @_eager
    def _total_shape(self) -> torch.Size:
        if self.ndim == 1:
            return torch.Size([self.max_size])
        inner = self._inner_now()
        return torch.Size([self._dim0, *inner[: self.ndim - 1]])

    def _content_devices(self) -> set[torch.device]:
        return {self.device or torch.device("cpu")}

    def _share_memory_(self) -> None:
        """Nothing: every process reaches the rows on the server."""

    def _fork_safe(self) -> bool:
        return True

    @property
    @_eager
    def shape(self) -> torch.Size:
        """The written slots (and, when ndim>1, the lanes), as a ``LazyTensorStorage``'s shape (one round trip)."""
        n = self._len_along_dim0
        return torch.Size([n]) if self.ndim == 1 else torch.Size([n, *self._inner_now()[: self.ndim - 1]])

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        """Ignored: the length is the server's (torchrl's writers assign it after a write)."""

    @property
    @_eager
    def _last_cursor_index(self) -> int | None:
        """The slot written last, from the server (SliceSampler cuts trajectories there)."""
        rw = self.with_store(lambda s: s.write_count)
        return None if rw == 0 else (rw - 1) % self._dim0

    def _set_last_cursor(self, cursor: Any) -> None:
        """Ignored: the cursor is the server's."""

    @property
    @_eager
    def _mutation_revision(self) -> int:
        """Changes whenever any process extends the ring (the server's write count ``rw``), writes rows
        in place through torchrl (``rb[i] = td``, ``set_at_``, ``set_``, ``update_``, torchrl writers'
        written slots: the header's ``tr``, see :mod:`tdstore.torchrl.marks`) or the buffer is emptied
        or reloaded.  One round trip (``HMGET``)."""
        m = self.with_store(lambda s: _torchrl_marks.read(s.stack_ops.engine))
        return (self._reopens << 96) + (m.tr << 48) + m.rw

    def _bump_mutation_revision(self) -> None:
        """Nothing: every in-place write of this class moves the server's revision itself (torchrl calls
        this after ``set_at_``, ``set_``, ``update_``, whose writes through ``storage[:]`` did)."""

    @_eager
    def marks(self) -> _torchrl_marks.Marks:
        """The ring write count and torchrl's counters (``tr``, ``gb``, ``wb``): one round trip."""
        return self.with_store(lambda s: _torchrl_marks.read(s.stack_ops.engine))

    @_eager
    def generation_base(self) -> int:
        """What the buffer's torchrl generations start from (``gb``: it grows at each ``empty()``), read once per store."""
        ident = self.store_identity
        if self._gen_base is None or self._gen_base[0] != ident:
            gb = self.marks().gb
            self._gen_base = (self.store_identity, gb)  # (identity after the read: a reopen in it counts)
        return self._gen_base[1]

    def _data_kind(self) -> None:
        """Learn from the store's keys whether it holds plain tensors (a process that never wrote)."""
        if self._is_tensor is None and has_keys(self._store):
            self._is_tensor = list(self._store.stack_ops.engine.header.leaves) == [(TENSOR_KEY,)]

    # -- writes ----------------------------------------------------------------------------
    def _to_rows(self, data: Any) -> TensorDictBase:
        """``data`` (a batch) as the tensordict the ring stores; remembers the data kind.

        Pytrees (dicts, tuples, lists, named tuples of tensors, any nesting), as torchrl's
        ``LazyTensorStorage`` takes them (each leaf's dim 0 is the batch; a ``list`` is a list of
        items, stacked leaf by leaf): dicts of tensors are stored as a TensorDict of their keys,
        other trees as a TensorDict of their leaves (``"_tree0"``, ``"_tree1"``...); both are
        read back in the tree's form in this process (see :meth:`get`)."""
        if isinstance(data, list):
            if data and all(isinstance(d, torch.Tensor) and not is_tensor_collection(d) for d in data):
                data = torch.stack(list(data))
            elif data and all(is_tensor_collection(d) for d in data):
                data = lazy_stack(list(data))
            else:
                data = _flip(data)
        if not isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            data = self._tree_rows(data)
        else:
            self._tree, self._treespec = False, None
        if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            self._is_tensor = True
            rows: TensorDictBase = TensorDict({TENSOR_KEY: data}, batch_size=data.shape[: self.ndim])
            self._fit_layout(rows)
            return rows
        if not is_tensor_collection(data):
            raise TypeError(
                f"StoreStorage stores TensorDicts, tensorclasses, tensors and dicts of tensors, not {type(data).__name__} "
                "(torchrl's LazyTensorStorage also takes other pytrees: wrap them in a TensorDict)"
            )
        self._is_tensor = False
        if is_tensorclass(data):
            self._tensorclass_type = type(data)
            data = data._tensordict
        present = [k for k in METADATA_KEYS if k in data.keys()]
        rows = data.exclude(*present) if present else data
        self._fit_layout(rows)
        return rows

    def _tree_rows(self, data: Any) -> TensorDictBase:
        """A pytree of tensors (one batch: each leaf's dim 0 is the batch) as a TensorDict (see :meth:`_to_rows`)."""
        leaves, spec = tree_flatten(data)
        odd = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if odd or not leaves:
            what = f"a {type(data).__name__} holding {odd[0]}" if odd else f"an empty {type(data).__name__}"
            raise TypeError(
                f"StoreStorage stores TensorDicts, tensorclasses, tensors and pytrees of tensors, not {what} "
                "(wrap non-tensor values in a TensorDict as NonTensorData)"
            )
        n = leaves[0].shape[: self.ndim]
        bad = [tuple(x.shape) for x in leaves if x.shape[: self.ndim] != n]
        if bad or not n:
            raise ValueError(
                f"StoreStorage: the tree's tensors must share their first dim (the batch): got {tuple(leaves[0].shape)} and "
                f"{bad[0] if bad else '(no dim)'}"
            )
        if _only_dicts(data):
            td = TensorDict(data, batch_size=n)
            self._tree, self._treespec = True, None
            return td
        self._tree, self._treespec = True, spec
        return TensorDict({f"{TREE_KEY}{i}": x for i, x in enumerate(leaves)}, batch_size=n)

    @_eager
    def extend_ring(self, data: Any) -> torch.Tensor:
        """Write a batch at the server's cursor; returns its slots (``StoreWriter.extend``).

        One atomic ``store.extend`` call per ``max_size`` rows: a batch longer than the
        ring is written in ``max_size`` chunks, the later ones overwriting the earlier
        ones, as torchrl's own writer does with ``index % max_size``.
        """
        return self._extend_rows(self._to_rows(data), data)

    def _extend_rows(self, rows: TensorDictBase, data: Any) -> torch.Tensor:
        n = rows.batch_size[0] if rows.batch_dims else 0
        if n == 0:
            raise RuntimeError(f"Expected at least one element in extend. Got {data=}")
        m = self._dim0
        if n <= m:
            return self.with_store(lambda s: s.extend(rows).indices)

        def write_chunk(start: int) -> torch.Tensor:
            return self.with_store(lambda s: s.extend(rows[start : start + m]).indices)

        return torch.cat([write_chunk(i) for i in range(0, n, m)])

    @_eager
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write ``data`` at explicit slots: ``rb[index] = data``, and torchrl's own writers.

        ``set_cursor=False`` (``rb[index] = data``, ``write_at``): one atomic call; the slots keep
        their generation and ``len`` is unchanged.  ``set_cursor=True`` is how torchrl's writers
        (``RoundRobinWriter``, ``TensorDictMaxValueWriter``, custom ones) write: they keep their
        cursor in their process.  Slots that continue the server's cursor are written by the ring
        (``store.extend``: len, cursor and generations advance as torchrl expects), slots already
        written in place (one atomic call each, after one read of the ring state; a batch of both,
        as ``TensorDictMap`` writes, is two calls).  New slots off the server's cursor raise before
        anything is written.  Several processes' cursors are not reconciled: a writer behind the
        server's cursor writes its slots in place, over others' rows (use ``StoreWriter``).
        """
        if isinstance(cursor, tuple) and self.ndim > 1:
            if set_cursor:
                raise ValueError(f"StoreStorage(ndim={self.ndim}): a writer's cursor indexes dim 0, got {cursor!r}")
            self._set_cells(cursor, data)
            return
        single = isinstance(cursor, int) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        bound = self.max_size if self.ndim == 1 else self._max_size_along_dim0(**{"single_data" if single else "batched_data": data})
        slots, one = _index.positions(cursor, bound)  # a mask means what it means to indexing
        rows = self._to_rows((data.unsqueeze(0) if hasattr(data, "unsqueeze") else [data]) if one else data)
        if set_cursor:
            self._set_at_cursor(slots, rows)
            return

        self._write_in_place(slots, rows)

    def _set_cells(self, index: tuple, data: Any) -> None:
        """``rb[(i, j)] = data`` of an ndim>1 storage: the dim-0 rows read, changed here and written back
        (two atomic calls: a write another process makes to those rows in between is lost)."""
        first, rest = index[0], index[1:]
        slots, _ = _index.positions(first, self._dim0)
        slots = slots.unique()
        local = self.with_store(lambda s: self._read(s, slots))
        where = torch.searchsorted(slots, _index.positions(first, self._dim0)[0])
        pos = where if isinstance(first, torch.Tensor) and first.ndim and any(isinstance(r, torch.Tensor) for r in rest) else None
        if pos is not None:
            local[(pos, *rest)] = data
        elif isinstance(first, int) or (isinstance(first, torch.Tensor) and first.ndim == 0):
            local[(0, *rest)] = data
        else:
            local[(where, *rest)] = data
        rows = local if not self._is_tensor else local
        self._write_in_place(slots, rows)

    def _set_at_cursor(self, slots: torch.Tensor, rows: TensorDictBase) -> None:
        """``set(slots, rows, set_cursor=True)``: a ring write where ``slots`` continue the server's cursor, else in place."""
        state = self.with_store(lambda s: s.ring_state())
        m = self._dim0
        n = int(slots.numel())
        if n and state.written == state.cursor and int(slots[0]) > state.written and torch.equal(slots, slots[0] + torch.arange(n)):
            state = self._wait_for_writers(int(slots[0]), state)
        if n and bool((slots == (state.cursor + torch.arange(n)) % m).all()):
            got = self._extend_rows(rows, rows)
            if not torch.equal(got, slots):
                raise RuntimeError(
                    f"StoreStorage: the writer asked for slots {slots.tolist()[:8]} at the cursor, but another process moved the "
                    f"server's cursor meanwhile and the rows went to {got.tolist()[:8]}: with several writer processes use "
                    "tdstore.torchrl.StoreWriter (its slots are reserved on the server)"
                )
            return
        fresh = slots >= state.written
        if fresh.any():
            order = torch.argsort(slots[fresh])
            new = slots[fresh][order]
            if not torch.equal(new, state.written + torch.arange(new.numel())) or state.written != state.cursor:
                raise RuntimeError(
                    f"StoreStorage: the writer wrote slot {int(new[0])}, which the ring has not written yet, off its cursor "
                    f"(written: {state.written}, cursor: {state.cursor}); a writer's new rows must continue the server's cursor "
                    f"(a write ahead of it waits wait_for_writers={self.wait_for_writers} s for other processes' writes before it)"
                )
            if (~fresh).any():  # a batch of updates and new rows (TensorDictMap): two atomic calls
                self._write_in_place(slots[~fresh], rows[~fresh])
            got = self._extend_rows(rows[fresh][order], rows)
            if not torch.equal(got, new):
                raise RuntimeError(
                    f"StoreStorage: another process moved the server's cursor meanwhile: the new rows went to {got.tolist()[:8]}"
                )
            return
        self._write_in_place(slots, rows)

    #: How long a write of new slots ahead of the server's cursor waits for the writes before them (seconds).
    wait_for_writers: float = 10.0

    def _wait_for_writers(self, first: int, state: _ring.RingState) -> _ring.RingState:
        """New slots ahead of the cursor of a ring not full yet: processes sharing this writer's cursor (torchrl's
        writers keep it in shared memory across a fork) are writing the slots before them.  Wait, on the store's
        events, until the ring has written up to ``first`` (at most ``wait_for_writers`` seconds); then the slots
        continue the cursor.  Returns the ring state then (the same when the wait ran out: the caller refuses)."""
        from tdstore._errors import MustWait
        from tdstore._ring import waiting as _waiting

        def attempt(s: LazyStackedTensorDictStore) -> _ring.RingState:
            now = s.ring_state()
            if now.written < first and now.written == now.cursor:
                raise MustWait("writers", f"the ring has written {now.written} slots, this write starts at {first}")
            return now

        try:
            return self.with_store(
                lambda s: _waiting.until_ready(s.stack_ops.engine, lambda: attempt(s), self.wait_for_writers, "a write ahead of the cursor")
            )
        except TimeoutError:
            return state

    def _write_in_place(self, slots: torch.Tensor, rows: TensorDictBase) -> None:
        """``rows`` at ``slots``, written slots kept as they are (no cursor, no generation): one atomic call,
        which moves the server's revision too (see :meth:`_write_rows`)."""

        def write(s: LazyStackedTensorDictStore) -> None:
            s[slots] = rows

        self._write_rows(write)

    # -- torchrl's update_if_present ------------------------------------------------------
    supports_conditional_update = True

    def _conditional_patch_leaf(self, key: Any) -> torch.Tensor:
        """The whole stored key, read from the server (torchrl reads a version key's values from it)."""
        s = self._store
        if not has_keys(s):
            raise RuntimeError("Conditional updates require data: write some to the buffer before calling update_if_present.")
        path = tuple(unravel_key_list([key])[0]) if not isinstance(key, str) else (key,)
        if path not in s.stack_ops.engine.header.leaves:
            raise KeyError(f"Key {key} does not exist in the storage. Conditional patches can only target existing tensor fields.")
        return self.with_store(lambda st: st.get(key))

    def _validate_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """torchrl's checks (dtype, feature shape) from the cached schema: no round trip."""
        h = self._store.stack_ops.engine.header
        n_rows = index.shape[0] if index.ndim > 1 else index.numel()
        out = {}
        for key, value in patch.items():
            path = (key,) if isinstance(key, str) else tuple(key)
            leaf = h.leaves.get(path)
            if leaf is None or leaf.json:
                raise KeyError(f"Key {key} does not exist in the storage. Conditional patches can only target existing tensor fields.")
            if leaf.shape is None:
                raise ValueError(f"patch key {key} varies in shape between elements: conditional patches need a fixed shape")
            value = torch.as_tensor(value)
            if value.dtype != leaf.dtype:
                raise ValueError(f"dtype mismatch for patch key {key}: got {value.dtype}, the storage holds {leaf.dtype}.")
            feature = tuple(leaf.shape)
            try:
                out[key] = value.reshape((n_rows, *feature))
            except RuntimeError:
                raise ValueError(
                    f"shape mismatch for patch key {key}: got {tuple(value.shape)}, expected {n_rows} records with feature shape {feature}."
                ) from None
        return out

    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
        """Write the patch of the rows torchrl found live: one atomic call.  The liveness check is the
        writer's, in this process (the store's ``update_if`` checks generations on the server)."""
        rows = TensorDict({k: v for k, v in patch.items()}, batch_size=[index.numel()])
        self._write_in_place(index.reshape(-1), rows)

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
                    slots = torch.arange(*at.indices(self._written_slots(s)))
                    return self._read(s, slots)

                td = self.with_store(read_written)
            else:
                td = self.with_store(lambda s: self._read(s, index))
        if isinstance(td, LazyStackedTensorDict) and self._store.stack_ops.engine.header.kind == "dense":
            td = dense_rows(td)  # non-tensor rows of a dense buffer: one TensorDict, as LazyTensorStorage gives
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
            n = self._written_slots(s)
            if n == 0:
                raise RuntimeError("Cannot get elements out of an empty storage (nothing was written yet)")
            return s.stack_ops.read(slice(0, n))

        return self.with_store(read).get(key)

    def _write_rows(self, fn: Callable[[LazyStackedTensorDictStore], Any]) -> None:
        """An in-place write (``fn`` writes the store once, as ``storage[:]``'s rows, ``rb[i] = td`` and torchrl's
        writers writing written slots do): the rows and the header's ``tr``, which every process's
        ``_mutation_revision`` reads, in the same atomic call (one round trip)."""

        def counted(s: LazyStackedTensorDictStore) -> Any:
            with s.stack_ops.engine.counting_in_place():
                return fn(s)

        self.with_store(counted)

    def _read(self, s: LazyStackedTensorDictStore, index: Any) -> TensorDictBase:
        if not has_keys(s):
            raise RuntimeError("Cannot get elements out of an empty storage (nothing was written yet)")
        if isinstance(index, torch.Tensor) and index.ndim == 1 and index.numel() == 0:
            return s.stack_ops.read(slice(0, 0))
        # as a LazyTensorStorage's, negative positions and masks are taken along the written slots only
        bound = self._len_along_dim0 if _from_the_end(index) else self._dim0
        slots, one = _index.positions(index, bound)
        got = s.stack_ops.read(slots)
        return got[0] if one else got

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
            return (item >= 0) & (item < n) if item.ndim else torch.tensor(0 <= int(item) < n)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # -- emptying, state, pickling ---------------------------------------------------------
    def _empty(self) -> None:
        """Delete the buffer's store on the server (one atomic call) and make it again, empty, with the
        same ``td_id``.  The new store carries the generations over (its generation base is past every
        generation the old one gave, so an ``(index, generation)`` handle taken before never looks live
        again) and, after ``rb.empty(empty_write_count=False)``, the write count.  The ring has no
        server operation that empties it in place, so this is not safe while other processes write:
        a write racing the delete either lands before it (and is dropped) or recreates the store
        itself.  Other handles reopen the new store on their next call."""
        self._pending = None
        keep, self._keep_write_count = self._keep_write_count, False
        m = self.marks()
        self.with_store(lambda s: s.clear_redis())
        self._ring = None
        self._reopens += 1
        laps = (m.rw - 1) // self._dim0 + 1 if m.rw else 0
        self._carry(m.gb + laps, m.wb + m.rw if keep else 0)

    def delete(self) -> None:
        """Delete the buffer's keys on the server (one atomic call).  Unlike ``empty()``, whose new store
        keeps the generations going, nothing stays: a later use makes the buffer again from 0."""
        self._pending = None
        self.with_store(lambda s: s.clear_redis())
        self._ring = None
        self._reopens += 1

    def _carry(self, generation_base: int, write_base: int) -> None:
        """Give the (new) store the bases an emptied one leaves (nothing to do when both are 0)."""
        if generation_base or write_base:
            self.with_store(lambda s: _torchrl_marks.set_base(s.stack_ops.engine, generation_base, write_base))

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
        if path is not None and self._tensorclass_type is None:
            import sys

            module, _, name = path.rpartition(".")
            cls = getattr(sys.modules.get(module), name, None)
            if cls is not None and is_tensorclass(cls):
                self._tensorclass_type = cls

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
        self._empty()
        if n:
            self._extend_rows(self._to_rows(rows[:n] if TENSOR_KEY not in rows.keys() else rows[TENSOR_KEY][:n]), rows)

    def dumps(self, path: Any) -> None:
        """Write a checkpoint of the buffer into the directory ``path``: every row, the ring state
        (write count, cursor, generations), priorities and sampling policy (``tdstore._checkpoint.export_import``),
        plus the state dict as ``store.json``.  Homogeneous data is in torchrl's memmap layout:
        ``LazyTensorStorage(max_size).loads(path)`` reads it."""
        from tdstore._checkpoint.export_import import export_store

        self._pending = None
        export_store(self._store, path, extra={"store.json": self.reference()})

    def loads(self, path: Any) -> None:
        """Restore the checkpoint ``dumps`` wrote in ``path`` (which store it lands on: :mod:`tdstore.torchrl.dumps_loads`)."""
        from tdstore.torchrl import dumps_loads as _torchrl_checkpoint

        _torchrl_checkpoint.load_checkpoint(self, Path(path))

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
