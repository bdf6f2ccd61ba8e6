"""A ring's sampling policy as the server keeps it: priorities, rate limiter, queue.

The policy is one header field, ``sc`` (JSON, parsed by the scripts with ``cjson``),
set by ``lua/sampling.lua``; every change bumps the header's versions, so a client
that planned a ring call without knowing the policy is told its header is stale and
plans again.  The counters the policy needs live beside it in the header: ``sn``
(samples since the rate limiter was set), ``rr`` (the queue's read cursor: ring writes
popped so far) and ``pm`` (the largest priority given so far, a new slot's default).

This module is torch-free (the command line reads policies too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

#: Fan-out of the priority tree (``lua/_tree.lua`` holds the same number): 8 bytes per leaf, 16 per node above.
TREE_FAN = 16

#: Stand-in for an unbounded limiter side: Lua 5.4 does not parse ``inf``.
UNBOUNDED = 1e300

#: The sum of every weight of a priority tree stays within this (``TDS_WSUM`` in ``lua/_tree.lua``):
#: a tree of ``n`` slots takes weights up to ``WEIGHT_SUM / n``, so no sum overflows float64.
WEIGHT_SUM = 1e307


@dataclass(frozen=True)
class RateLimit:
    """Reverb's rate limiter: a sample is allowed while ``inserts * spi - samples >= min_diff`` and
    the table holds ``min_size`` items; an insert while ``inserts * spi - samples <= max_diff``;
    a batch goes when its first row is allowed (see ``lua/README.md``).

    Inserts and samples count from when the limiter was set (header fields ``lb``, the ring
    writes then, and ``sn``, the samples since).
    """

    samples_per_insert: float
    min_size: int
    min_diff: float
    max_diff: float

    def describe(self) -> str:
        if self.min_diff <= -UNBOUNDED and self.max_diff >= UNBOUNDED:
            return f"min_size={self.min_size}"
        error_buffer = (self.max_diff - self.min_diff) / 2
        return f"samples_per_insert={self.samples_per_insert:g}, min_size={self.min_size}, error_buffer={error_buffer:g}"


#: its public home: pickles name it there (set once made: a dataclass resolves its annotations in its own module)
RateLimit.__module__ = "tdstore.ring_interface"


@dataclass(frozen=True)
class SamplingPolicy:
    """What ``sc`` holds: ``alpha`` (priorities on when not None), ``max_times`` (a slot is retired
    after that many samples), ``limit`` (a rate limiter) and ``queue`` (writers wait instead of
    overwriting items no one has popped)."""

    alpha: float | None = None
    max_times: int | None = None
    limit: RateLimit | None = None
    queue: bool = False

    @property
    def prioritized(self) -> bool:
        return self.alpha is not None

    def to_json(self) -> str:
        out: dict = {}
        if self.alpha is not None:
            out["alpha"] = self.alpha
        if self.max_times is not None:
            out["mt"] = self.max_times
        if self.limit is not None:
            lim = self.limit
            out["limit"] = [lim.samples_per_insert, lim.min_size, lim.min_diff, lim.max_diff]
        if self.queue:
            out["queue"] = True
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> SamplingPolicy | None:
        """Parse ``sc``; ``ValueError`` for anything but what :meth:`to_json` writes, with values in the
        ranges ``tds_policy`` in ``lua/_lib.lua`` checks (a value edited by hand never passes)."""
        if raw is None:
            return None
        data = json.loads(raw)
        if not isinstance(data, dict) or set(data) - {"alpha", "mt", "limit", "queue"} or None in data.values():
            raise ValueError(f"unknown sampling policy {raw!r}")
        alpha = data.get("alpha")
        mt = data.get("mt")
        lim = data.get("limit")
        if alpha is not None and not _number(alpha, 0, UNBOUNDED):
            raise ValueError(f"bad priority exponent {alpha!r}")
        if mt is not None and not (_number(mt, 1, 2**32 - 1) and isinstance(mt, int)):
            raise ValueError(f"bad max_times_sampled {mt!r}")
        limit = None
        if lim is not None:
            if not (
                isinstance(lim, list)
                and len(lim) == 4
                and _number(lim[0], 0, UNBOUNDED)
                and _number(lim[1], 0, 2**53)
                and lim[1] == int(lim[1])
                and _number(lim[2], -UNBOUNDED, UNBOUNDED)
                and _number(lim[3], -UNBOUNDED, UNBOUNDED)
                and lim[2] <= lim[3]
            ):
                raise ValueError(f"bad rate limiter {lim!r}")
            limit = RateLimit(float(lim[0]), int(lim[1]), float(lim[2]), float(lim[3]))
        queue = data.get("queue", False)
        if not isinstance(queue, bool):
            raise ValueError(f"bad queue flag {queue!r}")
        return cls(float(alpha) if alpha is not None else None, mt, limit, queue)


SamplingPolicy.__module__ = "tdstore.ring_interface"  # see RateLimit.__module__


def _number(v: object, lo: float, hi: float) -> bool:
    """Whether a JSON value is a finite number (not a bool) in ``lo..hi``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def tree_bytes(count: int) -> int:
    """Size of the priority tree of a ring of ``count`` slots (``tds_tree_layout`` in ``lua/_tree.lua``)."""
    size, n = 8 * count, count
    while n > 1:
        n = -(-n // TREE_FAN)
        size += 16 * n
    return size


def format_priorities(values: list[float]) -> str:
    """Priorities as the scripts read them: ``%.17g`` text (exact for a double), space-separated."""
    return " ".join(f"{v:.17g}" for v in values)
