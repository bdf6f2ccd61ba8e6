"""The writes of a :class:`~tdstore.torchrl.StoreStorage`: data (tensors, tensordicts, tensorclasses,
pytrees) as rows, ``extend`` of the ring, ``set`` at torchrl's cursor or in place, and torchrl's
``update_if_present``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass, lazy_stack
from tensordict.utils import unravel_key_list
from torch.utils._pytree import tree_flatten

from tdstore import ShardedRing
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import RingState, index_positions
from tdstore.torchrl.storage_base import (
    METADATA_KEYS,
    TENSOR_KEY,
    TREE_KEY,
    StorageBase,
    _eager,
    _flip,
    _from_the_end,
    _only_dicts,
    has_keys,
)


class StorageWrites(StorageBase):
    """Rows into the ring: the writes of a :class:`~tdstore.torchrl.StoreStorage` (see there)."""

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
        slots, one = index_positions(cursor, bound)  # a mask means what it means to indexing
        rows = self._to_rows((data.unsqueeze(0) if hasattr(data, "unsqueeze") else [data]) if one else data)
        if set_cursor:
            self._set_at_cursor(slots, rows)
            return

        self._write_in_place(slots, rows)

    def _set_cells(self, index: tuple, data: Any) -> None:
        """``rb[(i, j)] = data`` of an ndim>1 storage: the dim-0 rows read, changed here and written back
        (two atomic calls: a write another process makes to those rows in between is lost)."""
        first, rest = index[0], index[1:]
        slots, _ = index_positions(first, self._dim0)
        slots = slots.unique()
        local = self.with_store(lambda s: self._read(s, slots))
        where = torch.searchsorted(slots, index_positions(first, self._dim0)[0])
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

    def _wait_for_writers(self, first: int, state: RingState) -> RingState:
        """New slots ahead of the cursor of a ring not full yet: processes sharing this writer's cursor (torchrl's
        writers keep it in shared memory across a fork) are writing the slots before them.  Wait, on the store's
        events, until the ring has written up to ``first`` (at most ``wait_for_writers`` seconds); then the slots
        continue the cursor.  Returns the ring state then (the same when the wait ran out: the caller refuses)."""
        try:
            return self.with_store(lambda s: s.wait_for(written=min(int(first), s.capacity), timeout=self.wait_for_writers))
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
        if path not in s.key_specs():
            raise KeyError(f"Key {key} does not exist in the storage. Conditional patches can only target existing tensor fields.")
        return self.with_store(lambda st: st.get(key))

    def _validate_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """torchrl's checks (dtype, feature shape) from the cached schema: no round trip."""
        specs = self._store.key_specs()
        n_rows = index.shape[0] if index.ndim > 1 else index.numel()
        out = {}
        for key, value in patch.items():
            path = (key,) if isinstance(key, str) else tuple(key)
            leaf = specs.get(path)
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

    def _write_rows(self, fn: Callable[[LazyStackedTensorDictStore], Any]) -> None:
        """An in-place write (``fn`` writes the store once, as ``storage[:]``'s rows, ``rb[i] = td`` and torchrl's
        writers writing written slots do): the rows and the header's ``tr``, which every process's
        ``_mutation_revision`` reads, in the same atomic call (one round trip)."""

        def counted(s: LazyStackedTensorDictStore) -> Any:
            with s.counting_in_place():
                return fn(s)

        self.with_store(counted)

    @staticmethod
    def _written_only(s: LazyStackedTensorDictStore, index: Any, written: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The slots ``index`` names on a sharded ring not full: negative positions and masks along its written
        slots; slots it has not written raise ``IndexError`` (never rows of zeros), naming the samplers that
        draw written slots."""
        if _from_the_end(index):
            at, one = index_positions(index, int(written.numel()))
            return written[at], one
        slots, one = index_positions(index, s.capacity)
        unwritten = slots[~torch.isin(slots, written)]
        if unwritten.numel():
            raise IndexError(
                f"slots {sorted(set(unwritten.tolist()))[:8]} of the sharded ring td_id={s.td_id!r} are not written yet: "
                f"until every shard is full its {written.numel()} written slots are not range(len) (shards fill in turn), "
                "so torchrl's SamplerWithoutReplacement cannot draw them; tdstore's samplers (StoreSampler, "
                "StoreSamplerWithoutReplacement, StorePrioritizedSampler) and torchrl's RandomSampler draw written slots"
            )
        return slots, one

    def _read(
        self, s: LazyStackedTensorDictStore, index: Any, written: torch.Tensor | None = None, *, written_only: bool = False
    ) -> TensorDictBase:
        """The rows at ``index``. ``written``: the written slots of a sharded ring not full, when the caller has
        read them already (else they are read here, one round trip until every shard is full).

        ``written_only`` (``storage[index]``): as a ``LazyTensorStorage``, which indexes its written rows,
        a position past them raises ``IndexError`` instead of reading a slot never written (one round trip
        for the ring's length until this handle has seen it full); a position tensor of several dims
        gives rows of its shape. Writes (``written_only=False``) address every slot, as torchrl's do."""
        if not has_keys(s):
            raise RuntimeError("Cannot get elements out of an empty storage (nothing was written yet)")
        if isinstance(index, torch.Tensor) and index.ndim == 1 and index.numel() == 0:
            return s[0:0]
        # as a LazyTensorStorage's, negative positions and masks are taken along the written slots only
        if written is None and self.ndim == 1:
            written = self._sharded_written(s)
        if written is not None:  # a sharded ring not full: its written slots are not range(len) (see written_slots)
            slots, one = self._written_only(s, index, written)
        elif written_only:
            # a sharded ring here is full (written is None): every slot is written, nothing to ask
            sharded_full = self.ndim == 1 and isinstance(s, ShardedRing)
            slots, one = index_positions(index, s.capacity if sharded_full else self._written_slots(s))
        else:
            bound = self._len_along_dim0 if _from_the_end(index) else self._dim0
            slots, one = index_positions(index, bound)
        got = s[slots]
        if one:
            return got[0]
        shape = _positions_shape(index) if written_only else None
        return got if shape is None else got.reshape(*shape, *got.batch_size[1:])


def _positions_shape(index: Any) -> tuple[int, ...] | None:
    """The shape of a position tensor (or nested list, or array) of several dims, which torch gives the
    rows it selects; None for any other index (its rows come back as one dim)."""
    if isinstance(index, list):
        index = torch.as_tensor(index)
    if isinstance(index, np.ndarray):
        index = torch.from_numpy(index)
    if isinstance(index, torch.Tensor) and index.ndim > 1 and index.dtype not in (torch.bool, torch.uint8):
        return tuple(index.shape)
    return None
