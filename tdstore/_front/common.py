"""What every store handle shares: the keys view, the TensorDictBase class flags and the rules for
a fixed batch size and no dim names, the message of a locked store, and small argument helpers.

``LazyStackedTensorDictStore`` (``lazy``), its ``ElementView`` (``_front.element``) and the dense
``TensorDictStore`` (``dense``) build on them (through ``_front.store_base.StoreBase``; the two views
through ``_front.stack_view.StackView``).
:class:`StackStore` and :class:`StackAccess` say what a view or the dense store may use of the lazy
store it wraps; :data:`MixinBase` is the base of the mixins the store classes are made of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tensordict import NonTensorData, TensorDictBase
from tensordict.base import BEST_ATTEMPT_INPLACE

from tdstore._engine.engine import Engine
from tdstore._errors import ShardedRingIdError
from tdstore._format.schema import Header, NestedPath
from tdstore._plan.values import as_path, display

if TYPE_CHECKING:
    from tensordict import TensorDictBase as MixinBase
else:
    # The base of the store mixins (StoreCommon, SurfaceMixin, StoreUnsupported and the lazy store's
    # parts): at run time a plain class listed before TensorDictBase in a store's bases; for the type
    # checker TensorDictBase itself, whose methods the mixins call and override.
    MixinBase = object

LOCK_ERROR = (
    "Cannot modify locked TensorDict. For in-place modification, consider using the `set_()` method and make sure the key is present."
)


class KeysView:
    """Keys of a store or of an element view (insertion order).

    A snapshot of the schema taken when ``keys()`` is called: from the cached
    header, or from the server (one round trip) with ``cache_metadata=False``.
    """

    def __init__(
        self, paths: Callable[[], list[NestedPath]], under: NestedPath, include_nested: bool, leaves_only: bool, sort: bool
    ) -> None:
        snapshot = paths()
        self._paths = lambda: snapshot
        self._under = under
        self.include_nested = include_nested
        self.leaves_only = leaves_only
        self.sort = sort

    def _items(self) -> list[Any]:
        cut = len(self._under)
        seen: dict[NestedPath, None] = {}
        for path in self._paths():
            if path[:cut] != self._under or len(path) == cut:
                continue
            rel = path[cut:]
            if not self.include_nested:
                if len(rel) == 1 or not self.leaves_only:
                    seen.setdefault(rel[:1])
                continue
            if not self.leaves_only:
                for k in range(1, len(rel)):
                    seen.setdefault(rel[:k])
            seen.setdefault(rel)
        keys = [display(p) for p in seen]
        if self.sort:
            keys.sort(key=lambda k: ".".join(k) if isinstance(k, tuple) else k)
        return keys

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __contains__(self, key: Any) -> bool:
        try:
            path = as_path(key)
        except (TypeError, KeyError):
            return False
        if len(path) > 1 and not self.include_nested:
            return False
        return display(path) in self._items()

    def __repr__(self) -> str:
        return f"KeysView({self._items()})"


class StackAccess(Protocol):
    """What the views of a lazy store (``StackView``: ``ElementView``, the dense ``TensorDictStore``) run on it: ``store.stack_ops``.

    These are the store's own reads and key changes, each one atomic call, with no check of a
    view's lock or sub-tree (the view checks those first); views write through their own
    ``WriteSurface`` on the store's engine.  They live on this separate object so that the
    store's user-facing methods stay those of a tensordict.
    """

    @property
    def engine(self) -> Engine:
        """The store's engine: its server calls, keys and cached header."""
        ...

    @property
    def backend(self) -> str:
        """The label of the server kind the store was opened with ("redis", "valkey"...)."""
        ...

    @property
    def cache_metadata(self) -> bool:
        """Whether the handle keeps the schema (``cache_metadata=``)."""
        ...

    def read(self, index: Any, paths: list[NestedPath] | None = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """``paths`` (default: every leaf below ``under``) at ``index`` of the stack, in one call."""
        ...

    def allocate(self, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Add (or replace) keys of zeros, ``{path: (feature_shape, dtype)}``, allocated by the server."""
        ...

    def delete_keys(self, keys: Sequence[Any], *, missing_ok: bool = True) -> None:
        """Delete keys and everything below them; ``KeyError`` for a missing one unless ``missing_ok``."""
        ...

    def rename_key(self, old_key: Any, new_key: Any) -> None:
        """Rename a key (and everything below it)."""
        ...


class StackStore(Protocol):
    """A lazy store as its views see it: its public members and :class:`StackAccess`."""

    @property
    def stack_ops(self) -> StackAccess: ...

    @property
    def td_id(self) -> str: ...

    @property
    def prefix(self) -> str: ...

    @property
    def readonly(self) -> bool: ...

    @property
    def is_locked(self) -> bool: ...

    @property
    def batch_size(self) -> torch.Size: ...

    @property
    def device(self) -> torch.device | None: ...

    @device.setter
    def device(self, value: Any) -> None: ...

    def entry_class(self, key: Any) -> type: ...

    def close(self) -> None: ...

    def clear_redis(self) -> int: ...

    def expire(self, seconds: float) -> None: ...

    def persist(self) -> None: ...

    def ttl(self) -> float | None: ...


class StoreCommon(MixinBase):
    """What the store and its element views share: TensorDictBase class flags (see
    tensordict.base for each), a fixed batch size, no dim names, no sub-tensordicts to lock.
    """

    _td_dim_names: list[str] | None = None
    _masking_on_dense_copy = True
    _masked_select_on_dense_copy = True
    _masked_select_inplace_unsupported = True
    _reads_return_copies = True
    _nested_reads_return_copies = True
    _update_stores_copy_of_self = True
    _leaves_built_on_read = True
    _contiguous_via_to_tensordict = True
    _pin_memory_unsupported = True
    _storage_holds_no_gradients = True
    _copy_shares_storage = True
    _setitem_key_inplace = BEST_ATTEMPT_INPLACE  # type: ignore[assignment]  # tensordict's sentinel, in a flag it types as bool
    _get_ignores_kwargs = False
    _tdstore_reads_remote = True
    _batch_size: torch.Size

    def _init_tensordict_state(self) -> None:
        """The per-instance state tensordict's methods read: unlocked, not shared, not memory-mapped."""
        self._is_locked = False
        self._lock_id: set[int] = set()
        self._locked_tensordicts: list[Any] = []
        self._is_shared = False
        self._is_memmap = False
        self._last_op = None

    @property
    def batch_size(self) -> torch.Size:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        if torch.Size(value) != self._batch_size:
            raise RuntimeError(f"the batch size of a {type(self).__name__} is fixed at {list(self._batch_size)}")

    def _change_batch_size(self, new_size: torch.Size) -> None:
        self.batch_size = new_size

    def _check_new_batch_size(self, new_size: torch.Size) -> None:
        self.batch_size = new_size

    def _batch_size_setter(self, new_batch_size: torch.Size) -> None:
        self.batch_size = new_batch_size

    @property
    def names(self) -> list[None]:
        return [None] * len(self._batch_size)

    @names.setter
    def names(self, value: Any) -> None:
        self._rename_subtds(value)

    def rename(self, *names: Any, **rename_map: Any) -> Any:
        """Dim names are not stored: name a local copy instead (``to_tensordict().rename(...)``)."""
        raise RuntimeError(f"{type(self).__name__} has no dim names; name a local copy: to_tensordict().rename(...)")

    def _has_names(self) -> bool:
        return False

    def _erase_names(self) -> None:
        return None

    def _rename_subtds(self, value: Any) -> None:
        if value is not None and any(v is not None for v in value):
            raise RuntimeError(f"{type(self).__name__} has no dim names; name a local copy: to_tensordict().refine_names(...)")

    def __contains__(self, key: Any) -> bool:
        return key in self.keys(include_nested=isinstance(key, tuple))

    def _lock_sub_tensordicts(self) -> list:
        return []

    def _set_non_tensor(self, key: Any, value: Any) -> Any:
        """``set_non_tensor(key, value)``: ``value`` (JSON-able) for every element, in one atomic call."""
        # NonTensorData is a tensorclass, which tensordict's annotation of set() leaves out
        return self.set(key, NonTensorData(value, batch_size=self.batch_size))  # type: ignore[arg-type]

    def _popped_value(self, value: Any) -> Any:
        """``pop``/``popitem`` of a nested key return its data, not a view of keys about to be deleted."""
        return value.to_tensordict() if getattr(value, "_tdstore_reads_remote", False) else value


def only_keys(items: dict[NestedPath, Any], keys_to_update: Any, under: NestedPath = ()) -> dict[NestedPath, Any]:
    """The leaves of ``items`` at or below one of ``keys_to_update`` (all of them when it is None)."""
    if keys_to_update is None:
        return items
    wanted = [under + as_path(k) for k in keys_to_update]
    return {p: v for p, v in items.items() if any(p[: len(w)] == w for w in wanted)}


def fetch_existing(engine: Engine) -> Header:
    """The header of the store ``from_store`` attaches to; an unknown id raises ``KeyError`` worded as ``tensordict.store`` words it."""
    try:
        return engine.fetch_header()
    except KeyError as err:
        if err.args != engine.gone().args:
            raise
    keys = engine.keys
    if engine.spec.cluster and _is_sharded_ring(engine):
        raise ShardedRingIdError(
            f"td_id={keys.td_id!r} (prefix {keys.prefix!r}) on {engine.spec.describe()} is a sharded ring, not a one-node store: "
            f"open it with tdstore.ShardedRing.from_store(td_id={keys.td_id!r}, url=...)"
        )
    if _written_by_reference(engine):
        raise KeyError(
            f"No TensorDictStore with td_id={keys.td_id!r} found under prefix {keys.prefix!r} on {engine.spec.describe()}: "
            "the store of that id was written by tensordict.store, whose layout tdstore does not read; copy it with "
            f"'tdstore import-reference {keys.td_id}' or tdstore.import_reference(td_id, url=...)"
        )
    raise KeyError(
        f"No TensorDictStore with td_id={keys.td_id!r} found under prefix {keys.prefix!r} on {engine.spec.describe()} "
        "(it was deleted, expired, or never created)"
    )


def _is_sharded_ring(engine: Engine) -> bool:
    """Whether the missing store's id names a sharded ring: its layout key exists (one round trip)."""
    return bool(engine.client.exists(engine.keys.shards))


def _written_by_reference(engine: Engine) -> bool:
    """Whether the missing store's id names a store of the reference ``tensordict.store`` (one round trip)."""
    from tdstore._format.keys import reference_key

    names = ("__keys__", "__batch_size__", "__type__")
    try:
        return bool(engine.command("EXISTS", *(reference_key(engine.keys.prefix, engine.keys.td_id, n) for n in names)))
    except Exception:  # noqa: BLE001 - a hint only: the KeyError is raised either way
        return False


def ttl_to_ms(ttl: Any) -> int:
    """A time to live in seconds as whole milliseconds (at least 1); ``None`` is 0, no expiry."""
    if ttl is None:
        return 0
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 or ttl != ttl or ttl == float("inf"):
        raise ValueError(f"ttl must be a positive, finite number of seconds, got {ttl!r}")
    return max(1, round(ttl * 1000))


def refuse_ellipsis_into_features(h: Header, path: NestedPath, idx: Any, what: str) -> None:
    """``get_at``/``set_at_`` of a key with feature dims at an index holding ``...``: TensorDict indexes the
    key's own tensor, so its ``...`` also spans the feature dims, where a store's index takes the batch dims
    only. Refused (``IndexError``) rather than reading or writing other cells than TensorDict would."""
    if not (idx is Ellipsis or (isinstance(idx, tuple) and any(i is Ellipsis for i in idx))):
        return
    leaf = h.leaves.get(path)
    if leaf is not None and (leaf.het or len(leaf.shape or ()) > len(h.inner)):
        raise IndexError(
            f"{what}({display(path)!r}, {idx!r}): an index with ... on a key with dims of its own (TensorDict applies it "
            f"to the key's tensor, a store to the batch dims); name every batch dim instead, or index store.get({display(path)!r})"
        )
