"""Padded batches of rows that differ in shape, for code outside a store (torchrl buffers, a learner).

:func:`pad_rows` lays out a lazy stack of rows (a ragged buffer's sample, ``store[idx]``) as a store's
``sample(n, as_padded_tensor=True)`` does: tensor keys padded (or jagged with ``as_nested_tensor``),
non-tensor keys as ``NonTensorStack``, sub-trees whose batch dims differ between rows (a chat
``History``) as lazy stacks in their class. :data:`KEYWORDS` are the keywords it takes.
"""

from __future__ import annotations

from tdstore._format.ragged import KEYWORDS, wanted
from tdstore._plan.padded_batch import pad_rows

__all__ = ["KEYWORDS", "pad_rows", "wanted"]
