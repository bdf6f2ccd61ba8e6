"""The one write surface of every handle: ``set``, ``set_``, ``set_at_``, ``store[index] = value``,
``update``, ``update_``, ``update_at_``, ``zero_``, ``fill_`` and the write-back of in-place methods.

A handle writes a *scope* of the lazy stack the server holds: the whole stack (a lazy store, a
dense store, a dense store's sub-tree view) or one element of it (``store[i]`` of a lazy store),
below a path (``_under``).  Each handle says only how its indices and values map onto the stack
(:meth:`WriteSurface._stack_index`, :meth:`WriteSurface._stack_values`); the rest is this code,
with one rule for keys and locks on every handle:

* ``set``, ``update``, ``[key] =`` and ``[index] =`` create a key the store lacks (for every
  element: the others read as zeros, ``None`` for non-tensor data); a write of the whole stack
  may replace a key with another dtype or shape.
* ``set_``, ``update_``, ``set_at_`` and ``update_at_`` write existing keys only: ``KeyError``
  naming the first missing key, before anything is written.
* a locked handle (an element view: its store) refuses new keys (``RuntimeError``, unless
  ``ignore_lock``) and writes existing keys in place, each keeping its dtype and shape.

Every write is planned by ``_plan.write_plan`` from the cached header and runs as one atomic call of the
engine, in :meth:`WriteSurface._run_write` (the one place that takes the element-write fast path).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass

from tdstore._format.schema import RAGGED, Header, NestedPath
from tdstore._front.common import LOCK_ERROR, only_keys, refuse_ellipsis_into_features
from tdstore._front.identity import StoreIdentity
from tdstore._plan import element_write, write_plan
from tdstore._plan.index import normalize, plan, storage_rows
from tdstore._plan.values import as_path, display, leaves_of, refuse_unshown, subtree_conflicts, subtree_layout


class WriteSurface(StoreIdentity):
    """Writes of keys, rows and elements of the handle's scope, each one atomic call."""

    _element: int | None = None  # the element of the stack the scope is (fills address it), None: every element
    _whole_stack: bool = True  # whether the scope, unindexed, is every element (False: one element)

    # -- how the handle maps onto the stack (the views override these) -----------------------
    def _stack_index(self, index: Any) -> Any:
        """The index of the stack that ``index`` of this handle is."""
        raise NotImplementedError

    def _stack_values(self, items: dict[NestedPath, Any], whole: bool) -> dict[NestedPath, Any]:
        """The values as the stack holds them (``whole``: a write of the whole scope)."""
        return items

    @property
    def _writes_locked(self) -> bool:
        """The lock that governs this handle's writes (its own; an element view's is its store's)."""
        return self.is_locked

    # -- the one write ------------------------------------------------------------------------
    def _leaves(self, value: Any, key: NestedPath = ()) -> dict[NestedPath, Any]:
        """The leaves of ``value`` written at ``key`` of this handle, by full path in the store."""
        return leaves_of(value, self._engine.header.stack_pos, self._under + key)

    def _write(
        self,
        items: dict[NestedPath, Any],
        index: Any = None,
        *,
        in_place: bool = False,
        must_exist: str = "",
        ignore_lock: bool = False,
        sub_from: Any = None,
    ) -> None:
        """Write ``items`` at ``index`` of the handle (None: the whole scope) in one atomic call.

        ``must_exist`` (the method's name): every key must exist (``KeyError`` otherwise).
        ``in_place``: keys keep their dtype and shape. ``sub_from``: the value whose sub-trees'
        extra batch dims the keys this write creates take on (a chat ``[5, 1]``).
        """
        new = [p for p in items if p not in self._engine.header.leaves]
        if new and must_exist:
            raise KeyError(f"key {display(new[0])!r} is not in the store ({must_exist} writes existing keys only)")
        locked = self._writes_locked and not ignore_lock
        if new and locked:
            raise RuntimeError(LOCK_ERROR)
        whole = index is None and self._whole_stack
        stack_index = (slice(None),) * len(self._engine.header.batch_size) if whole else self._stack_index(index)
        h = self._engine.header
        sub = None
        conflict = False
        if isinstance(sub_from, TensorDictBase) and (new or h.sub):
            # the value's sub-trees: their batch dims (a chat's number of messages) and tensorclasses
            sub = subtree_layout(sub_from, sub_from.batch_dims, self._under)
            conflicts = subtree_conflicts(h.sub, sub)  # other dims than the store's: a schema change
            varying = [p for p in sub if p in conflicts or RAGGED in h.sub.get(p, ())]
            refuse_unshown(sub_from, varying, self._under)  # each element's dims must show in its leaves
            conflict = bool(conflicts)
        replace = whole and not in_place and not locked  # a set() of whole keys may change their dtype or shape
        one = not new and not replace and not conflict
        self._run_write(stack_index, self._stack_values(items, whole), replace=replace, sub=sub, one_element=one)

    def _run_write(
        self, index: Any, items: dict[NestedPath, Any], *, replace: bool, sub: dict[NestedPath, tuple[int, ...]] | None, one_element: bool
    ) -> None:
        """Plan and run the write of ``items`` at ``index`` of the stack: one atomic call."""
        keys = self._engine.keys
        element = _one_element(index, self._engine.header.count) if one_element else None
        if element is None:
            self._engine.run_write(lambda h, kt: write_plan.plan_write(keys, h, index, items, kt, replace=replace, sub=sub))
            return

        def plan_call(h: Header, kt: Any) -> Any:
            # store[i] = td of existing keys: the element write's fast path, else the general planner
            fast = element_write.plan_element_write(keys, h, element, items, kt)
            return fast if fast is not None else write_plan.plan_write(keys, h, index, items, kt)

        self._engine.run_write(plan_call)

    # -- TensorDictBase's write hooks ---------------------------------------------------------
    def _set_tuple(
        self, key: tuple, value: Any, *, inplace: Any, validated: bool, non_blocking: bool = False, ignore_lock: bool = False
    ) -> TensorDictBase:
        in_place = inplace is True
        self._write(self._leaves(value, as_path(key)), in_place=in_place, must_exist="set_" if in_place else "", ignore_lock=ignore_lock)
        return self

    def _set_str(
        self, key: str, value: Any, *, inplace: Any, validated: bool, ignore_lock: bool = False, non_blocking: bool = False
    ) -> TensorDictBase:
        return self._set_tuple((key,), value, inplace=inplace, validated=validated, non_blocking=non_blocking, ignore_lock=ignore_lock)

    def _set_at_str(self, key: str, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        return self._set_at_tuple((key,), value, idx, validated=validated, non_blocking=non_blocking)

    def _set_at_tuple(self, key: tuple, value: Any, idx: Any, *, validated: bool, non_blocking: bool) -> TensorDictBase:
        refuse_ellipsis_into_features(self._engine.header, self._under + as_path(key), idx, "set_at_")
        self._write(self._leaves(value, as_path(key)), idx, in_place=True, must_exist="set_at_")
        return self

    def _setitem_index(self, index: Any, value: Any) -> None:
        if type(value) is TensorDict:  # the common store[i] = td: none of the conversions below
            pass
        elif isinstance(value, (int, float, bool, complex)) or (
            isinstance(value, torch.Tensor) and value.ndim == 0 and not isinstance(value, TensorDictBase)
        ):
            self._write(self._fill_value(index, value), index)
            return
        elif isinstance(value, torch.Tensor):
            raise TypeError("store[index] = tensor is ambiguous; write a TensorDict (or a dict of tensors) or a number")
        elif is_tensorclass(value):
            value = value.to_tensordict()
        elif not isinstance(value, (TensorDictBase, Mapping)):
            raise TypeError(
                f"store[index] = value needs a TensorDict, a tensorclass, a dict of tensors or a number, got {type(value).__name__}"
            )
        self._write(self._leaves(value), index, sub_from=value)

    def _fill_value(self, index: Any, value: Any) -> dict[NestedPath, torch.Tensor]:
        """``store[index] = number`` writes the number into every leaf of the scope at ``index`` (in each leaf's dtype)."""
        h = self._engine.header
        norm = normalize(self._stack_index(index), h.batch_size)
        p = plan(norm, h.batch_size, h.stack_pos)
        shape = tuple(storage_rows(p, h.inner).shape)
        out = {}
        for path, leaf in h.leaves.items():
            if leaf.json or path[: len(self._under)] != self._under:  # non-tensor keys are left as they are, as on a TensorDict
                continue
            if leaf.het:
                raise NotImplementedError(
                    f"filling the heterogeneous key {display(path)!r} with a number is not supported; write tensors of each element's shape"
                )
            out[path] = torch.full(shape + tuple(leaf.shape[len(h.inner) :]), value, dtype=leaf.dtype)  # type: ignore[index]  # a homogeneous leaf has a shape
        return out

    def update(  # type: ignore[override]  # no **kwargs (an unknown keyword raises), and not MutableMapping.update's signature
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
        """Write every leaf of ``input_dict_or_td`` (covering the handle's batch size) in one atomic call."""
        items = only_keys(self._leaves(input_dict_or_td), keys_to_update, self._under)
        if items:
            self._write(items, in_place=inplace, must_exist="update_" if inplace else "", ignore_lock=ignore_lock)
        return self

    def update_(  # type: ignore[override]  # no **kwargs: an unknown keyword raises
        self, input_dict_or_td: Any, clone: bool = False, *, non_blocking: bool = False, keys_to_update: Any = None
    ) -> TensorDictBase:
        return self.update(input_dict_or_td, inplace=True, keys_to_update=keys_to_update)

    def update_at_(
        self, input_dict_or_td: Any, idx: Any, clone: bool = False, *, non_blocking: bool = False, keys_to_update: Any = None
    ) -> TensorDictBase:
        """Write the leaves of ``input_dict_or_td`` at ``idx`` in one atomic call (existing keys only)."""
        items = only_keys(self._leaves(input_dict_or_td), keys_to_update, self._under)
        if items:
            self._write(items, idx, in_place=True, must_exist="update_at_")
        return self

    # -- in-place methods ---------------------------------------------------------------------
    _fills_without_reading = True

    def zero_(self) -> Any:
        """Zero every leaf on the server in one atomic call, without reading or sending the data."""
        self._fill_paths((), 0)
        return self

    def _fill_(self, key: tuple, value: Any) -> None:
        """``fill_(key, value)``: one atomic call on the server; the value is cast to each leaf's dtype, as ``Tensor.fill_`` does."""
        self._fill_paths(as_path(key), value)

    def _fill_paths(self, under: NestedPath, value: Any) -> None:
        """Fill every leaf below ``under`` (relative to the handle) of the scope with ``value``, on the server."""
        keys = self._engine.keys
        full, element = self._under + under, self._element

        def plan_call(h: Header, kt: Any) -> Any:
            paths = [p for p in h.leaves if p[: len(full)] == full]
            if not paths:
                raise KeyError(f"key {display(under) if under else display(self._under)!r} is not in the store")
            return write_plan.plan_fill(keys, h, paths, value, kt, element=element)

        self._engine.run_write(plan_call)

    def _inplace_on_copies(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Other in-place methods (``add_``, ``apply_``, ``clamp_``...): one read, a local update, one write.

        Two round trips, each atomic, but not atomic together: a write by another
        process between them is overwritten. ``zero_`` and ``fill_`` run on the server.
        """
        local = self.to_tensordict()
        result = method(local, *args, **kwargs)
        if result is not local:
            return result
        self._write_local(local)
        return self

    def apply_(self, fn: Any, *others: Any, **kwargs: Any) -> Any:
        """``fn`` on every leaf of a local copy, written back (one read, one write; see ``_inplace_on_copies``)."""
        return self._inplace_on_copies(lambda local: local.apply_(fn, *others, **kwargs))

    def _write_back(self, keys: Any, values: Any, method: str) -> None:
        """Results of in-place methods written back in one call (keys keep their dtype and shape)."""
        if keys:
            self._write({self._under + as_path(k): v for k, v in zip(keys, values)}, in_place=True)

    def _write_local(self, local: TensorDictBase) -> None:
        self._write(self._leaves(local), in_place=True)


def _one_element(index: Any, count: int) -> int | None:
    """The element an index of the stack writes whole (an int, alone or in a 1-tuple), or None."""
    i = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if isinstance(i, int) and not isinstance(i, bool):
        return i % count if -count <= i < count else i
    return None
