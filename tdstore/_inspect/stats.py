"""A ring's counters as ``stats()``, ``tdstore top`` and ``tdstore metrics`` show them (torch-free).

The scripts that do the ring's work count it, in the same call, in the store's stats hash
(``StoreKeys.stats``; ``lua/_lib.lua`` ``tds_stat``): no round trip of its own on the hot path.
:func:`read` gets them with the ring's state in one round trip (a pipeline of reads on the store's
node) and returns a plain dict (JSON-able) of the keys in :data:`COUNTERS` and :data:`GAUGES`:

- counters, since the store was made (deleted with it; a checkpoint carries them as of its fence):
  ``inserted`` (rows written by ``extend``/``append``), ``sampled`` (rows drawn by ``sample``),
  ``popped`` (items handed out by ``pop``, redeliveries included), ``acknowledged`` (leased items
  settled by ``ack``), ``redelivered`` (items popped again after their lease lapsed), ``expired``
  (items whose lease lapsed), ``lost`` (unread items writers overwrote), ``stale`` (rows a pop with
  ``max_staleness`` dropped as too old, ``_ring.rollouts``), ``held_writes`` and
  ``held_samples`` (times the rate limiter or a full queue answered a write or a sample WAIT),
  ``held_writes_ms``, ``held_samples_ms`` and ``held_pops_ms`` (milliseconds calls that went through
  had waited before: for the limiter, a full queue, ``min_size``, an item to pop; the client's clock),
  ``age_rows``, ``age_sum`` and ``age_max`` (the age in ring writes of the rows sampled by the
  server: a row written by ring write ``w`` and sampled at ``rw`` is ``rw - 1 - w`` old; a full
  ring's uniform sample read as a transaction is counted in ``sampled`` only, so the mean age
  is ``age_sum / age_rows``, given as ``age_mean``); ``distinct_sampled`` (rows sampled at least once:
  a row is one ring write's, so a slot written again holds a new row; ``lua/_seen.lua`` keeps one bit
  per slot, set by the sampling call, and the ring write that overwrites a row counts it, sampled
  or not) and ``overwritten_unsampled`` (rows overwritten, or written over the rows of a store filled
  by index, without ever being sampled): these two, ``overwritten_sampled`` and ``sampled_resident`` only
  while the ring tracks distinct rows (``track_distinct``, header field ``sd``; off by default, for its cost),
  counted from when it was turned on, else None. ``age_versions_rows`` and ``age_versions_sum`` (the age in
  policy versions of the rows ``sample`` and ``pop`` handed out on a ring with rollouts, ``_ring.rollouts``: a
  row stamped version ``v`` taken while the published version is ``cv`` is ``max(0, cv - v)`` old, counted by
  the call that takes it, ``lua/_rollouts.lua`` ``count_age``), given as their mean :data:`POLICY_AGE`
  (``age_policy_versions``) and the largest ``age_policy_versions_max``: both None while no versioned row
  was taken (a ring without rollouts; a sharded ring, which refuses them).
- gauges, as now: ``capacity``, ``written``, ``write_count``, ``unread`` (items no pop took yet),
  ``leased`` and ``awaiting_redelivery`` (items under a live lease, items whose lease lapsed),
  ``rollouts`` (only on a ring with rollouts, ``_ring.rollouts``: the published ``version``, ``queued_items``
  for ``pop``, ``whole_groups``; ``unread`` is then its queue's items), ``limiter`` (the rate
  limiter's settings and ``limiter_room``: samples the limiter allows before it holds them,
  ``(rw - lb) * spi - sn - min_diff``), ``queue`` (queue mode), ``priority``
  (``alpha``, ``total`` mass of the tree, ``min_weight``, ``max_priority``: the largest priority
  given so far) and ``waiting`` (clients subscribed to the store's channel: calls waiting for the
  limiter, data or room; None on a cluster, where a node sees only its own subscribers),
  ``sampled_resident`` (rows the ring holds now that were sampled at least once).

Calls of a read-only handle are not counted (it writes nothing); nor is a sample read through
``read.lua`` only because the server refuses ``MULTI`` to the user.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from tdstore._format.header_info import ring_writes
from tdstore._format.keys import StoreKeys
from tdstore._format.sampling_policy import SamplingPolicy

#: Counters (only grow), by ``stats()`` key: the stats hash's fields that make each.
COUNTERS: dict[str, tuple[str, ...]] = {
    "inserted": ("ins",),
    "sampled": ("smp", "smpx"),
    "popped": ("pop",),
    "acknowledged": ("ack",),
    "redelivered": ("rdl",),
    "expired": ("exp",),
    "lost": ("lost",),
    "stale": ("stale",),
    "held_writes": ("hw",),
    "held_samples": ("hr",),
    "held_writes_ms": ("hw_ms",),
    "held_samples_ms": ("hr_ms",),
    "held_pops_ms": ("hp_ms",),
    "age_rows": ("smp",),
    "age_sum": ("age_sum",),
    "overwritten_sampled": ("ovs",),
    "overwritten_unsampled": ("ovu",),
    "age_versions_rows": ("agev_rows",),
    "age_versions_sum": ("agev_sum",),
}

#: Counters made from a counter and a gauge: rows sampled at least once, those overwritten and those the ring holds.
DERIVED = ("distinct_sampled",)

#: The stats that exist only while the ring tracks distinct rows (``track_distinct``): None otherwise.
DISTINCT = ("distinct_sampled", "overwritten_sampled", "overwritten_unsampled", "sampled_resident")

#: The mean age in policy versions of the rows sampled or popped on a ring with rollouts (None: none taken);
#: the largest is ``POLICY_AGE + "_max"``.
POLICY_AGE = "age_policy_versions"

#: Gauges (the ring as it is now) that are plain numbers.
GAUGES = ("capacity", "written", "write_count", "unread", "leased", "awaiting_redelivery", "age_max", "waiting", "sampled_resident")

_HEAD = ("count", "rw", "rr", "sn", "lb", "sc", "pm", "na", "ro", "cv", "sd")


def read(client: Any, keys: StoreKeys, *, cluster: bool = False) -> dict[str, Any]:
    """The counters and state of the ring ``keys`` names, in one round trip (see the module docstring);
    ``KeyError`` when the store does not exist."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.stats)
    pipe.hmget(keys.meta, list(_HEAD))
    pipe.getrange(keys.priorities, -16, -1)
    pipe.zcard(keys.lease_keys[1])  # live leases, by deadline
    pipe.zcard(keys.lease_keys[3])  # outstanding items (leased or awaiting redelivery)
    pipe.zcard(keys.lease_keys[2])  # items awaiting redelivery
    pipe.bitcount(keys.sampled_rows)  # O(capacity / 8) bytes, read only here: the rows held that were sampled
    pipe.llen(keys.rollout_keys[4])  # the rollout index's pop queue (items: rows or whole groups)
    pipe.zcard(keys.rollout_keys[1])  # its whole groups
    if not cluster:
        pipe.execute_command("PUBSUB", "NUMSUB", keys.events)
    got = pipe.execute()
    out = summarize(got[0], got[1], got[2], got[4] - got[5], got[5], None if cluster else _numsub(got[9]), got[6])
    if got[1][8] is not None:  # the rollout index is on: pops take its queue, not the read cursor
        out["unread"] = int(got[7])
        out["rollouts"] = {"version": int(got[1][9] or 0), "queued_items": int(got[7]), "whole_groups": int(got[8])}
    return out


def _numsub(reply: Any) -> int | None:
    if isinstance(reply, dict):
        return int(next(iter(reply.values()), 0))
    if isinstance(reply, (list, tuple)) and len(reply) >= 2:
        return int(reply[1])
    return None


def _text(v: Any) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def summarize(raw: dict, head: list, root: bytes, leased: int, awaiting: int, waiting: int | None, resident: int = 0) -> dict[str, Any]:
    """The dict :func:`read` returns, from its replies: the stats hash, the header fields :data:`_HEAD`, the
    last 16 bytes of the priority tree (its root), items leased and awaiting redelivery, subscribers, the
    bits set in the sampled-rows bitmap."""
    if head[0] is None:
        raise KeyError("the store does not exist")
    fields = {_text(k): int(v) for k, v in raw.items()}
    out: dict[str, Any] = {name: sum(fields.get(f, 0) for f in parts) for name, parts in COUNTERS.items()}
    out["age_max"] = fields.get("age_max")
    out["age_mean"] = out["age_sum"] / out["age_rows"] if out["age_rows"] else None
    versioned = out["age_versions_rows"]
    out[POLICY_AGE] = out["age_versions_sum"] / versioned if versioned else None
    out[POLICY_AGE + "_max"] = fields.get("agev_max", 0) if versioned else None
    if head[10] in (b"1", "1"):
        out["sampled_resident"] = int(resident)
        out["distinct_sampled"] = out["overwritten_sampled"] + int(resident)
    else:  # not tracked (the bitmap would be empty, 'ovs'/'ovu' absent): unknown, not zero
        out.update(dict.fromkeys(DISTINCT))
    count = int(head[0])
    rw_raw = int(head[1] or 0)
    # a store written by index holds a full ring (as the scripts count it); without an inventory, say it holds none
    rw = ring_writes(rw_raw, int(head[7]) if head[7] is not None else 0, False, count)
    rr = int(head[2] or 0)
    out.update(capacity=count, written=min(rw, count), write_count=rw, unread=max(0, min(rw - rr, count)))
    out.update(leased=leased, awaiting_redelivery=awaiting, waiting=waiting)
    policy = SamplingPolicy.from_json(_text(head[5])) if head[5] else None
    out["queue"] = bool(policy and policy.queue)
    out["limiter"] = None
    if policy is not None and policy.limit is not None:
        lim = policy.limit
        sn, lb = int(head[3] or 0), int(head[4] or 0)
        out["limiter"] = {
            "min_size": lim.min_size,
            "samples_per_insert": lim.samples_per_insert,
            "min_diff": lim.min_diff,
            "max_diff": lim.max_diff,
            "inserts": rw - lb,
            "samples": sn,
            "room": (rw - lb) * lim.samples_per_insert - sn - lim.min_diff,
        }
    out["priority"] = None
    if policy is not None and policy.alpha is not None:
        total = low = None
        if len(root) == 16:
            total, low = struct.unpack("<2d", root)
        out["priority"] = {"alpha": policy.alpha, "total": total, "min_weight": low, "max_priority": float(head[6]) if head[6] else None}
    return out


def _total(values: list[Any]) -> Any:
    """The sum of the shards' values; None when a shard does not count it (distinct rows not tracked there)."""
    return None if any(v is None for v in values) else sum(values)


def add_up(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded ring's ``stats()``: each shard's (``shards``, in order) and their totals (counters and plain
    gauges summed, ``age_max`` the largest, ``limiter``/``priority``/``queue`` the first shard's policy with
    ``room``, ``total`` summed, ``waiting`` summed where every shard tells it)."""
    out: dict[str, Any] = {name: _total([p[name] for p in parts]) for name in COUNTERS}
    for name in GAUGES:
        values = [p[name] for p in parts]
        out[name] = None if any(v is None for v in values) else (max(values) if name == "age_max" else sum(values))
    if out["age_max"] is None:
        out["age_max"] = max((p["age_max"] for p in parts if p["age_max"] is not None), default=None)
    out["age_mean"] = out["age_sum"] / out["age_rows"] if out["age_rows"] else None
    out[POLICY_AGE] = out[POLICY_AGE + "_max"] = None  # rollouts are refused on a sharded ring
    out["distinct_sampled"] = _total([p["distinct_sampled"] for p in parts])
    out["queue"] = any(p["queue"] for p in parts)
    out["limiter"] = json.loads(json.dumps(parts[0]["limiter"])) if parts and parts[0]["limiter"] else None
    if out["limiter"] is not None:
        for name in ("inserts", "samples", "room"):
            out["limiter"][name] = sum(p["limiter"][name] for p in parts if p["limiter"])
    out["priority"] = dict(parts[0]["priority"]) if parts and parts[0]["priority"] else None
    if out["priority"] is not None:
        prios = [p["priority"] for p in parts if p["priority"]]
        out["priority"]["total"] = sum(p["total"] or 0.0 for p in prios)
        lows = [p["min_weight"] for p in prios if p["min_weight"]]
        out["priority"]["min_weight"] = min(lows) if lows else None
        highs = [p["max_priority"] for p in prios if p["max_priority"] is not None]
        out["priority"]["max_priority"] = max(highs) if highs else None
    out["shards"] = parts
    return out
