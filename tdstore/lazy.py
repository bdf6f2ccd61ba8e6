"""``LazyStackedTensorDictStore``: a lazy stack of tensordicts that lives on a Redis-wire server.

The class is a ``StoreBase`` (identity, writes, tensordict's surface) plus the mixins only the
lazy store has (``_front.state`` lists them);
this module holds its construction, identity and pickling, the views it hands out, and
:class:`LazyStackAccess`, the internal interface its views and the dense ``TensorDictStore`` use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.base import NO_DEFAULT

from tdstore._engine.connection import open_client
from tdstore._engine.engine import Engine, td_id_or_new
from tdstore._format import nontensor
from tdstore._format.header_info import check_new_layout as _check_layout
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import Header, KeySpec, NestedPath, key_specs_of
from tdstore._front.common import fetch_existing, ttl_to_ms
from tdstore._front.element import ElementView
from tdstore._front.key_changes import LazyKeys
from tdstore._front.lifecycle import LazyLifecycle
from tdstore._front.reading import LazyReads
from tdstore._front.store_base import StoreBase
from tdstore._plan.values import as_path, check_device, usable_device
from tdstore._ring import direct_extend
from tdstore._ring.lazy_methods import LazyRing
from tdstore.ring_interface import Ring  # noqa: F401  (states the ring calls: gives them their docstrings)


class LazyStackedTensorDictStore(LazyReads, LazyKeys, LazyLifecycle, LazyRing, StoreBase):
    """A lazy stack of ``count`` tensordicts whose leaves live on a Redis-compatible server.

    Every read and write of the stack, an element, a slice, a random batch, or a
    key, is one atomic call of a Lua script on the server (one round trip), so
    many processes can read and write the same store at once and never see a
    half-written element.  The handle only caches the store's schema (keys,
    dtypes, shapes), and the server checks that cache on every call.

    Elements may differ in shape (a *heterogeneous* key), and an element write
    may change an element's shape: the server rewrites the key's offset table.

    Keyword Args:
        backend: a label for the server kind ("redis", "dragonfly", "valkey", "keydb").
        host, port, db, unix_socket_path: where the server is (ignored with ``url`` or ``client``).
        url: a "redis://", "rediss://" or "unix://" URL.
        prefix: the key namespace on the server. Defaults to "tensordict".
        count: the number of elements of the stack.
        stack_dim: the position of the stack dim in the batch size.
        inner_batch_size: the batch size of each element.
        device: where reads land; ``None`` for CPU tensors and no device.
        client: an existing ``redis.Redis`` (or ``redis.asyncio.Redis``, whose settings are reused).
        td_id: the store's identifier. An existing store with this id is attached
            to when count, stack dim and inner batch size agree (its metadata is
            never overwritten), and a ``ValueError`` is raised when they do not.
        cache_metadata: keep the schema in the handle (default). With ``False``,
            ``keys()`` and other metadata queries read the header from the server
            each time; data calls are validated by the server either way.
        readonly: open an existing store (``td_id`` required) for reading only.
        ttl: seconds after which the whole store expires (a new store only; see
            :meth:`expire` and :meth:`persist`). ``None``: it never expires.
        segment_bytes: target size of one segment's blob of one key (default 4
            MiB). A new store fixes its segment length (elements per segment) from
            the first keys written to it; see "Segments" in the README.
        spread: ``"segments"``: on Redis Cluster, put a new store's segments under hash tags
            of their own, so they spread over all primaries and one store may outgrow
            one node (a *spread store*; default ``False``: every segment in the header's slot,
            where each call is one atomic script). A call over several segments is then
            atomic per segment; ring calls (``extend``, ``sample``) are refused.
            See "Spread stores" in the README. Ignored on one server. ``spread=True`` with
            ``shards=0`` is an older spelling of the same; ``spread=True`` alone on a cluster
            (which once made a sharded ring) raises ``TypeError``: a replay buffer over the
            primaries is a :class:`tdstore.ShardedRing` (``tdstore.ShardedRing(count=N, url=...)``).
        shards: ``0`` or ``None`` (the only values: ``shards=K`` is a ``tdstore.ShardedRing``'s).
        **redis_kwargs: passed to ``redis.Redis`` (``password``, ``username``,
            ``ssl``...), plus ``password_provider``: a picklable callable that
            returns the password in processes this store is pickled into.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(
        self,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        url: str | None = None,
        prefix: str = "tensordict",
        count: int,
        stack_dim: int = 0,
        inner_batch_size: Sequence[int] = (),
        device: Any = None,
        client: Any = None,
        td_id: str | None = None,
        cache_metadata: bool = True,
        readonly: bool = False,
        ttl: float | None = None,
        segment_bytes: int | None = None,
        spread: bool | str = False,
        shards: int | None = None,
        _kind: str = "lazy",
        _batchless: bool = False,
        **redis_kwargs: Any,
    ) -> None:
        count, inner = _check_layout(count, stack_dim, inner_batch_size)
        ttl_ms = ttl_to_ms(ttl)
        if readonly and td_id is None:
            raise ValueError("readonly=True opens an existing store: pass its td_id")
        if "sharded" in redis_kwargs or (shards is not None and shards != 0):
            raise TypeError(
                f"{type(self).__name__}: shards= and sharded= make a sharded ring, a class of its own: "
                "tdstore.ShardedRing(count=N, url='redis+cluster://...', shards=K)"
            )
        if spread not in (False, True, "segments"):
            raise ValueError(f"spread must be False or 'segments' (a spread store's segments over a cluster's nodes), got {spread!r}")
        redis_client, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        if spread is True and shards is None and spec.cluster and _kind == "lazy":  # (a dense store's spread=True: segments)
            if owned:
                redis_client.close()
            raise TypeError(
                f"{type(self).__name__}(spread=True) on a Redis Cluster no longer makes a sharded ring: a replay buffer over "
                "the primaries is tdstore.ShardedRing(count=N, url=..., shards=K); for this class's spread store (its "
                "segments over the nodes, no ring calls) pass spread='segments'"
            )
        engine = Engine(
            spec,
            StoreKeys(prefix, td_id_or_new(td_id)),
            redis_client,
            owns_client=owned,
            readonly=readonly,
            segment_bytes=segment_bytes,
            spread=bool(spread),
        )
        dev = check_device(torch.device(device)) if device is not None else None
        stack_dim = stack_dim if stack_dim >= 0 else stack_dim + len(inner) + 1  # stored as a position, as uploads do
        wanted = Header(
            version=1,
            count=count,
            stack_dim=stack_dim,
            inner=inner,
            device=str(dev) if dev is not None else "",
            kind=_kind,
            batchless=_batchless,
        )
        existing = engine.fetch_header() if readonly else engine.create(wanted, ttl_ms=ttl_ms)
        if existing is None:  # made here: no ring write yet, so its first extend may go direct (_ring.direct_extend)
            direct_extend.learn(engine, 0)
        else:
            if existing.state != "ready":
                raise KeyError(f"the store with {engine.where()} is still being uploaded")
            if existing.kind != _kind:
                raise TypeError(f"the store with {engine.where()} is a {existing.kind!r} store, not a {_kind!r} one")
            mismatch = [
                f"{name} {got!r} != stored {have!r}"
                for name, got, have in (
                    ("count", count, existing.count),
                    ("stack_dim", stack_dim, existing.stack_dim),
                    ("inner_batch_size", inner, existing.inner),
                )
                if got != have
            ]
            if mismatch:
                raise ValueError(f"a store with {engine.where()} already exists with another layout: {'; '.join(mismatch)}")
            engine.set_header(existing)
            if dev is None and existing.device:
                dev = torch.device(existing.device) if usable_device(existing.device) else None
        self._init_handle(engine, backend=backend, device=dev, cache_metadata=cache_metadata)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_store(
        cls,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        url: str | None = None,
        prefix: str = "tensordict",
        td_id: str,
        device: Any = None,
        client: Any = None,
        cache_metadata: bool = True,
        readonly: bool = False,
        spread: bool = False,
        shards: int | None = None,
        min_replicas: int = 0,
        **redis_kwargs: Any,
    ) -> LazyStackedTensorDictStore:
        """Reconnect to an existing store in one round trip; never writes.

        ``spread`` and ``shards`` are ignored (the store says what it is). A sharded ring's id raises
        ``TypeError`` naming its opener, ``tdstore.ShardedRing.from_store`` (``min_replicas`` is for it:
        other stores refuse it).

        Count, stack dim, inner batch size and device are read from the server.
        An unknown ``td_id`` raises ``KeyError("No TensorDictStore with td_id=...")`` naming the prefix and the server.
        ``readonly=True`` gives a handle that refuses every write with
        ``PermissionError`` before sending anything (a learner that must not write
        by mistake); it only needs read commands and ``EVALSHA`` on the server.
        """
        redis_client, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        engine = Engine(spec, StoreKeys(prefix, td_id), redis_client, owns_client=owned, readonly=readonly)
        engine.set_header(fetch_existing(engine))
        if min_replicas:
            engine.close()
            raise ValueError(
                f"min_replicas={min_replicas!r}: the store with {engine.where()} is not a sharded ring (tdstore.ShardedRing), "
                "the one kind of store whose writes wait for replicas"
            )
        if engine.header.kind != "lazy":
            raise TypeError(f"the store with {engine.where()} is a {engine.header.kind!r} store, not a lazy stack")
        return cls._from_engine(engine, backend=backend, device=device, cache_metadata=cache_metadata)

    @classmethod
    def from_lazy_stack(
        cls,
        lazy_td: TensorDictBase,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        url: str | None = None,
        prefix: str = "tensordict",
        device: Any = None,
        client: Any = None,
        td_id: str | None = None,
        cache_metadata: bool = True,
        pbar: bool = False,
        chunk_elements: int = 10_000,
        chunk_bytes: int = 64 << 20,
        ttl: float | None = None,
        segment_bytes: int | None = None,
        spread: bool | str = False,
        **redis_kwargs: Any,
    ) -> LazyStackedTensorDictStore:
        """Upload a lazy stack (or any tensordict with a batch dim) as a new store.

        The upload streams in chunks of at most ``chunk_elements`` elements and
        ``chunk_bytes`` bytes per round trip, holding about ``chunk_bytes`` of
        gathered data at most (never the whole stack when it is larger).  The store becomes visible to readers only when the upload is
        complete; a failed upload deletes what it wrote, and an uploader that
        dies leaves keys that expire by themselves.  Every element must hold the
        same keys with one dtype per key, checked before anything is written.
        ``pbar=True`` shows a tqdm progress bar when tqdm is installed.
        ``ttl`` (seconds) makes the whole store expire that long after the upload.
        ``segment_bytes`` is the target size of one segment's blob of one key
        (default 4 MiB, see "Segments" in the README): the stack is cut into
        ranges of elements that each fit it. ``spread="segments"`` (or ``True``) spreads the segments
        over the nodes of a Redis Cluster (see the constructor).
        """
        from tdstore._front.upload import upload

        ttl_ms = ttl_to_ms(ttl)
        redis_client, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        engine = Engine(
            spec, StoreKeys(prefix, td_id_or_new(td_id)), redis_client, owns_client=owned, segment_bytes=segment_bytes, spread=bool(spread)
        )
        upload(engine, lazy_td, device=device, pbar=pbar, chunk_elements=chunk_elements, chunk_bytes=chunk_bytes, ttl_ms=ttl_ms)
        return cls._from_engine(engine, backend=backend, device=device, cache_metadata=cache_metadata)

    @classmethod
    def from_dict(cls, *args: Any, **kwargs: Any) -> Any:
        """Not supported: a dict has no stack structure. Use :meth:`from_lazy_stack`."""
        raise NotImplementedError(
            f"{cls.__name__}.from_dict is not supported; build a lazy stack and call {cls.__name__}.from_lazy_stack(...)"
        )

    # -- device and repr (identity and schema: ``_front.identity.StoreIdentity``) ---------------------
    @property
    def device(self) -> torch.device | None:
        return self._device

    @device.setter
    def device(self, value: Any) -> None:
        self._device = check_device(torch.device(value) if value is not None else None)

    def __repr__(self) -> str:
        try:
            keys = list(self.keys(include_nested=True, leaves_only=True))
        except Exception as err:  # the repr must not raise, e.g. for a deleted store
            keys = [f"<unavailable: {type(err).__name__}>"]
        return (
            f"{type(self).__name__}(keys={keys}, batch_size={self._batch_size}, count={self._count}, "
            f"stack_dim={self._stack_dim}, device={self._device}, backend={self._backend!r}, td_id={self.td_id!r})"
        )

    # -- views -------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
            return nontensor.content(self._read_key(as_path(index), NO_DEFAULT))
        if index is Ellipsis or (isinstance(index, tuple) and not index):
            return self
        element = self._element_of(index)
        if element is not None:
            return ElementView(self, element)
        return self._read_index(index)

    __getitems__ = __getitem__

    def unbind(self, dim: int) -> tuple[TensorDictBase, ...]:
        """Along the stack dim: write-through views of every element (as a lazy stack gives its members); other dims: local copies."""
        nd = len(self._batch_size)
        if not -nd <= dim < nd:
            raise IndexError(f"dim {dim} is out of range for a batch size of {nd} dims")
        if dim % nd == self._engine.header.stack_pos:
            return tuple(ElementView(self, e) for e in range(self._count))
        return self.to_tensordict().unbind(dim)

    @classmethod
    def stack_of(cls, store: Any) -> LazyStackedTensorDictStore:
        """The lazy store under ``store``, with no round trip: ``store`` itself, the stack a dense
        ``TensorDictStore`` is kept as (a handle on the same server keys, whose header says dense:
        :attr:`kept_as_dense`), or the store a tensorclass read from a store wraps. What an adapter
        (``tdstore.torchrl``, checkpoints) works on whatever kind of store it was given. ``TypeError``
        for anything else (a sharded ring is rings, not one stack)."""
        seen = store
        for attr in ("_tensordict", "_store"):  # a tensorclass's tensordict, a dense store's stack
            if not isinstance(seen, cls):
                seen = getattr(seen, attr, seen)
        if not isinstance(seen, cls):
            raise TypeError(f"expected a tdstore store (lazy, dense, or a tensorclass on one), got {type(store).__name__}")
        return seen

    @property
    def kept_as_dense(self) -> bool:
        """Whether this is the stack a dense ``TensorDictStore`` is kept as (``TensorDictStore.dense_rows``
        gives its rows as the dense store does), from the header this handle holds: no round trip."""
        return self._engine.header.kind == "dense"

    def key_specs(self, *, fresh: bool = False) -> dict[NestedPath, KeySpec]:
        """Each leaf key's dtype, element shape (None when it varies per element) and JSON-ness, by path, from
        the schema this handle holds (no round trip); ``fresh`` reads the server's first (one round trip: keys
        another process wrote first). What an adapter checks a patch against before sending it."""
        if fresh:
            self._engine.set_header(self._engine.fetch_header())
        return key_specs_of(self._engine.header)

    @property
    def stack_ops(self) -> LazyStackAccess:
        """Internal: the reads and writes this store's views run on it (see :class:`~tdstore._front.common.StackAccess`)."""
        return LazyStackAccess(self)

    def __reduce__(self) -> Any:
        # a method of the class (pickled as ``getattr(tdstore.LazyStackedTensorDictStore, "_restore")``): a pickle
        # names only the public class, so moving this module breaks none
        return (type(self)._restore, (self.__getstate__(),))

    @classmethod
    def _restore(cls, state: dict[str, Any]) -> LazyStackedTensorDictStore:
        obj = cls.__new__(cls)
        obj.__setstate__(state)
        return obj

    @classmethod
    def _element_view(cls, store: LazyStackedTensorDictStore, element: int, under: NestedPath) -> ElementView:
        """An element view as a pickle names it (``ElementView.__reduce__``): through the public class."""
        return ElementView(store, element, under)


def _restore(cls: type[LazyStackedTensorDictStore], state: dict[str, Any]) -> LazyStackedTensorDictStore:
    """What pickles made before ``LazyStackedTensorDictStore._restore`` name (``tdstore.lazy._restore``)."""
    return cls._restore(state)


def attach(engine: Engine, *, backend: str = "redis", device: Any = None, cache_metadata: bool = True) -> LazyStackedTensorDictStore:
    """A handle on the store ``engine`` names (its header set): how the dense store opens the stack it is kept as."""
    return LazyStackedTensorDictStore._from_engine(engine, backend=backend, device=device, cache_metadata=cache_metadata)


class LazyStackAccess:
    """The :class:`~tdstore._front.common.StackAccess` of a lazy store: its own reads and writes, for the views of it."""

    def __init__(self, store: LazyStackedTensorDictStore) -> None:
        self._store = store

    @property
    def engine(self) -> Engine:
        return self._store._engine

    @property
    def backend(self) -> str:
        return self._store._backend

    @property
    def cache_metadata(self) -> bool:
        return self._store._cache_metadata

    def read(self, index: Any, paths: list[NestedPath] | None = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        return self._store._read_index(index, paths, under=under, strip=strip)

    def allocate(self, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self._store._allocate(specs)

    def delete_keys(self, keys: Sequence[Any], *, missing_ok: bool = True) -> None:
        self._store._delete_keys(keys, missing_ok=missing_ok)

    def rename_key(self, old_key: Any, new_key: Any) -> None:
        self._store._rename_key(old_key, new_key)
