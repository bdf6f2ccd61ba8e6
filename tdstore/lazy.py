"""``LazyStackedTensorDictStore``: a lazy stack of tensordicts that lives on a Redis-wire server."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensorclass, lazy_stack
from tensordict.base import NO_DEFAULT

from . import _index, _nontensor, _ragged, _ring, _writes
from ._common import LOCK_ERROR, KeysView, StoreCommon, fetch_existing, only_keys, ttl_to_ms
from ._connection import open_client
from ._engine import Engine, new_td_id
from ._keys import StoreKeys
from ._progress import progress
from ._replay import ReplayMethods
from ._sampling import PrioritizedSample
from ._schema import Header, Leaf, NestedPath, check_paths
from ._surface import SurfaceMixin
from ._unsupported import StoreUnsupported
from ._values import as_path, assemble, check_device, display, gc_paused, leaves_of, subtree_dims, usable_device


class LazyStackedTensorDictStore(StoreCommon, ReplayMethods, SurfaceMixin, StoreUnsupported, TensorDictBase):
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
        spread: on Redis Cluster, put a new store's segments under hash tags of
            their own, so they spread over all primaries and one store may outgrow
            one node (default ``False``: every segment in the header's slot, where
            each call is one atomic script). A call over several segments is then
            atomic per segment; ring calls (``extend``, ``sample``) are refused.
            See "Spread stores" in the README. Ignored on one server.
        **redis_kwargs: passed to ``redis.Redis`` (``password``, ``username``,
            ``ssl``...), plus ``password_provider``: a picklable callable that
            returns the password in processes this store is pickled into.
    """

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
        spread: bool = False,
        _kind: str = "lazy",
        _batchless: bool = False,
        **redis_kwargs: Any,
    ) -> None:
        count, inner = _check_layout(count, stack_dim, inner_batch_size)
        ttl_ms = ttl_to_ms(ttl)
        if readonly and td_id is None:
            raise ValueError("readonly=True opens an existing store: pass its td_id")
        redis_client, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        engine = Engine(
            spec,
            StoreKeys(prefix, td_id or new_td_id()),
            redis_client,
            owns_client=owned,
            readonly=readonly,
            segment_bytes=segment_bytes,
            spread=spread,
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
        if existing is not None:
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

    # -- construction helpers ------------------------------------------------------
    def _init_handle(self, engine: Engine, *, backend: str, device: torch.device | None, cache_metadata: bool) -> None:
        h = engine.header
        engine.limits  # noqa: B018  (read once per server and process: warns when the server may evict a store's keys)
        self._engine = engine
        self._backend = backend
        self._device = device
        self._cache_metadata = cache_metadata
        self._count = h.count
        self._stack_dim = h.stack_dim
        self._inner_batch_size = torch.Size(h.inner)
        self._batch_size = h.batch_size
        self._is_locked = False
        self._lock_id = set()
        self._locked_tensordicts = []
        self._is_shared = False
        self._is_memmap = False
        self._last_op = None

    @classmethod
    def _from_engine(
        cls, engine: Engine, *, backend: str = "redis", device: Any = None, cache_metadata: bool = True
    ) -> LazyStackedTensorDictStore:
        self = cls.__new__(cls)
        h = engine.header
        # a device the caller names must exist here; the store's own (written where it was made) is used when it does
        dev = (
            check_device(torch.device(device))
            if device is not None
            else (torch.device(h.device) if h.device and usable_device(h.device) else None)
        )
        self._init_handle(engine, backend=backend, device=dev, cache_metadata=cache_metadata)
        return self

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
        **redis_kwargs: Any,
    ) -> LazyStackedTensorDictStore:
        """Reconnect to an existing store in one round trip; never writes.

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
        spread: bool = False,
        **redis_kwargs: Any,
    ) -> LazyStackedTensorDictStore:
        """Upload a lazy stack (or any tensordict with a batch dim) as a new store.

        The upload streams in chunks of at most ``chunk_elements`` elements and
        ``chunk_bytes`` bytes per round trip, never building the whole stack in
        memory.  The store becomes visible to readers only when the upload is
        complete; a failed upload deletes what it wrote, and an uploader that
        dies leaves keys that expire by themselves.  Every element must hold the
        same keys with one dtype per key, checked before anything is written.
        ``pbar=True`` shows a tqdm progress bar when tqdm is installed.
        ``ttl`` (seconds) makes the whole store expire that long after the upload.
        ``segment_bytes`` is the target size of one segment's blob of one key
        (default 4 MiB, see "Segments" in the README): the stack is cut into
        ranges of elements that each fit it. ``spread=True`` spreads the segments
        over the nodes of a Redis Cluster (see the constructor).
        """
        from ._upload import upload

        ttl_ms = ttl_to_ms(ttl)
        redis_client, spec, owned = open_client(
            url=url, host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs
        )
        engine = Engine(
            spec, StoreKeys(prefix, td_id or new_td_id()), redis_client, owns_client=owned, segment_bytes=segment_bytes, spread=spread
        )
        upload(engine, lazy_td, device=device, pbar=pbar, chunk_elements=chunk_elements, chunk_bytes=chunk_bytes, ttl_ms=ttl_ms)
        return cls._from_engine(engine, backend=backend, device=device, cache_metadata=cache_metadata)

    @classmethod
    def from_dict(cls, *args: Any, **kwargs: Any) -> Any:
        """Not supported: a dict has no stack structure. Use :meth:`from_lazy_stack`."""
        raise NotImplementedError(
            f"{cls.__name__}.from_dict is not supported; build a lazy stack and call {cls.__name__}.from_lazy_stack(...)"
        )

    # -- identity and metadata -----------------------------------------------------------
    @property
    def td_id(self) -> str:
        """The identifier of the store on the server (read-only)."""
        return self._engine.keys.td_id

    @property
    def _td_id(self) -> str:
        return self._engine.keys.td_id

    @property
    def prefix(self) -> str:
        return self._engine.keys.prefix

    @property
    def readonly(self) -> bool:
        """Whether this handle refuses writes (``readonly=True``)."""
        return self._engine.readonly

    @property
    def _header(self) -> Header:
        if not self._cache_metadata:
            self._engine.set_header(self._engine.fetch_header())
        return self._engine.header

    @property
    def _meta_cache(self) -> dict[str, tuple[list[int] | None, torch.dtype]] | None:
        """The cached schema as ``tensordict.store`` keeps it: ``{"dotted.key.path": (full shape, dtype)}``.

        The full shape is a list with the stack's batch dims, ``None`` for a
        heterogeneous key; ``None`` as a whole when the handle keeps no metadata
        (``cache_metadata=False``).
        """
        if not self._cache_metadata:
            return None
        h = self._engine.header
        sp = h.stack_pos
        return {
            ".".join(p): ([*leaf.shape[:sp], h.count, *leaf.shape[sp:]] if leaf.shape is not None else None, leaf.dtype)
            for p, leaf in h.leaves.items()
        }

    def _full_key_path(self, key: Any) -> str:
        """The dotted path of ``key`` (as ``tensordict.store`` names keys)."""
        return ".".join(as_path(key))

    @property
    def tensorclass_path(self) -> str | None:
        """``module.QualName`` of the tensorclass the store was uploaded from, or ``None`` (a name only: never imported)."""
        return self._engine.header.tensorclass or None

    @property
    def _tensorclass_cls(self) -> str | None:
        """The ``tensordict.store`` name of :attr:`tensorclass_path`."""
        return self.tensorclass_path

    def _paths(self) -> list[NestedPath]:
        h = self._header
        return [leaf.path for leaf in sorted(h.leaves.values(), key=lambda leaf: leaf.number)]

    @property
    def device(self) -> torch.device | None:
        return self._device

    @device.setter
    def device(self, value: Any) -> None:
        self._device = check_device(torch.device(value) if value is not None else None)

    def keys(self, include_nested: bool = False, leaves_only: bool = False, is_leaf: Any = None, *, sort: bool = False) -> KeysView:  # type: ignore[override]
        return KeysView(self._paths, (), include_nested, leaves_only, sort)

    def __len__(self) -> int:
        return self._batch_size[0] if len(self._batch_size) else 0

    def entry_class(self, key: Any) -> type:
        path = as_path(key)
        h = self._header
        if path in h.leaves:
            return torch.Tensor
        under = [leaf for p, leaf in h.leaves.items() if p[: len(path)] == path]
        if not under:
            raise KeyError(f"key {display(path)!r} is not in the store")
        return LazyStackedTensorDict if any(leaf.het for leaf in under) else TensorDict

    def __repr__(self) -> str:
        try:
            keys = list(self.keys(include_nested=True, leaves_only=True))
        except Exception as err:  # the repr must not raise, e.g. for a deleted store
            keys = [f"<unavailable: {type(err).__name__}>"]
        return (
            f"{type(self).__name__}(keys={keys}, batch_size={self._batch_size}, count={self._count}, "
            f"stack_dim={self._stack_dim}, device={self._device}, backend={self._backend!r}, td_id={self.td_id!r})"
        )

    # -- reads ---------------------------------------------------------------------------------
    def _element_of(self, index: Any) -> int | None:
        """The element id when ``index`` picks exactly one whole element, else None."""
        h = self._engine.header
        if isinstance(index, (str, tuple)) and (isinstance(index, str) or any(isinstance(i, str) for i in index)):
            return None
        if isinstance(index, (np.integer, torch.Tensor)) and not isinstance(index, bool) and getattr(index, "ndim", 0) == 0:
            if not (
                isinstance(index, torch.Tensor) and (index.dtype in _index.MASK_DTYPES or index.is_floating_point() or index.is_complex())
            ):
                index = int(index)
        if h.stack_pos == 0 and isinstance(index, int) and not isinstance(index, bool):
            if not -h.count <= index < h.count:
                raise IndexError(f"index {index} is out of range for a store of {h.count} elements")
            return index % h.count
        if isinstance(index, tuple) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            norm = _index.normalize(index, h.batch_size)
            p = _index.plan(norm, h.batch_size, h.stack_pos)
            if p.element_int and p.inner_full:
                return int(p.elements[0])
        return None

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
            return _nontensor.content(self._read_key(as_path(index), NO_DEFAULT))
        if index is Ellipsis or (isinstance(index, tuple) and not index):
            return self
        element = self._element_of(index)
        if element is not None:
            return ElementView(self, element)
        return self._read_index(index)

    __getitems__ = __getitem__

    def _read_index(self, index: Any, paths: list[NestedPath] | None = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """Read ``paths`` (default: every leaf below ``under``) at ``index`` in one call.

        With ``strip`` the result is the sub-tree below ``under``; without it, the
        leaves keep their full paths.
        """
        # a large read makes many small objects (views, TensorDicts): with the cyclic GC paused
        # meanwhile, it does not walk every live object of the program several times over
        with gc_paused():
            plan, result = self._engine.read(index, paths, under=under)
            h = self._engine.header
            return assemble(plan, result, h.inner, self._device, under if strip else (), h.sub_dims)

    def _index_tensordict(self, index: Any, new_batch_size: Any = None, names: Any = None) -> TensorDictBase:
        return self._read_index(index)

    def _read_key(self, path: NestedPath, default: Any, **kwargs: Any) -> Any:
        h = self._header
        try:
            if path in h.leaves:
                leaf = h.leaves[path]
                if leaf.het and _ragged.wanted(kwargs):
                    fast = self._read_ragged(path, np.arange(h.count, dtype=np.int64), kwargs)
                    if fast is not None:
                        return fast
                if leaf.het or kwargs:
                    return self._get_local(self._read_index(slice(None), [path]), path, kwargs)
                plan, result = self._engine.read(slice(None), [path])
                t = result.leaves[path]  # type: ignore[union-attr]
                return t.to(self._device) if self._device is not None else t
            # a nested key: every leaf below it, as the server has them now
            return self._read_index(slice(None), None, under=path)
        except KeyError:
            if default is not NO_DEFAULT:
                return default
            raise

    def _get_str(self, key: str, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key((key,), default, **kwargs)

    def _get_tuple(self, key: tuple, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key(as_path(key), default, **kwargs)

    def _get_at_str(self, key: str, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._get_at_tuple((key,), idx, default, **kwargs)

    def _read_ragged(self, path: NestedPath, ids: np.ndarray, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """One padded or jagged tensor of elements ``ids`` (in that order) of a heterogeneous leaf, in one
        round trip and without a tensor per element (see ``_ragged``); None when the fast way does not
        apply (elements with inner batch dims or that differ beyond their first dim, a strided layout)."""
        h = self._header
        if h.inner or h.stack_pos != 0:
            return None
        raw = self._engine.read_ragged(path, ids)
        if raw is None:
            return None
        out = _ragged.build(*raw, kwargs)
        if out is not None and self._device is not None:
            out = tuple(t.to(self._device) for t in out) if isinstance(out, tuple) else out.to(self._device)
        return out

    def _get_local(self, td: TensorDictBase, path: NestedPath, kwargs: dict[str, Any]) -> Any:
        """``td.get(key, **kwargs)`` on a local read of the store, with ``return_mask`` answered for a key
        whose elements all have one shape (a padded read of it is the stacked tensor, every cell data)."""
        if not kwargs.get("return_mask"):
            return td.get(display(path), **kwargs)
        h = self._header
        leaf = h.leaves.get(path)
        if kwargs.get("as_nested_tensor") or leaf is None or leaf.het or h.inner or h.stack_pos != 0 or not leaf.shape:
            _ragged.check_mask(kwargs, display(path), scalars=leaf is not None and not leaf.het and not leaf.shape)
        out = td.get(display(path), **{k: v for k, v in kwargs.items() if k != "return_mask"})
        return out, torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)

    def _ragged_ids(self, idx: Any) -> np.ndarray | None:
        """The element ids of a one-dim index along the stack (a slice, list, index tensor or mask), in its order."""
        h = self._header
        if isinstance(idx, (int, np.integer)) or h.inner or (isinstance(idx, torch.Tensor) and idx.ndim != 1):
            return None
        norm = _index.normalize(idx, h.batch_size)
        if len(norm) != 1:
            return None
        comp = norm[0]
        if isinstance(comp, slice):
            return np.arange(*comp.indices(h.count), dtype=np.int64)
        if isinstance(comp, torch.Tensor) and comp.ndim == 1:
            return comp.numpy().astype(np.int64, copy=False)
        return None

    def _get_at_tuple(self, key: tuple, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        path = as_path(key)
        leaf = self._header.leaves.get(path)
        if leaf is not None and leaf.het and _ragged.wanted(kwargs):
            ids = self._ragged_ids(idx)
            fast = self._read_ragged(path, ids, kwargs) if ids is not None and ids.size else None
            if fast is not None:
                return fast
        if kwargs.get("return_mask") and self._ragged_ids(idx) is None:  # one element: nothing to mask
            _ragged.check_mask(kwargs, display(path))
        try:
            td = self._read_index(idx, None, under=path, strip=False)
        except KeyError:
            if default is not NO_DEFAULT:
                return default
            raise
        return self._get_local(td, path, kwargs)

    def _to_tensordict(self, *, retain_none: bool | None = None) -> TensorDictBase:
        """All of the store in one round trip: a TensorDict, or a lazy stack when elements differ."""
        return self._read_index(slice(None) if self._batch_size else ())

    def to_tensordict(self, *, retain_none: bool | None = None, pbar: bool = False, chunk_elements: int | None = None) -> TensorDictBase:
        """The whole store in local memory: a TensorDict, or a lazy stack when elements differ.

        By default this is one atomic call: a snapshot of the store at one instant.
        ``pbar=True`` shows a progress bar (tqdm) and reads instead in chunks of
        ``chunk_elements`` whole elements (default: about 16 MiB per chunk), each
        chunk one atomic call: no element is ever torn, but writers may change
        elements of later chunks while earlier ones are read.
        """
        if not pbar and chunk_elements is None:
            return self._to_tensordict(retain_none=retain_none)
        return self._read_in_chunks(pbar, chunk_elements)

    def _read_in_chunks(self, pbar: bool, chunk_elements: int | None) -> TensorDictBase:
        h = self._engine.header
        if chunk_elements is None:
            per_element = sum(leaf.element_nbytes for leaf in h.leaves.values() if not leaf.het)
            chunk_elements = max(1, (16 << 20) // max(1, per_element))
            if any(leaf.het for leaf in h.leaves.values()):
                chunk_elements = min(chunk_elements, 4096)
        if not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        sp = h.stack_pos
        parts = []
        with progress(pbar, h.count, "download") as bar:
            for lo in range(0, h.count, chunk_elements):
                hi = min(h.count, lo + chunk_elements)
                parts.append(self._read_index((slice(None),) * sp + (slice(lo, hi),)))
                if bar is not None:
                    bar.update(hi - lo)
        if not parts:
            return self._to_tensordict()
        if len(parts) == 1:
            return parts[0]
        if any(isinstance(p, LazyStackedTensorDict) for p in parts):
            return lazy_stack([td for p in parts for td in p.unbind(sp)], dim=sp)
        return torch.cat(parts, dim=sp)

    def flatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Any = None) -> TensorDictBase:
        """An in-memory copy whose nested keys are joined by ``separator`` (read with ``to_tensordict()``).

        ``inplace=True`` raises ``ValueError``: the keys on the server are not renamed
        (use :meth:`rename_key_` for that).
        """
        if inplace:
            raise ValueError(f"{type(self).__name__}.flatten_keys cannot work in place; it returns an in-memory copy")
        return self.to_tensordict().flatten_keys(separator, is_leaf=is_leaf)

    def unflatten_keys(self, separator: str = ".", inplace: bool = False) -> TensorDictBase:
        """An in-memory copy whose keys are split at ``separator`` into nested keys; ``inplace=True`` raises ``ValueError``."""
        if inplace:
            raise ValueError(f"{type(self).__name__}.unflatten_keys cannot work in place; it returns an in-memory copy")
        return self.to_tensordict().unflatten_keys(separator)

    def to_local(self) -> TensorDictBase:
        """Deprecated alias of :meth:`to_tensordict`."""
        warnings.warn("to_local() is deprecated; use to_tensordict()", DeprecationWarning, stacklevel=2)
        return self.to_tensordict()

    def _clone(self, recurse: bool = True, pbar: bool = False) -> TensorDictBase:
        """``clone()`` is an in-memory copy (``to_tensordict()``, ``pbar=True`` for a progress bar); ``clone(False)`` a new handle on the same store."""
        if recurse:
            return self.to_tensordict(pbar=pbar)
        engine = Engine(self._engine.spec, self._engine.keys, self._engine.client, owns_client=False, readonly=self._engine.readonly)
        engine.set_header(self._engine.header)
        return type(self)._from_engine(engine, backend=self._backend, device=self._device, cache_metadata=self._cache_metadata)

    # -- writes --------------------------------------------------------------------------------
    def _check_writable(self, path: NestedPath, *, new: bool, ignore_lock: bool = False) -> None:
        if self.is_locked and not ignore_lock and new:
            raise RuntimeError(LOCK_ERROR)

    def _write(
        self, index: Any, items: dict[NestedPath, Any], *, replace: bool = False, sub: dict[NestedPath, tuple[int, ...]] | None = None
    ) -> None:
        keys = self._engine.keys
        self._engine.run_write(lambda h, kt: _writes.plan_write(keys, h, index, items, kt, replace=replace, sub=sub))

    def _full_index(self) -> Any:
        return (slice(None),) * len(self._batch_size) if self._batch_size else ()

    def _set_tuple(
        self, key: tuple, value: Any, *, inplace: Any, validated: bool, non_blocking: bool = False, ignore_lock: bool = False
    ) -> TensorDictBase:
        path = as_path(key)
        items = leaves_of(value, self._engine.header.stack_pos, path)
        exists = all(p in self._engine.header.leaves for p in items)
        if inplace is True and not exists:
            raise KeyError(f"key {display(path)!r} is not in the store (set_ writes existing keys only)")
        self._check_writable(path, new=not exists, ignore_lock=ignore_lock)
        # a locked store keeps its schema: existing keys are written in place (same dtype and shape)
        locked = self.is_locked and not ignore_lock
        self._write(self._full_index(), items, replace=inplace is not True and not locked)
        return self

    def _set_str(
        self, key: str, value: Any, *, inplace: Any, validated: bool, ignore_lock: bool = False, non_blocking: bool = False
    ) -> TensorDictBase:
        return self._set_tuple((key,), value, inplace=inplace, validated=validated, non_blocking=non_blocking, ignore_lock=ignore_lock)

    def _set_at_str(self, key: str, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        return self._set_at_tuple((key,), value, idx, validated=validated, non_blocking=non_blocking)

    def _set_at_tuple(self, key: tuple, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        path = as_path(key)
        items = leaves_of(value, self._engine.header.stack_pos, path)
        missing = [p for p in items if p not in self._engine.header.leaves]
        if missing:
            raise KeyError(f"key {display(missing[0])!r} is not in the store (set_at_ writes existing keys only)")
        self._write(idx, items)
        return self

    def _setitem_index(self, index: Any, value: Any) -> None:
        if isinstance(value, (int, float, bool, complex)) or (
            isinstance(value, torch.Tensor) and value.ndim == 0 and not isinstance(value, TensorDictBase)
        ):
            value = self._fill_value(index, value)
        elif isinstance(value, torch.Tensor):
            raise TypeError("store[index] = tensor is ambiguous; write a TensorDict (or a dict of tensors) or a number")
        elif is_tensorclass(value):
            value = value.to_tensordict()
        items = leaves_of(value, self._engine.header.stack_pos)
        new = [p for p in items if p not in self._engine.header.leaves]
        if new and self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        if isinstance(index, int) and not isinstance(index, bool) and not new:
            keys = self._engine.keys
            e = index % self._count if -self._count <= index < self._count else index

            def plan(h: Header, kt: Any) -> Any:
                fast = _writes.plan_element_write(keys, h, e, items, kt)
                return fast if fast is not None else _writes.plan_write(keys, h, index, items, kt)

            self._engine.run_write(plan)
            return
        # keys this write creates take on the extra batch dims of the value's sub-trees
        self._write(index, items, sub=subtree_dims(value, value.batch_dims) if new and isinstance(value, TensorDictBase) else None)

    def _fill_value(self, index: Any, value: Any) -> dict[NestedPath, torch.Tensor]:
        """``store[index] = number`` writes the number into every leaf at ``index`` (in each leaf's dtype)."""
        h = self._engine.header
        norm = _index.normalize(index, h.batch_size)
        p = _index.plan(norm, h.batch_size, h.stack_pos)
        shape = tuple(_index.storage_rows(p, h.inner).shape)
        out = {}
        for path, leaf in h.leaves.items():
            if leaf.json:  # non-tensor keys are left as they are, as on a TensorDict
                continue
            if leaf.het:
                raise NotImplementedError(
                    f"filling the heterogeneous key {display(path)!r} with a number is not supported; write tensors of each element's shape"
                )
            out[path] = torch.full(shape + tuple(leaf.shape[len(h.inner) :]), value, dtype=leaf.dtype)  # type: ignore[index]
        return out

    def update(
        self,
        input_dict_or_td: Any,
        clone: bool = False,
        inplace: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Any = None,
        is_leaf: Any = None,
        update_batch_size: bool = False,
        ignore_lock: bool = False,
    ) -> TensorDictBase:
        """Write every leaf of ``input_dict_or_td`` (covering the whole stack) in one atomic call."""
        items = leaves_of(input_dict_or_td, self._engine.header.stack_pos)
        items = only_keys(items, keys_to_update)
        if not items:
            return self
        new = [p for p in items if p not in self._engine.header.leaves]
        if (new or not inplace) and self.is_locked and not ignore_lock and new:
            raise RuntimeError(LOCK_ERROR)
        if inplace and new:
            raise KeyError(f"key {display(new[0])!r} is not in the store (update_ writes existing keys only)")
        self._write(self._full_index(), items, replace=not inplace)
        return self

    def update_(
        self, input_dict_or_td: Any, clone: bool = False, *, non_blocking: bool = False, keys_to_update: Any = None
    ) -> TensorDictBase:
        return self.update(input_dict_or_td, inplace=True, keys_to_update=keys_to_update)

    def update_at_(
        self, input_dict_or_td: Any, idx: Any, clone: bool = False, *, non_blocking: bool = False, keys_to_update: Any = None
    ) -> TensorDictBase:
        """Write the leaves of ``input_dict_or_td`` at ``idx`` in one atomic call (existing keys only)."""
        items = leaves_of(input_dict_or_td, self._engine.header.stack_pos)
        items = only_keys(items, keys_to_update)
        missing = [p for p in items if p not in self._engine.header.leaves]
        if missing:
            raise KeyError(f"key {display(missing[0])!r} is not in the store (update_at_ writes existing keys only)")
        self._write(idx, items)
        return self

    def _del(self, key: tuple) -> None:
        self._delete_keys([key], missing_ok=False)

    def del_(self, key: Any) -> TensorDictBase:
        self._del(as_path(key))
        return self

    def _delete_keys(self, keys: Sequence[Any], *, missing_ok: bool = True) -> LazyStackedTensorDictStore:
        """Delete several keys (and everything below them) in one atomic call; ``KeyError`` for a missing one unless ``missing_ok``."""
        paths = [as_path(k) for k in keys]
        if not paths:
            return self
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        store_keys = self._engine.keys

        def plan(h: Header, kt: Any) -> Any:
            if not missing_ok:
                for q in paths:
                    if not any(p[: len(q)] == q for p in h.leaves):
                        raise KeyError(f"key {display(q)!r} is not in the store")
            doomed = [p for p in h.leaves if any(p[: len(q)] == q for q in paths)]
            return _writes.plan_delete(store_keys, h, doomed, kt)

        self._engine.run_write(plan)
        return self

    def unbind(self, dim: int) -> tuple[TensorDictBase, ...]:
        """Along the stack dim: write-through views of every element (as a lazy stack gives its members); other dims: local copies."""
        nd = len(self._batch_size)
        if not -nd <= dim < nd:
            raise IndexError(f"dim {dim} is out of range for a batch size of {nd} dims")
        if dim % nd == self._engine.header.stack_pos:
            return tuple(ElementView(self, e) for e in range(self._count))
        return self.to_tensordict().unbind(dim)

    def __delitem__(self, key: Any) -> None:
        self._del(as_path(key))

    def _rename_key(self, old_key: Any, new_key: Any) -> None:
        old, new = as_path(old_key), as_path(new_key)

        def plan(h: Header, kt: Any) -> Any:
            under = [p for p in h.leaves if p[: len(old)] == old]
            if not under:
                raise KeyError(f"key {display(old)!r} is not in the store")
            renames = {p: new + p[len(old) :] for p in under}
            clash = [n for n in renames.values() if n in h.leaves and n not in renames]
            if clash:
                raise KeyError(f"key {display(clash[0])!r} already exists; delete it first")
            return _writes.plan_rename(h, renames), [], []

        self._engine.run_write(plan)

    def _allocate(self, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Add (or replace) homogeneous keys of zeros, ``{path: (feature_shape, dtype)}``, allocated by the server in one call."""
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        keys = self._engine.keys

        def plan(h: Header, kt: Any) -> Any:
            leaves = dict(h.leaves)
            next_leaf = h.next_leaf
            ops: list[list[Any]] = []
            for path, (feat, dtype) in specs.items():
                old = leaves.get(path)
                number = old.number if old is not None else next_leaf
                next_leaf += old is None
                shape = (*h.inner, *feat)
                leaf = Leaf(path, number, dtype, len(shape), shape)
                leaves[path] = leaf
                # a store that keeps an inventory allocates each segment when it is first written (reads of
                # the others give zeros); a spread store's segments are allocated here, one call per node
                alloc = ["D", kt.ref(keys.data(number))] if h.tracked else ["Z", kt.ref(keys.data(number)), h.count * leaf.element_nbytes]
                ops += [alloc, ["D", kt.ref(keys.offsets(number))], ["D", kt.ref(keys.shapes(number))]]
            check_paths(list(leaves))
            after = h.with_leaves(leaves, next_leaf)
            if h.leaves:  # (the first keys of an empty store are checked where they fix its segment length)
                self._engine.check_room(after, sum(leaf.element_nbytes for leaf in after.leaves.values() if not leaf.het and not leaf.json))
            return after, ops, []

        self._engine.run_write(plan)

    def _write_back(self, keys: Any, values: Any, method: str) -> None:
        """Results of in-place methods written back in one call."""
        if not keys:
            return
        items = {as_path(k): v for k, v in zip(keys, values)}
        self._write(self._full_index(), items)

    def _write_local(self, local: TensorDictBase) -> None:
        self._write(self._full_index(), leaves_of(local, self._engine.header.stack_pos))

    def _fill_paths(self, under: NestedPath, value: Any) -> None:
        keys = self._engine.keys

        def plan(h: Header, kt: Any) -> Any:
            paths = [p for p in h.leaves if p[: len(under)] == under]
            if not paths:
                raise KeyError(f"key {display(under)!r} is not in the store")
            return _writes.plan_fill(keys, h, paths, value, kt)

        self._engine.run_write(plan)

    # -- shared ring buffer ------------------------------------------------------------------
    def extend(self, td: Any, *, priority: Any = None, timeout: float | None = None) -> _ring.RingWrite:
        """Write the elements of ``td`` into the next slots of the ring, atomically, in one call.

        The store's ``count`` is the ring's capacity.  The server reserves the slots
        at its cursor (wrapping around), writes every key of every element, and
        advances the cursor, in one script call: processes on any number of
        machines may ``extend`` the same store at once, and no slot is written
        twice in one lap.  ``td`` has the store's batch size with the element dim
        (of 1 to ``count`` elements) at the stack dim, and exactly the store's keys;
        on a store without keys, the first ``extend`` creates them (the other slots
        hold zeros).  Elements may differ in shape (heterogeneous keys).

        ``td`` may also be a list or tuple of element tensordicts (stacked lazily, so
        their shapes may differ) or a tensorclass batch. Returns the slots written and
        their new generations (:class:`RingWrite`).

        On a store with priorities (:meth:`enable_priorities`), ``priority`` (one number, or
        one per element) is each new slot's priority, set in the same atomic call; by
        default, the largest priority given so far. When the store's rate limiter or queue
        mode holds inserts back, ``extend`` waits (``timeout`` seconds at most, then
        ``TimeoutError``; ``None``: as long as it takes) and nothing is written meanwhile.
        """
        if isinstance(td, (list, tuple)):
            if not td:
                raise ValueError("extend got an empty list: nothing to write")
            elements = [
                e.to_tensordict() if is_tensorclass(e) else TensorDict(e, batch_size=self._inner_batch_size) if isinstance(e, dict) else e
                for e in td
            ]
            bad = [type(e).__name__ for e in elements if not isinstance(e, TensorDictBase)]
            if bad:
                raise TypeError(f"extend got a list holding {bad[0]}; it takes a list of TensorDicts (one per element)")
            td = lazy_stack(elements, dim=self._engine.header.stack_pos)
        elif is_tensorclass(td):
            td = td.to_tensordict()
        if isinstance(td, TensorDictBase) and tuple(td.batch_size) == tuple(self._inner_batch_size):
            raise ValueError(
                f"extend got one element (batch size {list(td.batch_size)}); use append for one element, or give extend a batch "
                f"with the element dim at {self._engine.header.stack_pos}"
            )
        return _ring.extend(self._writable_engine(), td, priority, timeout)

    def append(self, td: Any, *, priority: Any = None, timeout: float | None = None) -> _ring.RingWrite:
        """``extend`` with one element (a tensordict of the inner batch size)."""
        if isinstance(td, dict):
            td = TensorDict(td, batch_size=self._inner_batch_size)
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"append expects a TensorDict or a dict, got {type(td).__name__}")
        if tuple(td.batch_size) != tuple(self._inner_batch_size):
            raise ValueError(
                f"append expects one element of batch size {list(self._inner_batch_size)}, got {list(td.batch_size)}; use extend for batches"
            )
        return self.extend(td.unsqueeze(self._engine.header.stack_pos), priority=priority, timeout=timeout)

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        keys: Sequence[Any] | None = None,
        prioritized: bool | None = None,
        alpha: float | None = None,
        beta: float = 1.0,
        min_size: int | None = None,
        timeout: float | None = None,
        **ragged: Any,
    ) -> _ring.Sample | PrioritizedSample:
        """A uniform random batch of written slots (with replacement), in one round trip.

        Only slots the ring has written are drawn (``store.written``).  The random
        numbers come from ``generator`` (``torch.Generator``; the global one by
        default), so a seeded generator draws the same batch from the same ring.
        Returns ``Sample(td, indices, generations)``: ``td`` is a TensorDict, or a
        lazy stack when keys are heterogeneous; keep the generations to write back
        with :meth:`update_if`.  Raises ``ValueError`` when nothing was written yet.

        ``keys`` reads only those keys (nested keys take every leaf below them).
        ``as_padded_tensor=True`` (with ``padding_side``, ``padding_value``) or
        ``as_nested_tensor=True`` make each heterogeneous key one padded or jagged tensor of
        the batch, as ``get`` does, so ``td`` is a TensorDict (token sequences padded for a
        learner, built without a tensor per row).

        On a store with priorities (:meth:`enable_priorities`) the draw follows them
        (``prioritized=False`` draws uniformly): each row is drawn on the server, in
        O(log capacity), and the result is ``PrioritizedSample(td, indices, generations,
        weights, probabilities)`` with importance weights ``(P(i) / min_j P(j)) ** -beta``
        (``alpha``, if given, must be the store's). ``min_size`` waits until the ring holds that
        many items, as the store's rate limiter (:meth:`set_rate_limit`) does; a waiting
        sample blocks without polling, ``timeout`` seconds at most (``TimeoutError``;
        ``None``: as long as it takes).
        """
        if ragged and not _ragged.wanted(ragged):
            raise TypeError(
                f"sample takes as_padded_tensor=True or as_nested_tensor=True (with {sorted(_ragged.KEYWORDS)}), got {sorted(ragged)}"
            )
        if isinstance(keys, (str, tuple)):
            keys = [keys]  # one key (a tuple is one nested key, as in TensorDict.select)
        return _ring.sample(
            self._engine,
            batch_size,
            generator,
            self._device,
            ragged or None,
            None if keys is None else [as_path(k) for k in keys],
            prioritized=prioritized,
            alpha=alpha,
            beta=beta,
            min_size=min_size,
            timeout=timeout,
        )

    @property
    def capacity(self) -> int:
        """The ring's capacity: the store's element count (``len(store.written)`` is how many it holds)."""
        return self._count

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        """Write ``td`` at slots ``index`` only where the slot's generation still equals ``generation``.

        A learner that sampled a batch writes back (new priorities, say) without
        clobbering slots an actor has overwritten since: rows whose slot was
        rewritten by a later ``extend`` are skipped.  One atomic call; every row is
        checked (keys, dtypes, shapes) before anything is written.  ``td`` may hold
        a subset of the store's keys.  Returns a bool tensor: which rows were applied.
        """
        return _ring.update_if(self._writable_engine(), index, generation, td)

    def ring_state(self) -> _ring.RingState:
        """``(write_count, cursor, written)`` of the ring, read from the server in one round trip."""
        return _ring.state(self._engine.ring_writes(), self._count)

    @property
    def written(self) -> range:
        """The slots the ring has written so far (``range(n)``; ``len(store.written)`` is n), read from the server."""
        return range(self.ring_state().written)

    @property
    def cursor(self) -> int:
        """The slot the next ``extend`` writes first, read from the server."""
        return self.ring_state().cursor

    @property
    def write_count(self) -> int:
        """How many elements ``extend``/``append`` have written in total (all laps), read from the server."""
        return self._engine.ring_writes()

    def _writable_engine(self) -> Engine:
        """The engine, for a ring write; a locked store refuses only the first one, which creates keys."""
        if self.is_locked and not self._engine.header.leaves:
            raise RuntimeError(LOCK_ERROR)
        return self._engine

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close this handle's connection; the data stays on the server (see :meth:`clear_redis`).

        A client passed in with ``client=`` is left open (it is the caller's).
        Using the handle again opens a new connection.  ``with store: ...``
        closes it at the end of the block.
        """
        self._engine.close()

    def expire(self, seconds: float) -> None:
        """Make the whole store expire in ``seconds``: every key gets the same deadline, in one atomic call.

        Keys added later (new keys, a key that becomes heterogeneous) take the same
        deadline, so the store never expires in part.
        """
        ms = ttl_to_ms(seconds)
        if ms == 0:
            raise ValueError(f"expire needs a positive number of seconds, got {seconds!r}; use persist() to remove the time to live")
        self._engine.expire(ms)

    def persist(self) -> None:
        """Remove the store's time to live (every key), in one atomic call."""
        self._engine.expire(0)

    def ttl(self) -> float | None:
        """Seconds left before the store expires, or ``None`` when it has no time to live."""
        ms = self._engine.ttl_ms()
        return None if ms is None else ms / 1000

    def clear_redis(self) -> int:
        """Delete every key of this store, and nothing else, in one atomic call. Returns the count deleted."""
        return self._engine.clear()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
        last = self._last_op_queue[-1] if getattr(self, "_last_op_queue", None) else None
        result = super().__exit__(exc_type, exc_val, exc_tb)
        if last is None:
            self.close()
        return result

    def __getstate__(self) -> dict[str, Any]:
        return {
            "spec": self._engine.spec,
            "prefix": self._engine.keys.prefix,
            "td_id": self._engine.keys.td_id,
            "header": self._engine.header.fields(),
            "backend": self._backend,
            "device": self._device,
            "cache_metadata": self._cache_metadata,
            "is_locked": self._is_locked,
            "readonly": self._engine.readonly,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        engine = Engine(state["spec"], StoreKeys(state["prefix"], state["td_id"]), readonly=state.get("readonly", False))
        engine.set_header(Header.from_fields(state["header"]))
        self._init_handle(engine, backend=state["backend"], device=state["device"], cache_metadata=state["cache_metadata"])
        if state.get("is_locked"):
            self.lock_()

    def __reduce__(self) -> Any:
        return (_restore, (type(self), self.__getstate__()))


def _restore(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _check_layout(count: Any, stack_dim: Any, inner_batch_size: Any) -> tuple[int, tuple[int, ...]]:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int (a lazy stack has at least one element), got {count!r}")
    if count > 2**40:
        raise ValueError(f"count {count} is too large (at most 2**40 elements)")
    try:
        inner = tuple(int(i) for i in inner_batch_size)
    except TypeError:
        raise TypeError(f"inner_batch_size must be a sequence of ints, got {inner_batch_size!r}") from None
    if any(i < 0 for i in inner):
        raise ValueError(f"inner_batch_size must hold non-negative sizes, got {list(inner)}")
    if isinstance(stack_dim, bool) or not isinstance(stack_dim, int) or not -(len(inner) + 1) <= stack_dim <= len(inner):
        raise ValueError(f"stack_dim {stack_dim!r} is out of range for an inner batch size of {len(inner)} dims")
    return count, inner


class ElementView(StoreCommon, SurfaceMixin, StoreUnsupported, TensorDictBase):
    """``store[i]``: a write-through view of element ``i`` (or of a nested key of it).

    Each read or write is one atomic call: ``view[key]`` reads one leaf of the
    element, ``view.to_tensordict()`` all of them, ``view[key] = t`` writes one,
    ``view.update(td)`` writes all of ``td``'s leaves at once.  On a locked store
    the view writes existing keys and refuses new ones; the view itself is not
    locked (as in the reference).
    """

    def __init__(self, store: LazyStackedTensorDictStore, element: int, under: NestedPath = ()) -> None:
        self._store = store
        self._element = element
        self._under = under
        self._batch_size = torch.Size((*store._inner_batch_size, *store._engine.header.subtree_dims(under)))
        self._device = store._device
        self._is_locked = False
        self._lock_id = set()
        self._locked_tensordicts = []
        self._is_shared = False
        self._is_memmap = False
        self._last_op = None

    # identity / metadata
    @property
    def device(self) -> torch.device | None:
        return self._device

    @device.setter
    def device(self, value: Any) -> None:
        raise RuntimeError("the device of a store element cannot be set; call .to(device) for a local copy")

    def _paths(self) -> list[NestedPath]:
        return self._store._paths()

    def keys(self, include_nested: bool = False, leaves_only: bool = False, is_leaf: Any = None, *, sort: bool = False) -> KeysView:  # type: ignore[override]
        return KeysView(self._paths, self._under, include_nested, leaves_only, sort)

    def entry_class(self, key: Any) -> type:
        return self._store.entry_class(self._under + as_path(key))

    def __repr__(self) -> str:
        keys = list(self.keys(include_nested=True, leaves_only=True))
        return f"{type(self._store).__name__}[{self._element}](keys={keys}, batch_size={self._batch_size}, td_id={self._store.td_id!r})"

    # index composition
    def _store_index(self, index: Any = None) -> tuple:
        h = self._store._engine.header
        inner = _index.normalize(index, torch.Size(h.inner)) if index is not None else tuple(slice(0, n, 1) for n in h.inner)
        return inner[: h.stack_pos] + (self._element,) + inner[h.stack_pos :]

    # reads
    def _read(self, paths: list[NestedPath] | None, index: Any = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """One read of this element: ``paths``, or every leaf below ``under`` when ``paths`` is None."""
        return self._store._read_index(self._store_index(index), paths, under=under, strip=strip)

    def _read_key(self, rel: NestedPath, default: Any, **kwargs: Any) -> Any:
        path = self._under + rel
        h = self._store._header
        if path in h.leaves:
            try:
                return self._read([path]).get(display(path))
            except KeyError:
                if default is not NO_DEFAULT:
                    return default
                raise
        if any(p[: len(path)] == path for p in h.leaves):
            return ElementView(self._store, self._element, path)
        if default is not NO_DEFAULT:
            return default
        raise KeyError(f"key {display(rel)!r} is not in element {self._element} of the store")

    def _get_str(self, key: str, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key((key,), default, **kwargs)

    def _get_tuple(self, key: tuple, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_key(as_path(key), default, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, (str, tuple)) for i in index)):
            return _nontensor.content(self._read_key(as_path(index), NO_DEFAULT))
        if index is Ellipsis or (isinstance(index, tuple) and not index):
            return self
        return self._index_tensordict(index)

    def _get_at_str(self, key: str, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._get_at_tuple((key,), idx, default, **kwargs)

    def _get_at_tuple(self, key: tuple, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        path = self._under + as_path(key)
        try:
            td = self._read(None, idx, under=path, strip=False)
        except KeyError:
            if default is not NO_DEFAULT:
                return default
            raise
        return td.get(display(path))

    def _index_tensordict(self, index: Any, new_batch_size: Any = None, names: Any = None) -> TensorDictBase:
        return self._read(None, index, under=self._under)

    def _to_tensordict(self, *, retain_none: bool | None = None) -> TensorDictBase:
        return self._read(None, under=self._under)

    def to_local(self) -> TensorDictBase:
        warnings.warn("to_local() is deprecated; use to_tensordict()", DeprecationWarning, stacklevel=2)
        return self.to_tensordict()

    def _clone(self, recurse: bool = True) -> TensorDictBase:
        """An in-memory copy of the element (clone(False) gives another view of it)."""
        if recurse:
            return self.to_tensordict()
        return ElementView(self._store, self._element, self._under)

    # writes
    def _write(self, items: dict[NestedPath, Any], index: Any = None) -> None:
        store = self._store
        new = [p for p in items if p not in store._engine.header.leaves]
        if new and store.is_locked:
            raise RuntimeError(LOCK_ERROR)
        # a key the store does not have is created for every element (the others zeros or None)
        store._write(self._store_index(index), items)

    def _set_tuple(
        self, key: tuple, value: Any, *, inplace: Any, validated: bool, non_blocking: bool = False, ignore_lock: bool = False
    ) -> TensorDictBase:
        path = self._under + as_path(key)
        self._write(leaves_of(value, self._store._engine.header.stack_pos, path))
        return self

    def _set_str(
        self, key: str, value: Any, *, inplace: Any, validated: bool, ignore_lock: bool = False, non_blocking: bool = False
    ) -> TensorDictBase:
        return self._set_tuple((key,), value, inplace=inplace, validated=validated, non_blocking=non_blocking, ignore_lock=ignore_lock)

    def _set_at_str(self, key: str, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        return self._set_at_tuple((key,), value, idx, validated=validated, non_blocking=non_blocking)

    def _set_at_tuple(self, key: tuple, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        path = self._under + as_path(key)
        self._write(leaves_of(value, self._store._engine.header.stack_pos, path), idx)
        return self

    def _setitem_index(self, index: Any, value: Any) -> None:
        if not isinstance(value, (TensorDictBase, dict)):
            raise TypeError("element[index] = value needs a TensorDict or a dict of tensors")
        self._write(leaves_of(value, self._store._engine.header.stack_pos, self._under), index)

    def update(
        self,
        input_dict_or_td: Any,
        clone: bool = False,
        inplace: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Any = None,
        is_leaf: Any = None,
        update_batch_size: bool = False,
        ignore_lock: bool = False,
    ) -> TensorDictBase:
        """Write every leaf of ``input_dict_or_td`` into this element in one atomic call."""
        items = leaves_of(input_dict_or_td, self._store._engine.header.stack_pos, self._under)
        items = only_keys(items, keys_to_update, self._under)
        if items:
            self._write(items)
        return self

    def update_(
        self, input_dict_or_td: Any, clone: bool = False, *, non_blocking: bool = False, keys_to_update: Any = None
    ) -> TensorDictBase:
        return self.update(input_dict_or_td, keys_to_update=keys_to_update)

    def _write_back(self, keys: Any, values: Any, method: str) -> None:
        if keys:
            self._write({self._under + as_path(k): v for k, v in zip(keys, values)})

    def _write_local(self, local: TensorDictBase) -> None:
        self._write(leaves_of(local, self._store._engine.header.stack_pos, self._under))

    def _fill_paths(self, under: NestedPath, value: Any) -> None:
        store = self._store
        keys = store._engine.keys
        full = self._under + under

        def plan(h: Header, kt: Any) -> Any:
            paths = [p for p in h.leaves if p[: len(full)] == full]
            if not paths:
                raise KeyError(f"key {display(under) if under else display(self._under)!r} is not in the store")
            return _writes.plan_fill(keys, h, paths, value, kt, element=self._element)

        store._engine.run_write(plan)

    def _del(self, key: tuple) -> None:
        raise RuntimeError("a key cannot be deleted from one element of a store; use del store[key] to delete it everywhere")

    def _delete_keys(self, keys: Sequence[Any]) -> Any:
        raise RuntimeError(
            "keys cannot be deleted from one element of a store; delete them from the store (store.exclude(..., inplace=True))"
        )

    def _rename_key(self, old_key: Any, new_key: Any) -> None:
        raise RuntimeError("a key cannot be renamed in one element of a store; use store.rename_key_(old, new)")

    @classmethod
    def from_dict(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("store elements are made by indexing a store: store[i]")

    def __reduce__(self) -> Any:
        return (ElementView, (self._store, self._element, self._under))
