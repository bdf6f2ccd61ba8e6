"""The read side of ``LazyStackedTensorDictStore``: rows, ``get`` of a key, whole-store reads.

Every read is one atomic call of the engine; heterogeneous keys asked for as one padded or
jagged tensor are read without a tensor per element (``_format.ragged``).  Indexing that picks one
whole element gives a write-through ``ElementView`` instead (``lazy``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, cat, lazy_stack
from tensordict.base import NO_DEFAULT

from tdstore._engine.engine import Engine
from tdstore._format import ragged
from tdstore._format.schema import NestedPath
from tdstore._front.common import refuse_ellipsis_into_features
from tdstore._front.progress import progress
from tdstore._front.state import LazyState
from tdstore._plan.index import MASK_DTYPES, normalize, plan
from tdstore._plan.values import as_path, assemble, display, gc_paused


class LazyReads(LazyState):
    """Reads of the stack, of keys, of rows and of whole elements."""

    def _element_of(self, index: Any) -> int | None:
        """The element id when ``index`` picks exactly one whole element, else None."""
        h = self._engine.header
        if isinstance(index, (str, tuple)) and (isinstance(index, str) or any(isinstance(i, str) for i in index)):
            return None
        if isinstance(index, (np.integer, torch.Tensor)) and not isinstance(index, bool) and getattr(index, "ndim", 0) == 0:
            if not (isinstance(index, torch.Tensor) and (index.dtype in MASK_DTYPES or index.is_floating_point() or index.is_complex())):
                index = int(index)
        if h.stack_pos == 0 and isinstance(index, int) and not isinstance(index, bool):
            if not -h.count <= index < h.count:
                raise IndexError(f"index {index} is out of range for a store of {h.count} elements")
            return index % h.count
        if isinstance(index, tuple) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            norm = normalize(index, h.batch_size)
            p = plan(norm, h.batch_size, h.stack_pos)
            if p.element_int and p.inner_full:
                return int(p.elements[0])
        return None

    def _read_index(self, index: Any, paths: list[NestedPath] | None = None, under: NestedPath = (), strip: bool = True) -> TensorDictBase:
        """Read ``paths`` (default: every leaf below ``under``) at ``index`` in one call.

        With ``strip`` the result is the sub-tree below ``under``; without it, the
        leaves keep their full paths.
        """
        # a large read makes many small objects (views, TensorDicts): with the cyclic GC paused
        # meanwhile, it does not walk every live object of the program several times over
        with gc_paused():
            planned, result = self._engine.read(index, paths, under=under)
            h = self._engine.header
            return assemble(planned, result, h.inner, self._device, under if strip else (), h.sub_dims)

    def _index_tensordict(self, index: Any, new_batch_size: Any = None, names: Any = None) -> TensorDictBase:
        return self._read_index(index)

    def _read_key(self, path: NestedPath, default: Any, **kwargs: Any) -> Any:
        h = self._header
        try:
            if path in h.leaves:
                leaf = h.leaves[path]
                if leaf.het and ragged.wanted(kwargs):
                    fast = self._read_ragged(path, np.arange(h.count, dtype=np.int64), kwargs)
                    if fast is not None:
                        return fast
                if leaf.het or kwargs:
                    return self._get_local(self._read_index(slice(None), [path]), path, kwargs)
                planned, result = self._engine.read(slice(None), [path])
                t = result.leaves[path]  # type: ignore[union-attr]  # one homogeneous leaf reads as a DenseResult
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
        round trip and without a tensor per element (see ``_format.ragged``); None when the fast way does not
        apply (elements with inner batch dims or that differ beyond their first dim, a strided layout)."""
        h = self._header
        if h.inner or h.stack_pos != 0:
            return None
        raw = self._engine.read_ragged(path, ids)
        if raw is None:
            return None
        out = ragged.build(*raw, kwargs)
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
            ragged.check_mask(kwargs, display(path), scalars=leaf is not None and not leaf.het and not leaf.shape)
        out = td.get(display(path), **{k: v for k, v in kwargs.items() if k != "return_mask"})
        return out, torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)

    def _ragged_ids(self, idx: Any) -> np.ndarray | None:
        """The element ids of a one-dim index along the stack (a slice, list, index tensor or mask), in its order."""
        h = self._header
        if isinstance(idx, (int, np.integer)) or h.inner or (isinstance(idx, torch.Tensor) and idx.ndim != 1):
            return None
        norm = normalize(idx, h.batch_size)
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
        refuse_ellipsis_into_features(self._header, path, idx, "get_at")
        leaf = self._header.leaves.get(path)
        if leaf is not None and leaf.het and ragged.wanted(kwargs):
            ids = self._ragged_ids(idx)
            fast = self._read_ragged(path, ids, kwargs) if ids is not None and ids.size else None
            if fast is not None:
                return fast
        if kwargs.get("return_mask") and self._ragged_ids(idx) is None:  # one element: nothing to mask
            ragged.check_mask(kwargs, display(path))
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
        return cat(parts, dim=sp)

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
        """``clone()`` is an in-memory copy (``to_tensordict()``, ``pbar=True`` for a progress bar).

        ``clone(False)`` is a new handle on the same store.
        """
        if recurse:
            return self.to_tensordict(pbar=pbar)
        engine = Engine(self._engine.spec, self._engine.keys, self._engine.client, owns_client=False, readonly=self._engine.readonly)
        engine.set_header(self._engine.header)
        return type(self)._from_engine(engine, backend=self._backend, device=self._device, cache_metadata=self._cache_metadata)
