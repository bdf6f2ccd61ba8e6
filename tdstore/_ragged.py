"""Padded and jagged tensors of a heterogeneous leaf, built from its raw bytes and shape records.

A learner reading token sequences wants one padded tensor (and the lengths) or one jagged
nested tensor, not one tensor per element: ``Engine.read_ragged`` returns the elements'
bytes back to back in one buffer with their shape records, and this module turns them into
the result with a handful of vectorised torch ops (one copy of the bytes), whatever the
number of elements. The results are those of ``LazyStackedTensorDict.get(key,
as_padded_tensor=True)`` / ``get(key, as_nested_tensor=True)`` (``pad_sequence`` /
``torch.nested.as_nested_tensor`` with the jagged layout) on the same elements.

Elements that differ in more than their first dim (or a leaf of no dims) are not handled
here (``None``): the caller reads them the usual way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _codec
from ._schema import Leaf

#: The keywords of ``get``/``get_at`` this module answers.
KEYWORDS = frozenset({"as_padded_tensor", "as_nested_tensor", "padding_side", "padding_value", "layout"})


def wanted(kwargs: dict[str, Any]) -> bool:
    """Whether a read's keywords ask for one padded or nested tensor (and nothing this module does not know)."""
    return bool(kwargs.get("as_padded_tensor") or kwargs.get("as_nested_tensor")) and set(kwargs) <= KEYWORDS and not kwargs.get("as_list")


def build(leaf: Leaf, shapes: np.ndarray, data: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The padded or jagged tensor of the elements whose shape records are ``shapes`` (n, ndim) and whose
    bytes are ``data``, back to back; None when they differ beyond their first dim."""
    n, ndim = shapes.shape
    if ndim == 0 or n == 0:
        return None
    rest = shapes[:, 1:]
    if (rest != rest[0]).any():
        return None
    padding_side = kwargs.get("padding_side", "right")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    rest_shape = tuple(int(x) for x in rest[0])
    lens = torch.from_numpy(shapes[:, 0].copy())
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    total = int(offsets[-1])
    values = _codec.from_bytes(data, leaf.dtype, (total, *rest_shape)) if total else torch.zeros((0, *rest_shape), dtype=leaf.dtype)
    if kwargs.get("as_nested_tensor"):
        layout = kwargs.get("layout")
        if layout not in (None, torch.jagged):
            return None  # a strided nested tensor: made the usual way
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    longest = int(lens.max())
    out = torch.empty((n, longest, *rest_shape), dtype=leaf.dtype).fill_(kwargs.get("padding_value", 0.0))  # (torch.full is far slower)
    if total:
        # the cells that hold data, row by row: one masked copy of every value (no loop, no index tensors)
        steps = torch.arange(longest)
        mask = steps < lens[:, None] if padding_side == "right" else steps >= (longest - lens)[:, None]
        out.masked_scatter_(mask.view(n, longest, *([1] * len(rest_shape))).expand_as(out), values)
    return out
