"""The arguments that ring calls share: batch sizes, generations and the one-slot rule.

``_ring.extend`` (writes), ``_ring.sample_pop`` (samples, pops) and ``_ring.policy_calls`` (priority updates) check
their arguments with these, before anything is sent. Slot indices mean what they mean to
indexing: ``_plan.index.positions``.
"""

from __future__ import annotations

from typing import Any

import torch

from tdstore._engine.engine import Engine


def refuse_spread(engine: Engine) -> None:
    """Ring calls reserve slots and pick rows on the server, over every segment at once: one slot only."""
    if engine.header.spread:
        raise NotImplementedError(
            f"the store with {engine.where()} is spread over several cluster nodes (spread='segments'); the ring buffer "
            "(extend, sample, update_if) needs every segment in one slot: create the store without spread=, or as a "
            "sharded ring (tdstore.ShardedRing(count=N, url=...))"
        )


#: The most rows one ``sample`` or ``pop`` call takes. A sample allocates its draws on the client before
#: anything is sent (``sample(10**8)``: 2.6 GB), and the server draws and reads every row in one script
#: (65,536 rows: 53-294 ms, lua/README.md, Worst cases; 10^7 rows held the server past its 5 s BUSY limit):
#: larger batches are asked for in several calls.
MAX_BATCH = 1 << 20


def check_batch_size(batch_size: Any, what: str) -> None:
    """``sample``'s and ``pop``'s batch size: an int from 1 to :data:`MAX_BATCH` (``ValueError`` naming the
    call otherwise), checked before anything is allocated or sent."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"{what} needs a positive int batch_size, got {batch_size!r}")
    if batch_size > MAX_BATCH:
        raise ValueError(
            f"{what} takes at most {MAX_BATCH:,} rows per call (one call holds the server for all of them), "
            f"got batch_size={batch_size:,}: take them in several calls"
        )


def check_request_id(request_id: Any) -> str | None:
    """A caller's ``request_id=`` (the ``request_id`` of an ``AmbiguousTimeoutError``, or one of its own):
    None, or 16 to 64 hex digits, as the scripts take it (``lua/_lib.lua`` ``tds_request``)."""
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not 16 <= len(request_id) <= 64 or any(c not in "0123456789abcdefABCDEF" for c in request_id):
        raise ValueError(
            f"request_id must be 16 to 64 hex digits (an AmbiguousTimeoutError's request_id, or secrets.token_hex(16)), got {request_id!r}"
        )
    return request_id


def _int_tensor(value: Any) -> torch.Tensor:
    """``torch.as_tensor``, except that an empty list is an empty int64 tensor (not float32)."""
    if isinstance(value, (list, tuple)) and not value:
        return torch.zeros(0, dtype=torch.int64)
    return torch.as_tensor(value)


def generations_arg(generation: Any, n: int, what: str) -> torch.Tensor:
    """The generations a caller gives for ``n`` slots as a 1-D int64 tensor (``TypeError`` for a
    non-integer dtype, ``ValueError`` for another count or a negative one)."""
    g = _int_tensor(generation)
    if g.dtype == torch.bool or g.is_floating_point() or g.is_complex():
        raise TypeError(f"generations must be integers, got {g.dtype}")
    gens = g.reshape(-1).to(torch.int64)
    if gens.numel() != n:
        raise ValueError(f"{what} got {n} slots and {gens.numel()} generations")
    if bool((gens < 0).any()):
        raise ValueError(f"generations are never negative, got {gens.tolist()}")
    return gens
