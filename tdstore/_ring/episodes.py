"""The per-row trajectory ids or end flags a ring write passes to ``write.lua`` ('J' op) on a ring
with trajectories (``set_trajectories``), so the server keeps its episode index (``lua/_episodes.lua``)
in the same atomic call. Computed here, on the client, from the rows being written, before anything
is sent: a batch without the key, or whose key is not one integer or flag per row, raises here."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, NestedPath
from tdstore._format.trajectories import Trajectories


def _name(path: NestedPath) -> Any:
    return path[0] if len(path) == 1 else path


def row_values(t: Trajectories, items: dict[NestedPath, Any], n: int, stack_pos: int) -> np.ndarray:
    """The key's value of each of the ``n`` rows written (int64 ids, or bools for end flags)."""
    value = items.get(t.key)
    if value is None:
        raise KeyError(
            f"this ring keeps trajectories by {t.describe()} (set_trajectories): every extend must carry the key "
            f"{_name(t.key)!r}, which this batch has not"
        )
    if isinstance(value, (list, tuple)):
        rows = [torch.as_tensor(v).reshape(-1) for v in value]
        if any(r.numel() != 1 for r in rows):
            raise ValueError(f"the trajectory key {_name(t.key)!r} must hold one value per row")
        flat = torch.cat(rows) if rows else torch.empty(0)
    elif isinstance(value, torch.Tensor):
        flat = value.movedim(stack_pos, 0).reshape(n, -1) if value.ndim else value.reshape(1, 1)
        if flat.shape[0] != n or (t.by == "id" and flat.shape[1] != 1):
            raise ValueError(f"the trajectory key {_name(t.key)!r} must hold one id per row, got shape {list(value.shape)} for {n} rows")
        flat = flat.any(-1) if t.by == "end" else flat[:, 0]
    else:
        raise TypeError(f"the trajectory key {_name(t.key)!r} must be a tensor, got {type(value).__name__}")
    if flat.is_floating_point() or flat.is_complex():
        if t.by == "id" or bool((flat != flat.round()).any()):
            raise TypeError(f"the trajectory key {_name(t.key)!r} must hold integers or bools, got dtype {flat.dtype}")
    if t.by == "end":
        return (flat != 0).numpy().astype(np.bool_)
    return flat.to(torch.int64).numpy()


def packed(t: Trajectories, values: np.ndarray) -> bytes:
    """What ``write.lua``'s 'J' op takes: ids as little-endian int64, end flags as one byte each."""
    if t.by == "end":
        return values.astype(np.uint8).tobytes()
    return values.astype("<i8").tobytes()


def episode_op(kt: KeyTable, episodes_key: str, h: Header, items: dict[NestedPath, Any], n: int) -> list[Any]:
    """The 'J' op of a ring write on a ring with trajectories ([] on a ring without)."""
    t = h.trajectories
    if t is None:
        return []
    return Write.J(kt.ref(episodes_key), packed(t, row_values(t, items, n, h.stack_pos)))
