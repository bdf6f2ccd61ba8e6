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

``return_mask=True`` (the name ``tensordict.pad_sequence`` uses) also gives the mask of the cells
that hold data, ``(n, longest)`` bool, True on the data side of each row: ``get``/``get_at`` then
return ``(padded, mask)``, and a sample holds it under ``("masks", key)`` (or under the key
``return_mask`` names), as ``pad_sequence`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tdstore._format import codec
from tdstore._format.schema import Leaf

#: The keywords of ``get``/``get_at`` this module answers.
KEYWORDS = frozenset({"as_padded_tensor", "as_nested_tensor", "padding_side", "padding_value", "layout", "return_mask"})


def wanted(kwargs: dict[str, Any]) -> bool:
    """Whether a read's keywords ask for one padded or nested tensor (and nothing this module does not know)."""
    return bool(kwargs.get("as_padded_tensor") or kwargs.get("as_nested_tensor")) and set(kwargs) <= KEYWORDS and not kwargs.get("as_list")


def check_mask(kwargs: dict[str, Any], key: Any, scalars: bool = False) -> None:
    """Refuse ``return_mask`` where it cannot apply: without ``as_padded_tensor=True``, elements of no
    dims (``scalars``), or a key not read as one padded tensor of elements differing in their first dim."""
    if not kwargs.get("return_mask"):
        return
    if kwargs.get("as_nested_tensor"):
        raise ValueError(
            f"return_mask goes with as_padded_tensor=True, not as_nested_tensor (a nested tensor knows its lengths), for key {key!r}"
        )
    if not kwargs.get("as_padded_tensor"):
        raise ValueError(f"return_mask goes with as_padded_tensor=True, for key {key!r}")
    if scalars:
        raise ValueError(f"return_mask: the elements of {key!r} have no dims to pad")
    raise ValueError(
        f"return_mask needs a batch of elements of {key!r} that differ in their first dim only, stacked along "
        "the store's first dim (the mask marks the data along that dim)"
    )


def mask_root(kwargs: dict[str, Any], paths: Any) -> tuple[str, ...]:
    """Where a sample keeps its masks: ``("masks",)``, or the key ``return_mask`` names (a str or a tuple
    of str), which must not be one of the store's keys or hold one (``paths``)."""
    want = kwargs.get("return_mask")
    root = ("masks",) if want is True else (want,) if isinstance(want, str) else want
    if not isinstance(root, tuple) or not root or not all(isinstance(k, str) for k in root):
        raise TypeError(f"return_mask takes True, a key or a tuple of keys, got {want!r}")
    if any(p[: len(root)] == root or root[: len(p)] == p for p in paths):
        raise ValueError(f"return_mask would put the masks under {root!r}, where the store has keys: pass return_mask='another_key'")
    return root


def build(leaf: Leaf, shapes: np.ndarray, data: Any, kwargs: dict[str, Any]) -> Any:
    """The padded or jagged tensor of the elements whose shape records are ``shapes`` (n, ndim) and whose
    bytes are ``data``, back to back (with ``return_mask``: ``(padded, mask)``); None when they differ
    beyond their first dim."""
    n, ndim = shapes.shape
    key = leaf.path[0] if len(leaf.path) == 1 else leaf.path
    if kwargs.get("return_mask") and kwargs.get("as_nested_tensor"):
        check_mask(kwargs, key)
    if ndim == 0 or n == 0:
        check_mask(kwargs, key, scalars=ndim == 0)
        return None
    rest = shapes[:, 1:]
    if (rest != rest[0]).any():
        check_mask(kwargs, key)
        return None
    padding_side = kwargs.get("padding_side", "right")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    rest_shape = tuple(int(x) for x in rest[0])
    lens = torch.from_numpy(shapes[:, 0].copy())
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    total = int(offsets[-1])
    values = codec.from_bytes(data, leaf.dtype, (total, *rest_shape)) if total else torch.zeros((0, *rest_shape), dtype=leaf.dtype)
    if kwargs.get("as_nested_tensor"):
        layout = kwargs.get("layout")
        if layout not in (None, torch.jagged):
            return None  # a strided nested tensor: made the usual way
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    longest = int(lens.max())
    out = torch.empty((n, longest, *rest_shape), dtype=leaf.dtype).fill_(kwargs.get("padding_value", 0.0))  # (torch.full is far slower)
    # the cells that hold data, row by row: one masked copy of every value (no loop, no index tensors)
    steps = torch.arange(longest)
    mask = steps < lens[:, None] if padding_side == "right" else steps >= (longest - lens)[:, None]
    if total:
        out.masked_scatter_(mask.view(n, longest, *([1] * len(rest_shape))).expand_as(out), values)
    return (out, mask) if kwargs.get("return_mask") else out
