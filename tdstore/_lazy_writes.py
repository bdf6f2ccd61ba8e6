"""The write side of ``LazyStackedTensorDictStore``: ``set``, ``store[index] = value``, ``update`` and fills.

Each write is planned by ``_writes`` from the cached header and runs as one atomic call of the
engine.  A locked store writes its existing keys in place and refuses new ones.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass

from . import _index, _writes
from ._common import LOCK_ERROR, only_keys
from ._lazy_state import LazyState
from ._schema import Header, NestedPath
from ._values import as_path, display, leaves_of, subtree_dims


class LazyWrites(LazyState):
    """Writes of keys, rows and elements, each one atomic call."""

    def _check_writable(self, path: NestedPath, *, new: bool, ignore_lock: bool = False) -> None:
        if self.is_locked and not ignore_lock and new:
            raise RuntimeError(LOCK_ERROR)

    def _write(
        self, index: Any, items: dict[NestedPath, Any], *, replace: bool = False, sub: dict[NestedPath, tuple[int, ...]] | None = None
    ) -> None:
        keys = self._engine.keys
        self._engine.run_write(lambda h, kt: _writes.plan_write(keys, h, index, items, kt, replace=replace, sub=sub))

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
        if type(value) is TensorDict:  # the common store[i] = td: none of the conversions below
            pass
        elif isinstance(value, (int, float, bool, complex)) or (
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

    def update_(  # type: ignore[override]  # no **kwargs: an unknown keyword raises
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
