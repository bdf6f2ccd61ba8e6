"""What a :class:`~tdstore.torchrl.StoreStorage` is before it reads or writes: its ring store, opened on
first use (created when missing, attached to when it exists, reopened when another handle emptied the
buffer), and what torchrl asks of a ``TensorStorage`` about it (length, shape, cursor, revision).
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import torch
from tensordict import TensorDictBase
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten, treespec_dumps
from torchrl.data.replay_buffers.storages import Storage, TensorStorage
from torchrl.data.replay_buffers.storages.store import StoreStorage as _TorchrlStoreStorage

from tdstore import DenseShapeError, ShardedRing, ShardedRingIdError
from tdstore.checkpoint import TORCHRL_ROW_KEYS
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import Marks, PrioritizedSample, RolloutSample, Sample
from tdstore.store import SECRET_KWARGS, TensorDictStore, td_id_or_new

#: The key plain-tensor data is stored under (torchrl's own StoreStorage uses the same name).
TENSOR_KEY = "_tensor"
#: The keys the leaves of a pytree other than a dict of tensors are stored under: ``_tree0``, ``_tree1``...
TREE_KEY = "_tree"
#: Keys a TensorDictReplayBuffer puts into the data it is given or returns; buffer metadata, never stored.
METADATA_KEYS = TORCHRL_ROW_KEYS  # (a checkpoint restores torchrl dumps without them)
#: Connection keywords kept in ``state_dict`` (never a secret: see ``SECRET_KWARGS``).
_PUBLIC_CONN = ("url", "host", "port", "db", "unix_socket_path", "prefix", "backend", "username", "ssl")
#: The message of the ``RuntimeError`` that sampling a buffer nothing was written to raises.
EMPTY_ERROR = "Cannot sample from an empty storage: nothing has been written to the replay buffer yet."
#: A batch a sampler read: ``StoreStorage.get`` of its very indices returns it without reading again.
Drawn = Sample | PrioritizedSample | RolloutSample


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


_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    """``fn`` run outside ``torch.compile``'s graphs: what reaches the server (torch.compile through a
    buffer on this storage graph-breaks at the storage, as torchrl's own storages do around their shared
    counters). ``torch.compiler.disable``'s wrapper costs a few microseconds per call, several times per
    ``extend`` (the storage's methods call each other), so outside a compiled region ``fn`` runs as it is."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(_F, call)


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
    return bool(s.key_specs()) or bool(s.key_specs(fresh=True))


class StorageBase(_TorchrlStoreStorage, TensorStorage):
    """The ring store of a :class:`~tdstore.torchrl.StoreStorage` and what torchrl reads of it (see there)."""

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
        self._td_id = td_id_or_new(td_id)
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
        kw = self._open_kwargs()
        if ShardedRing.wanted(kw):  # a sharded ring (sharded=True, or spread=True on a cluster)
            return ShardedRing.from_store(td_id=self._td_id, **ShardedRing.own_kwargs(kw))  # type: ignore[return-value]
        try:
            return LazyStackedTensorDictStore.stack_of(TensorDictStore.from_store(td_id=self._td_id, **kw))
        except ShardedRingIdError:  # the id names a sharded ring: opened as one
            return ShardedRing.from_store(td_id=self._td_id, **ShardedRing.own_kwargs(kw))  # type: ignore[return-value]

    @property
    @_eager
    def _store(self) -> LazyStackedTensorDictStore:
        """The ring store (the stack a dense store is kept as), created (or attached to, by td_id) on first use: one round trip."""
        if self._ring is None:
            try:
                if ShardedRing.wanted(self._open_kwargs()):  # a sharded ring (its shards are lazy rings)
                    sharded: Any = ShardedRing(  # a tdstore.Ring as the lazy store is (torchrl's storage uses only that)
                        count=self._count_for(self._inner),
                        inner_batch_size=self._inner,
                        td_id=self._td_id,
                        **ShardedRing.own_kwargs(self._open_kwargs()),
                    )
                    self._ring = sharded
                elif self._ragged:
                    self._ring = LazyStackedTensorDictStore(
                        count=self._count_for(self._inner), inner_batch_size=self._inner, td_id=self._td_id, **self._open_kwargs()
                    )
                else:
                    count = self._count_for(self._inner)
                    dense = TensorDictStore(batch_size=[count, *self._inner], td_id=self._td_id, **self._open_kwargs())
                    self._ring = LazyStackedTensorDictStore.stack_of(dense)  # a lazy handle whose header says dense
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
            m = s.marks()
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
        return self.with_store(self._sharded_written) if self.ndim == 1 else None

    @staticmethod
    def _sharded_written(s: Any) -> torch.Tensor | None:
        """The written slots of ``s`` if it is a sharded ring not full yet (one round trip until every shard
        is full, then none), else None."""
        if not isinstance(s, ShardedRing):
            return None
        got = s.written
        if len(got) == s.capacity:
            return None
        return torch.tensor(list(got), dtype=torch.int64)

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
        return s.filled(fresh=ask)

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
        written slots: the header's ``tr``, see ``tdstore.Ring.marks``) or the buffer is emptied
        or reloaded.  One round trip (``HMGET``)."""
        m = self.with_store(lambda s: s.marks())
        return (self._reopens << 96) + (m.tr << 48) + m.rw

    def _bump_mutation_revision(self) -> None:
        """Nothing: every in-place write of this class moves the server's revision itself (torchrl calls
        this after ``set_at_``, ``set_``, ``update_``, whose writes through ``storage[:]`` did)."""

    @_eager
    def marks(self) -> Marks:
        """The ring write count and torchrl's counters (``tr``, ``gb``, ``wb``): one round trip."""
        return self.with_store(lambda s: s.marks())

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
            self._is_tensor = list(self._store.key_specs()) == [(TENSOR_KEY,)]

    def _carry(self, generation_base: int, write_base: int) -> None:
        """Give the (new) store the bases an emptied one leaves (nothing to do when both are 0)."""
        if generation_base or write_base:
            self.with_store(lambda s: s.set_marks_base(generation_base, write_base))
