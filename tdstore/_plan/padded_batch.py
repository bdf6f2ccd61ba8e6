"""Padded or nested batches of rows that also hold non-tensor keys and sub-trees of varying batch dims.

``sample(n, as_padded_tensor=True)`` (or ``as_nested_tensor=True``, ``return_mask=...``) of a lazy ring
gives one TensorDict of batch ``[n]``: its tensor keys padded (or jagged) from the raw bytes
(``_format.ragged``); what cannot be one tensor is kept as a ``LazyStackStorage`` batch holds it:

* a non-tensor key (strings, JSON values): a ``NonTensorStack`` of the rows' values
  (``td["prompt"]`` is the list of prompts);
* a sub-tree whose batch dims vary between rows (a chat ``History`` of 2, 3, 4 messages,
  ``Header.sub`` ``RAGGED``): the lazy stack of the rows' sub-trees, in their tensorclass
  (``td["history"]`` is a ``History`` of batch ``[n, -1]``), its leaves never padded.

Masks (``return_mask``) cover the padded tensor keys only, as ``tensordict.pad_sequence`` puts them.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor, is_tensorclass, lazy_stack
from tensordict.base import _is_leaf_nontensor

from tdstore._format import ragged
from tdstore._format.schema import RAGGED, Header, NestedPath
from tdstore._plan.values import as_path, columns_maker


def varying_root(h: Header, path: NestedPath) -> NestedPath | None:
    """The outermost sub-tree holding leaf ``path`` whose batch dims vary between elements, else None."""
    for k in range(1, len(path)):
        dims = h.sub_dims.get(path[:k])
        if dims is not None and RAGGED in dims:
            return path[:k]
    return None


def rest(h: Header, per_el: dict[NestedPath, list[Any]], n: int, device: torch.device | None) -> dict[NestedPath, Any] | None:
    """The per-row leaves a padded batch cannot pad (``per_el``: one value per row), as values of batch
    ``[n]`` by path (non-tensor keys stacked, each varying sub-tree one lazy stack at its root's path);
    None when one is a tensor key outside such a sub-tree (rows differing beyond their first dim: the
    caller keeps the lazy stack)."""
    out: dict[NestedPath, Any] = {}
    groups: dict[NestedPath, list[NestedPath]] = {}
    for path, values in per_el.items():
        root = varying_root(h, path)
        if root is not None:
            groups.setdefault(root, []).append(path)
        elif not h.leaves[path].json:
            return None
        else:
            out[path] = torch.stack(values) if values else values
    for root, paths in groups.items():
        rows = columns_maker(paths, 0, torch.Size(h.inner), device, h.sub_dims)({p: per_el[p] for p in paths}, n)
        out[root] = lazy_stack([row.get(root) for row in rows])
    return out


def check_padding(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` when they are padding keywords :func:`pad_rows` takes (``as_padded_tensor=True`` or
    ``as_nested_tensor=True``, with ``padding_side``, ``padding_value``, ``layout``, ``return_mask``), else
    ``TypeError``/``ValueError`` naming them: a caller checks before it reads anything."""
    unknown = set(kwargs) - ragged.KEYWORDS
    if unknown:
        raise TypeError(f"unexpected keywords {sorted(unknown)}; the padding keywords are {sorted(ragged.KEYWORDS)}")
    if kwargs and not ragged.wanted(kwargs):
        raise TypeError(
            f"padding takes as_padded_tensor=True or as_nested_tensor=True (with {sorted(ragged.KEYWORDS)}), got {sorted(kwargs)}"
        )
    if kwargs.get("return_mask") and kwargs.get("as_nested_tensor"):
        raise ValueError("return_mask goes with as_padded_tensor=True, not as_nested_tensor (a nested tensor knows its lengths)")
    return kwargs


def pad_rows(td: Any, kwargs: dict[str, Any]) -> Any:
    """A lazy stack of rows (along dim 0, what a ragged buffer's ``rb.sample()`` gives) as one TensorDict of
    batch ``[n]`` laid out as :func:`rest` and ``sample(..., as_padded_tensor=True)`` of a store lay it out:
    tensor keys padded (``padding_side``, ``padding_value``; ``return_mask`` adds their masks) or jagged
    (``as_nested_tensor``), non-tensor keys stacked, sub-trees whose batch dims differ between rows kept
    as the lazy stack of the rows' sub-trees (their tensorclass kept). Anything else comes back as it is."""
    check_padding(kwargs)
    if not isinstance(td, LazyStackedTensorDict) or td.stack_dim != 0 or isinstance(td, NonTensorStack):
        return td
    masks: dict[NestedPath, torch.Tensor] = {}
    out = _pad_level(list(td.tensordicts), (), kwargs, masks)
    if kwargs.get("return_mask"):
        root = ragged.mask_root(kwargs, [as_path(k) for k in td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor)])
        for path, m in masks.items():
            out.set((*root, *path), m)
    return out


def _pad_level(rows: list[Any], prefix: NestedPath, kwargs: dict[str, Any], masks: dict[NestedPath, torch.Tensor]) -> Any:
    """The rows' nodes at ``prefix`` (TensorDicts or tensorclasses of one batch size) as one node of batch ``[n, *theirs]``."""
    first = rows[0]
    cls = type(first) if is_tensorclass(first) else None
    inner = [r._tensordict if cls is not None else r for r in rows]
    n = len(rows)
    out: dict[str, Any] = {}
    for key in inner[0].keys():
        values = [r._get_str(key, None) for r in inner]
        path = (*prefix, key)
        v0 = values[0]
        if is_non_tensor(v0):
            out[key] = torch.stack(values)
        elif isinstance(v0, torch.Tensor) and not isinstance(v0, TensorDictBase):
            out[key] = _pad_tensors(values, path, kwargs, masks)
        elif (type(v0) is TensorDict or is_tensorclass(v0)) and len({tuple(v.batch_size) for v in values}) == 1:
            out[key] = _pad_level(values, path, kwargs, masks)  # a sub-tree of one batch size: padded as the rows
        else:  # a sub-tree whose batch dims differ between rows (a chat of several lengths): as LazyStackStorage keeps it
            out[key] = lazy_stack(values)
    td = TensorDict(out, batch_size=[n, *first.batch_size], device=first.device)
    return cls._from_tensordict(td) if cls is not None else td


def _pad_tensors(
    values: list[torch.Tensor], path: NestedPath, kwargs: dict[str, Any], masks: dict[NestedPath, torch.Tensor]
) -> torch.Tensor:
    """One padded (or jagged) tensor of the rows' tensors for ``path`` (stacked when they all have one shape)."""
    shapes = {tuple(v.shape) for v in values}
    if kwargs.get("as_nested_tensor"):
        if len(shapes) == 1:
            return torch.stack(values)
        return torch.nested.as_nested_tensor(values, layout=kwargs.get("layout") or torch.jagged)
    lens = torch.tensor([v.shape[0] if v.ndim else 1 for v in values])
    if len(shapes) == 1:
        stacked = torch.stack(values)
        if kwargs.get("return_mask") and stacked.ndim > 1:
            masks[path] = torch.ones(stacked.shape[:2], dtype=torch.bool)
        return stacked
    if len({s[1:] for s in shapes}) != 1 or any(v.ndim == 0 for v in values):
        raise ValueError(
            f"key {path if len(path) > 1 else path[0]!r}: rows of shapes {sorted(shapes)[:4]} differ beyond their first dim; "
            "as_padded_tensor pads the first dim only"
        )
    side = kwargs.get("padding_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
    longest = int(lens.max())
    out = values[0].new_full((len(values), longest, *values[0].shape[1:]), kwargs.get("padding_value", 0.0))
    steps = torch.arange(longest)
    mask = steps < lens[:, None] if side == "right" else steps >= (longest - lens)[:, None]
    out[mask] = torch.cat(values)
    if kwargs.get("return_mask"):
        masks[path] = mask
    return out
