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
from tensordict import lazy_stack

from tdstore._format.schema import RAGGED, Header, NestedPath
from tdstore._plan.values import columns_maker


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
