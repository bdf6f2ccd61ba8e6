"""Progress bars for operations that can take more than a second (uploads, chunked downloads).

tqdm is optional: without it, ``pbar=True`` runs the operation without a bar
rather than failing, since the bar is a convenience and never changes a result.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any


def progress(enabled: bool, total: int, desc: str, unit: str = "el") -> Any:
    """A context manager giving a tqdm bar (``update(n)``), or ``None`` when disabled or tqdm is missing."""
    if not enabled:
        return nullcontext(None)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return nullcontext(None)
    return tqdm(total=total, unit=unit, desc=desc)
