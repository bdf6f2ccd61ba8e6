"""``TensorDictStore``: a dense tensordict whose entries live on the server.

A dense tensordict of batch size ``[n, *rest]`` is stored exactly as a stack of
``n`` elements of inner batch size ``rest`` whose keys are all homogeneous: the same
header, scripts, versioning and planning as a
:class:`~tdstore.LazyStackedTensorDictStore`, with no second copy of the storage
logic.  ``store["obs"]`` is one blob, ``store[idx]`` reads only the rows ``idx``
touches, a non-tensor value of row ``i`` is its own JSON document, and every read
and write stays one atomic script call.  A batch size of ``[]`` is a stack of one
element whose stack dim the class hides (the header says ``batchless``).  The
header says ``type: dense``, so a lazy handle never opens a dense store by
mistake, nor the other way round.  The first dim is also a ring (``extend``,
``sample``, priorities, limiter, queue, leases: ``_ring.dense_methods``), the lazy store's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._engine import whole_store
from tdstore._engine.connection import open_client
from tdstore._engine.engine import Engine, new_td_id, td_id_or_new
from tdstore._format import nontensor
from tdstore._format.codec import dtype_name
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import Header, NestedPath
from tdstore._front.common import LOCK_ERROR, StackStore, fetch_existing, ttl_to_ms
from tdstore._front.key_changes import check_allocation
from tdstore._front.stack_view import StackView
from tdstore._plan.index import normalize
from tdstore._plan.values import as_path, display
from tdstore._ring.dense_methods import DenseRing
from tdstore.lazy import LazyStackedTensorDictStore, attach


def _check_batch_size(batch_size: Any) -> torch.Size:
    if batch_size is None:
        return torch.Size(())
    try:
        bs = torch.Size([int(b) for b in batch_size])
    except (TypeError, ValueError):
        raise TypeError(f"batch_size must be a sequence of ints, got {batch_size!r}") from None
    if any(b < 0 for b in bs):
        raise ValueError(f"batch_size must hold non-negative sizes, got {list(bs)}")
    return bs


def _dense_values(items: dict[NestedPath, Any], batchless: bool) -> dict[NestedPath, Any]:
    """Values as the underlying stack holds them: one tensor per key (a leading dim of 1 when batchless)."""
    out = {}
    for path, value in items.items():
        if isinstance(value, list):
            raise TypeError(
                f"key {display(path)!r} differs in shape across the lazy stack it comes from; a dense store holds one shape per key"
            )
        out[path] = value.unsqueeze(0) if batchless and isinstance(value, torch.Tensor) else value
    return out


class TensorDictStore(DenseRing, StackView):
    """A dense tensordict (any batch size, ``[]`` included) whose entries live on a Redis-compatible server.

    Every read and write is one atomic script call, as for the lazy store:
    ``store["obs"]`` reads a whole entry, ``store[idx]`` (ints, slices, steps,
    index tensors, lists, masks) reads only the touched rows of every entry into
    a local :class:`~tensordict.TensorDict`, ``store[idx] = td`` writes them,
    ``store["nested"]`` is a write-through view of a sub-tree, and entries can be
    added, replaced (another dtype or shape), deleted and renamed at any time.
    A store of batch size ``[N, *rest]`` is also a shared ring buffer of ``N`` rows,
    exactly as a lazy store of ``N`` elements is (``extend``, ``sample``, ``pop``,
    priorities, rate limits, queues: see :class:`~tdstore.LazyStackedTensorDictStore`),
    whose batches come back as dense TensorDicts.

    Keyword Args:
        batch_size: the batch size of the store (default ``[]``).
        backend, host, port, db, unix_socket_path, url, prefix, device, client,
        td_id, cache_metadata, readonly, ttl, **redis_kwargs: as for
        :class:`~tdstore.LazyStackedTensorDictStore`.  An existing ``td_id`` is
        attached to when its batch size agrees (``ValueError`` when it does not).
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
        batch_size: Sequence[int] | torch.Size | None = None,
        device: Any = None,
        client: Any = None,
        td_id: str | None = None,
        cache_metadata: bool = True,
        readonly: bool = False,
        ttl: float | None = None,
        **redis_kwargs: Any,
    ) -> None:
        bs = _check_batch_size(batch_size)
        if bs and bs[0] == 0:
            raise ValueError(f"batch_size {list(bs)}: a store needs at least one row along its first dim")
        try:
            store = LazyStackedTensorDictStore(
                backend=backend, host=host, port=port, db=db, unix_socket_path=unix_socket_path, url=url, prefix=prefix,
                count=bs[0] if bs else 1, inner_batch_size=bs[1:], device=device, client=client, td_id=td_id,
                cache_metadata=cache_metadata, readonly=readonly, ttl=ttl, _kind="dense", _batchless=not bs, **redis_kwargs,
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(
                f"{err} (a dense store of batch size {list(bs)} is kept as count {bs[0] if bs else 1}, inner batch size {list(bs[1:])})"
            ) from None
        self._init_view(store, ())

    def _init_view(self, store: StackStore, under: NestedPath, locked: bool = False) -> None:
        header = store.stack_ops.engine.header
        self._batchless = header.batchless
        # a sub-tree view has the store's batch dims and the sub-tree's own extra ones (chat-style [5, 1])
        batch_size = torch.Size((*(() if self._batchless else store.batch_size), *header.subtree_dims(under)))
        # fills cover element 0 of a batchless store, or the whole store
        StackView.__init__(self, store, 0 if self._batchless else None, under, batch_size)
        if locked:
            self.lock_()

    _whole_stack = True  # writes cover every row (a batchless store: its one element)

    def _stack_index(self, index: Any = None) -> tuple:
        """The index of the underlying stack: the same index, or element 0 and nothing else when batchless."""
        if self._batchless:
            return (0, *normalize(index, torch.Size([]))) if index is not None else (0,)
        if index is None:
            return tuple(slice(0, n, 1) for n in self._ops.engine.header.batch_size)
        return index if isinstance(index, tuple) else (index,)

    def _read(self, paths: list[NestedPath] | None, index: Any = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        store_dims = 0 if self._batchless else len(self._store.batch_size)
        if strip and index is not None and len(self._batch_size) > store_dims and _reaches_subtree_dims(index, store_dims):
            # the index reaches a sub-tree's own batch dims, which the server does not index: read
            # the store's rows in one call and index the rest locally
            return self._read(paths, None, under, strip)[index]
        out = self._ops.read(self._stack_index(index), paths, under=under, strip=strip)
        if isinstance(out, LazyStackedTensorDict):
            # non-tensor keys come back per row: stacked densely, as in a TensorDict, and one
            # value repeated over the rows as one NonTensorData (what TensorDict.set(key, value) holds)
            out = nontensor.collapse(torch.stack(list(out.tensordicts), out.stack_dim))
        return out

    @classmethod
    def _open_view(cls, store: StackStore, under: NestedPath = (), locked: bool = False) -> TensorDictStore:
        self = cls.__new__(cls)
        self._init_view(store, under, locked)
        return self

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_tensordict(
        cls, td: Any, *, pbar: bool = False, ttl: float | None = None, device: Any = None, td_id: str | None = None, **kwargs: Any
    ) -> Any:
        """Upload ``td`` as a new store; a lazy stack becomes a :class:`LazyStackedTensorDictStore`.

        A tensorclass instance is uploaded as its tensordict and its class's dotted
        path is kept (``store.tensorclass_path``, ``store._tensorclass_cls``); the
        store itself is returned, as ``tensordict.store`` does, and
        :meth:`from_store` gives the class back.  The store appears on the server
        only when the upload is complete (one atomic commit), as for lazy uploads.
        """
        from tdstore._format import tensorclass
        from tdstore._front.upload import upload

        tc_name = tensorclass.name_of(td)
        if is_tensorclass(td):
            td = td._tensordict
        if isinstance(td, LazyStackedTensorDict):
            return LazyStackedTensorDictStore.from_lazy_stack(td, pbar=pbar, ttl=ttl, device=device, td_id=td_id, **kwargs)
        if isinstance(td, TensorDictStore):
            td = td.to_tensordict()
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"from_tensordict expects a tensordict or a tensorclass, got {type(td).__name__}")
        if td.batch_size and td.batch_size[0] == 0:
            raise ValueError(f"batch_size {list(td.batch_size)}: a store needs at least one row along its first dim")
        redis_client, spec, owned = open_client(**_connection_kwargs(kwargs))
        engine = Engine(
            spec,
            StoreKeys(kwargs.get("prefix", "tensordict"), td_id_or_new(td_id)),
            redis_client,
            owns_client=owned,
            segment_bytes=kwargs.get("segment_bytes"),
            spread=kwargs.get("spread", False),
        )
        batchless = not td.batch_size
        upload(
            engine, lazy_stack([td]) if batchless else td, device=device, pbar=pbar, chunk_elements=10_000, chunk_bytes=64 << 20,
            ttl_ms=ttl_to_ms(ttl), kind="dense", tensorclass=tc_name, batchless=batchless,
        )  # fmt: skip
        store = attach(engine, backend=kwargs.get("backend", "redis"), device=device, cache_metadata=kwargs.get("cache_metadata", True))
        return cls._open_view(store)

    @classmethod
    def from_dict(
        cls,
        input_dict: Any,
        *,
        batch_size: Any = None,
        auto_batch_size: bool | None = False,
        batch_dims: int | None = None,
        device: Any = None,
        **kwargs: Any,
    ) -> TensorDictStore:
        """A new store holding the entries of a dict (nested dicts become nested keys), uploaded in one commit."""
        if isinstance(input_dict, TensorDictBase):
            td = input_dict
        else:
            td = TensorDict.from_dict(input_dict, batch_size=batch_size, auto_batch_size=auto_batch_size, batch_dims=batch_dims)
        return cls.from_tensordict(td, device=device, **kwargs)

    @classmethod
    def from_schema(
        cls, schema: Mapping[Any, tuple[Sequence[int], torch.dtype]], *, batch_size: Any = None, **kwargs: Any
    ) -> TensorDictStore:
        """A new store with zero-filled entries of the given feature shapes and dtypes, allocated by the server.

        ``schema`` maps each key (a str or a tuple for a nested key) to
        ``(feature_shape, dtype)``; the entry has shape ``[*batch_size, *feature_shape]``.
        No data is built in local memory or sent: one atomic call makes the server
        allocate every entry as zero bytes.  Everything is checked before the store is
        created (each key, its sizes and ``torch.dtype``, and that the store fits the
        server's limits), so a refused schema leaves nothing on the server.
        """
        specs = schema_specs(schema)
        bs = _check_batch_size(batch_size)
        if bs and bs[0] == 0:
            raise ValueError(f"batch_size {list(bs)}: a store needs at least one row along its first dim")
        kwargs["td_id"] = td_id_or_new(kwargs.get("td_id"))  # (the id a refusal names is the store's)
        _check_schema_fits(specs, bs, kwargs)
        store = cls(batch_size=batch_size, **kwargs)
        store._store.stack_ops.allocate(specs)
        return store

    @classmethod
    def from_store(
        cls,
        *,
        td_id: str,
        tensorclass_cls: type | str | None = None,
        backend: str = "redis",
        device: Any = None,
        cache_metadata: bool = True,
        readonly: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Reconnect to a store by ``td_id`` (one read-only round trip).

        A lazy store comes back as a :class:`LazyStackedTensorDictStore`.  A store
        uploaded from a tensorclass comes back as an instance of the class wrapping
        the store (attribute writes reach the server) when the class can be had
        without importing anything the server names: ``tensorclass_cls`` (the class,
        or its dotted path, which is imported: the caller chose it), a class
        registered with :func:`tdstore.register_tensorclass`, or a class whose module
        is already imported.  Otherwise the plain store comes back, with a warning
        naming the class path and how to pass it.  An unknown ``td_id`` raises
        ``KeyError("No TensorDictStore with td_id=...")`` naming the prefix and server.
        """
        from tdstore._format import tensorclass

        redis_client, spec, owned = open_client(**_connection_kwargs(kwargs))
        engine = Engine(spec, StoreKeys(kwargs.get("prefix", "tensordict"), td_id), redis_client, owns_client=owned, readonly=readonly)
        engine.set_header(fetch_existing(engine))
        store = attach(engine, backend=backend, device=device, cache_metadata=cache_metadata)
        if engine.header.kind == "lazy":
            return tensorclass.wrap(store, engine.header.tensorclass, tensorclass_cls)
        if engine.header.kind != "dense":
            raise TypeError(f"the store with {engine.where()} is a {engine.header.kind!r} store")
        return tensorclass.wrap(cls._open_view(store), engine.header.tensorclass, tensorclass_cls)

    # -- device, repr (identity and schema: ``_front.identity.StoreIdentity``) ----------------------
    @property
    def _backend(self) -> str:
        return self._ops.backend

    @property
    def device(self) -> torch.device | None:
        return self._store.device

    @device.setter
    def device(self, value: Any) -> None:
        self._store.device = value
        self._device = self._store.device

    def _subtree_class(self, het: bool) -> type:
        """A nested key reads as a sub-tree view: the store's own class."""
        return type(self)

    def __getitem__(self, index: Any) -> Any:
        # store[:] (a full slice of every batch dim) is the store itself, written through, as in
        # tensordict.store (torchrl's ReplayBuffer.set_/set_at_ write into it); store[:][key] reads one key
        if self._batch_size and (
            index == slice(None)
            if isinstance(index, slice)
            else isinstance(index, tuple)
            and 0 < len(index) <= len(self._batch_size)
            and all(isinstance(i, slice) and i == slice(None) for i in index)
        ):
            return self
        return super().__getitem__(index)

    def __repr__(self) -> str:
        try:
            keys = list(self.keys(include_nested=True, leaves_only=True))
        except Exception as err:  # the repr must not raise, e.g. for a deleted store
            keys = [f"<unavailable: {type(err).__name__}>"]
        where = f", under={display(self._under)!r}" if self._under else ""
        return (
            f"TensorDictStore(keys={keys}, batch_size={self._batch_size}, device={self.device}, "
            f"backend={self._backend!r}, td_id={self.td_id!r}{where})"
        )

    # -- reads -------------------------------------------------------------------------------
    def _subtree_view(self, path: NestedPath) -> TensorDictBase:
        """A nested key is a write-through view of that sub-tree, locked when the store is."""
        return type(self)._open_view(self._store, path, self.is_locked)

    def _clone(self, recurse: bool = True, pbar: bool = False) -> TensorDictBase:
        """``clone()`` copies the store into a new td_id on the server (one atomic call); ``clone(False)`` is another handle on it.

        A view of a nested key (``store["nested"]``) clones into a local
        TensorDict, as it is not a store of its own.
        """
        if not recurse:
            return type(self)._open_view(self._store, self._under)
        if self._under:
            return self.to_tensordict()
        src, ops = self._store, self._ops
        if ops.engine.spec.cluster:
            # the copy's hash tag may map to another node, which one script cannot reach:
            # read it whole (one atomic call) and upload it (one atomic commit)
            return type(self).from_tensordict(
                self.to_tensordict(),
                client=ops.engine.client,
                prefix=src.prefix,
                backend=ops.backend,
                device=src.device,
                segment_bytes=ops.engine.segment_bytes,
                spread=ops.engine.header.spread,
            )
        keys = StoreKeys(src.prefix, new_td_id())
        header = whole_store.copy_to(ops.engine, keys)
        engine = Engine(ops.engine.spec, keys, ops.engine.client, owns_client=False)
        engine.set_header(header)
        return type(self)._open_view(attach(engine, backend=ops.backend, device=src.device, cache_metadata=ops.cache_metadata))

    # -- writes (``_front.write_surface.WriteSurface``): whole entries are one tensor per key
    def _stack_values(self, items: dict[NestedPath, Any], whole: bool) -> dict[NestedPath, Any]:
        return _dense_values(items, self._batchless and whole)

    def _del(self, key: tuple) -> None:
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        self._ops.delete_keys([self._under + as_path(key)], missing_ok=False)

    def _delete_keys(self, keys: Sequence[Any]) -> TensorDictStore:
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        self._ops.delete_keys([self._under + as_path(k) for k in keys])
        return self

    def unbind(self, dim: int) -> tuple[TensorDictBase, ...]:
        """Local copies of the slices along ``dim`` (read in one call)."""
        return self.to_tensordict().unbind(dim)

    def _rename_key(self, old_key: Any, new_key: Any) -> None:
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        self._ops.rename_key(self._under + as_path(old_key), self._under + as_path(new_key))

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; the data stays on the server (see :meth:`clear_redis`)."""
        self._store.close()

    def clear_redis(self) -> int:
        """Delete every key of this store, and nothing else, in one atomic call."""
        return self._store.clear_redis()

    def expire(self, seconds: float) -> None:
        """Make the whole store expire in ``seconds`` (see :meth:`LazyStackedTensorDictStore.expire`)."""
        self._store.expire(seconds)

    def persist(self) -> None:
        """Remove the store's time to live."""
        self._store.persist()

    def ttl(self) -> float | None:
        """Seconds left before the store expires, or ``None``."""
        return self._store.ttl()

    def __enter__(self) -> TensorDictStore:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
        self.close()
        return False

    def __reduce__(self) -> Any:
        return (TensorDictStore._open_view, (self._store, self._under, self.is_locked))


def _reaches_subtree_dims(index: Any, store_dims: int) -> bool:
    """Whether ``index`` indexes dims past the store's first ``store_dims`` (or uses ``...``/``None``)."""
    if isinstance(index, tuple):
        if any(i is Ellipsis or i is None for i in index):
            return True
        return sum(i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in index) > store_dims
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        return index.ndim > store_dims
    return index is Ellipsis or index is None


def _connection_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``open_client`` arguments among a constructor's keyword arguments (the rest go to redis-py)."""
    known = {"url": None, "host": "localhost", "port": 6379, "db": 0, "unix_socket_path": None, "client": None}
    out = {k: kwargs.get(k, v) for k, v in known.items()}
    skip = set(known) | {"prefix", "backend", "cache_metadata", "readonly", "segment_bytes", "spread"}
    out["redis_kwargs"] = {k: v for k, v in kwargs.items() if k not in skip}
    return out


def schema_specs(schema: Any) -> dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]:
    """``from_schema``'s ``schema`` as ``{path: (feature_shape, dtype)}``, every entry checked: a key, a
    feature shape of ints >= 0 and a ``torch.dtype`` tdstore stores (``TypeError`` / ``ValueError`` naming it)."""
    if not isinstance(schema, Mapping):
        raise TypeError(f"schema must be a mapping of key -> (feature_shape, dtype), got {type(schema).__name__}")
    specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, spec in schema.items():
        path = as_path(key)
        try:
            shape, dtype = spec
            sizes = list(shape)
        except (TypeError, ValueError):
            raise TypeError(f"schema entry {key!r} must be (feature_shape, dtype), got {spec!r}") from None
        if any(isinstance(n, bool) or not hasattr(n, "__index__") for n in sizes):
            raise TypeError(f"schema entry {key!r}: the feature shape must hold ints, got {shape!r}")
        feat = tuple(n.__index__() for n in sizes)
        if any(n < 0 for n in feat):
            raise ValueError(f"schema entry {key!r}: negative size in {list(feat)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"schema entry {key!r}: {dtype!r} is not a torch.dtype (e.g. torch.float32)")
        dtype_name(dtype)  # one tdstore stores (TypeError listing them)
        if path in specs:
            raise ValueError(f"schema names key {display(path)!r} twice")
        specs[path] = (feat, dtype)
    return specs


#: A constructor's keyword arguments that are neither where the server is nor redis-py's.
_STORE_ONLY = ("td_id", "device", "ttl", "shards")


def _check_schema_fits(specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]], bs: torch.Size, kwargs: dict[str, Any]) -> None:
    """Refuse, before the store is created, keys ``specs`` that a new store of batch size ``bs`` on the server
    ``kwargs`` name could not hold (``_front.key_changes.check_allocation``: its maxmemory, segment count and
    string size). Reads the server's limits (once per server and process)."""
    redis_client, spec, owned = open_client(**_connection_kwargs({k: v for k, v in kwargs.items() if k not in _STORE_ONLY}))
    engine = Engine(
        spec,
        StoreKeys(kwargs.get("prefix", "tensordict"), kwargs["td_id"]),
        redis_client,
        owns_client=owned,
        segment_bytes=kwargs.get("segment_bytes"),
        spread=bool(kwargs.get("spread", False)),
    )
    try:
        header = Header(version=1, count=bs[0] if bs else 1, stack_dim=0, inner=tuple(bs[1:]), device="", kind="dense", batchless=not bs)
        check_allocation(engine, header, specs)
    finally:
        engine.close()
