"""Key changes of ``LazyStackedTensorDictStore``: deleting, renaming and allocating keys.

Each change rewrites the header and the keys' data in one atomic call; a locked store refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import torch
from tensordict import TensorDictBase

from tdstore._engine.engine import Engine, request_id
from tdstore._engine.write_call import first_keys
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf, NestedPath, check_paths
from tdstore._front.common import LOCK_ERROR
from tdstore._front.state import LazyState
from tdstore._plan import write_plan
from tdstore._plan.values import as_path, display


class LazyKeys(LazyState):
    """Schema changes on the server: delete, rename and allocate keys."""

    def _del(self, key: tuple) -> None:
        self._delete_keys([key], missing_ok=False)

    def del_(self, key: Any) -> TensorDictBase:
        self._del(as_path(key))
        return self

    def _delete_keys(self, keys: Sequence[Any], *, missing_ok: bool = True) -> Self:
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
            return write_plan.plan_delete(store_keys, h, doomed, kt)

        # with a request id: a resend after a lost reply must not plan again, find the keys gone and raise
        self._engine.run_write_reply(plan, request=self._change_id())
        return self

    def __delitem__(self, key: Any) -> None:  # type: ignore[override]  # returns nothing, as ``del`` of a mapping does
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
            return write_plan.plan_rename(h, renames), [], []

        self._engine.run_write_reply(plan, request=self._change_id())  # as _delete_keys: a resend applies it once

    def _change_id(self) -> str | None:
        """A request id for a key renamed or deleted, whose resend after a lost reply would otherwise plan
        again and raise ``KeyError`` for the key the first attempt renamed or deleted. None on a spread
        store, whose schema changes go per segment (``_engine.spread_change``) without the reply cache."""
        return None if self._engine.header.spread else request_id()

    def _allocate(self, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Add (or replace) homogeneous keys of zeros, ``{path: (feature_shape, dtype)}``, allocated by the server in one call."""
        if self.is_locked:
            raise RuntimeError(LOCK_ERROR)
        self._engine.run_write(allocation_plan(self._engine, specs))


def allocation_plan(engine: Engine, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> Callable[[Header, Any], Any]:
    """The write that adds (or replaces) the keys ``specs`` of zeros on a store: the header after it and its ops,
    planned against the header the store holds (``Engine.run_write``'s plan)."""
    keys = engine.keys

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
            data = kt.ref(keys.data(number))
            alloc = Write.D(data) if h.tracked else Write.Z(data, h.count * leaf.element_nbytes)
            ops += [alloc, Write.D(kt.ref(keys.offsets(number))), Write.D(kt.ref(keys.shapes(number)))]
        check_paths(list(leaves))
        after = h.with_leaves(leaves, next_leaf)
        if h.leaves:  # (the first keys of an empty store are checked where they fix its segment length)
            engine.check_room(after, sum(leaf.element_nbytes for leaf in after.leaves.values() if not leaf.het and not leaf.json))
        return after, ops, []

    return plan


def check_allocation(engine: Engine, h: Header, specs: dict[NestedPath, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Refuse keys ``specs`` that a store with header ``h`` could not hold, before anything is written (not even
    the store, when ``h`` is the header a new one would be created with): the checks the write itself makes
    (keys, the server's maxmemory, the segment count) and a segment of a key larger than one string may be
    (``proto-max-bulk-len``), which a store whose segments are allocated when first written would meet later."""
    kt = engine.key_table(h)
    after, ops, _ = allocation_plan(engine, specs)(h, kt)
    after = first_keys(engine, h, after, ops, kt)
    segs, limit = after.segments, engine.max_value_bytes
    rows = min(segs.per, segs.count)
    for path in specs:
        need = rows * after.leaves[path].element_nbytes
        if need > limit:
            raise ValueError(
                f"key {display(path)!r} needs {need} bytes for {rows} element(s) of one segment, more than the server accepts "
                f"for one string ({limit}, proto-max-bulk-len); nothing was written ({engine.where()})"
            )
