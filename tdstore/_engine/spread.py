"""Spread stores: one store's segments on several Redis Cluster nodes.

On one server, or in one cluster slot, every call of a store is one script, atomic
over all of its segments.  A *spread* store puts each segment k > 0 under its own
hash tag (``P:{I%s<k>}``), so Redis Cluster places the segments on all primaries and
one store may outgrow one node.  A script can only touch one slot, so here:

- A call is cut into one script call per segment it touches (:func:`run_data`).
  Segment 0's part checks the header as usual; segment k's part makes the same check
  against the segment's *guard* (``StoreKeys.guard``), a copy of the header's guard
  fields (epoch, version, key-set and leaf versions) next to the segment.  The
  parts go as one pipeline per node, all nodes at once (``_engine.scripts.call_many``).
  Each part is atomic, so an element (which lives in one segment) is always read and
  written whole; a call over several segments is not atomic as a whole.
- A read transaction is one MULTI/EXEC per segment (a transaction cannot leave its
  slot), led by the ``HMGET`` of its guard, in one pipeline per node (:func:`run_transaction`).
- A schema change (``_engine.spread_change.run_schema_change``) takes the header's schema lock
  (``lua/lock.lua``, with a lease), *prepares* every other segment (its ops, and its
  guard moved to the new versions: a client of the old schema is refused there for
  what the change touches from then on, and none has the new one yet), then *commits*
  the header with segment 0's ops in one script that checks the lock is still its own,
  then deletes what the change left unreferenced in the other segments and releases
  the lock.  The change writes nothing the old schema uses before its commit: keys it
  would write in place are copied to new leaf numbers first,
  so nobody sees a half-made change and a rolled-back one leaves the data as it was
  (``_engine.spread_change.copy_on_write``).
  A changer that fails rolls back what it prepared (``lua/guard.lua``); one that dies
  leaves a lock whose lease runs out, and the next client that finds a segment ahead
  of the header takes the lock over and rolls the guards back (:func:`unstick`).
- Deleting the store and setting its time to live go segment by segment, the
  header last (:func:`clear`, :func:`expire`).
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis

from tdstore._engine import scripts
from tdstore._format import integrity, wire
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.op_kinds import READ_OPS, WRITE_OPS, OpKind, read_kind, read_ops
from tdstore._format.schema import Header
from tdstore._plan.call import BULK_CHUNK, Call, SegmentHost

#: Lease of the schema lock: a changer that died is taken over after this long.
LEASE_MS = 30_000
#: After a schema change that held a client off, the lock stays free of changers this long (see
#: ``lua/lock.lua``), so that client gets through before the next change.
QUIET_MS = 10

#: :func:`run_data` / :func:`run_transaction`: the call touches segment 0 only, run it as usual.
LOCAL = object()
#: A call refused because another client's schema change is under way: plan again once it is
#: done (waiting for it is not a lost race, see ``Engine._run``).
WAIT = object()


def spreads(h: Header) -> bool:
    """Whether calls on this store's header must be cut per segment."""
    return h.spread and h.segments.n > 1


@dataclass
class Part:
    """The ops of one call that address one segment, with that segment's KEYS (its guard first)."""

    kt: KeyTable
    ops: list[list[Any]]
    at: list[int] = field(default_factory=list)  # each op's position among the call's ops as planned


def split(keys: StoreKeys, kt_keys: Sequence[str], ops: list[list[Any]], kinds: Mapping[str, OpKind]) -> dict[int, Part]:
    """Group ``ops`` (localized: each addresses one segment; ``kinds``: their script's) by segment, their key indices renumbered."""
    parts: dict[int, Part] = {}
    for pos, op in enumerate(ops):
        kind = kinds[op[0]]
        if kind.picks_rows or kind.by_row or not kind.keys:
            raise AssertionError(f"op {op[0]!r} addresses rows the server picks, which a spread store cannot split")
        segs = {keys.segment_of(kt_keys[i - 1]) for i in kind.key_indices(op)}
        if len(segs) != 1:
            raise AssertionError(f"op {op[0]!r} spans segments {sorted(segs)}")
        seg = segs.pop()
        part = parts.get(seg)
        if part is None:
            part = parts[seg] = Part(KeyTable(keys.guard(seg)), [])
        new = list(op)
        for i in kind.keys:
            if op[i]:
                new[i] = part.kt.ref(kt_keys[op[i] - 1])
        part.ops.append(new)
        part.at.append(pos)
    return parts


def flat(ops: list[list[Any]]) -> list[Any]:
    """Ops as a script takes them: markers and arguments back to back."""
    return [x for op in ops for x in op]


# -- data calls ----------------------------------------------------------------------------


def run_data(engine: SegmentHost, h: Header, call: Call) -> Any:
    """A read or write script call (no schema change) cut per segment; the reply its parser expects,
    None when the caller must plan again (it refreshed the header), or :data:`LOCAL`."""
    keys = engine.keys
    if call.script == "write":
        assert call.ops is not None
        head, ops, kinds = call.args[:5], call.ops, WRITE_OPS  # then each part's checks (_integrity)
    else:
        head, ops, kinds = call.args[:2], list(read_ops(call.args[3:])), READ_OPS
    parts = split(keys, call.keys, ops, kinds)
    if set(parts) <= {0}:
        return LOCAL
    segs = sorted(parts)
    calls = []
    for seg in segs:  # every segment checks what segment 0 checks, against its own guard
        part = parts[seg]
        checks = [integrity.checks(keys, h, part.kt.keys)] if call.script == "write" else []
        calls.append((call.script, part.kt.keys, [*head, *checks, len(part.ops), *flat(part.ops)]))
    if call.staged:
        stage(engine, call.staged)
    if len(calls) == 1:  # one segment (an element): one script on a connection held to its node
        try:
            replies = [engine.segment_call(*calls[0])]
        except (ConnectionError, TimeoutError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            raise
        except Exception as err:  # a refusal: settle() drops the staged keys and raises it
            replies = [err]
    else:
        replies = scripts.call_many(engine.cluster, calls)
    status = settle(engine, h, dict(zip(segs, replies)), staged=call.staged)
    if status is not True:
        return status
    if call.script == "write":
        return replies[segs.index(0)] if 0 in parts else [b"OK", str(h.version).encode()]
    # the pieces back in the order of the ops as planned
    items: list[Any] = [None] * len(ops)
    for seg, reply in zip(segs, replies):
        pos = 2
        for i, op in zip(parts[seg].at, parts[seg].ops):
            n = read_kind(op).reply_pieces(op)
            items[i] = reply[pos : pos + n]
            pos += n
    out: list[Any] = [b"OK", str(h.version).encode()]
    for piece in items:
        out.extend(piece)
    return out


def stage(engine: SegmentHost, staged: list[tuple[str, Any]]) -> None:
    """Large new blobs sent by plain SETRANGE to their staging keys (see ``Transport._staged_call``), before
    the per-segment scripts that move them into place."""
    pipe = engine.client.pipeline(transaction=False)
    engine.queue_staged(pipe, staged)
    pipe.execute()


def settle(engine: SegmentHost, h: Header, replies: dict[int, Any], *, staged: list[tuple[str, Any]] | None = None) -> Any:
    """True when every segment's reply is OK; else refresh what is needed and return None (plan
    again) or :data:`WAIT` (another client's schema change is under way, see :func:`refused`).

    A refused call (an exception) is raised after the staging keys are deleted; so is a
    segment whose guard is missing (:func:`missing_guard`).
    """
    if all(not isinstance(r, Exception) and r[0] == b"OK" for r in replies.values()):
        return True
    if staged:
        engine.client.delete(*(k for k, _ in staged))
    for r in replies.values():
        if isinstance(r, Exception):
            raise r
    head = replies.get(0)
    if head is not None and head[0] == b"GONE":
        raise engine.gone()
    for seg, r in replies.items():
        if seg and r[0] == b"GONE":
            raise missing_guard(engine, seg)
    if head is not None and head[0] == b"STALE":
        engine.adopt_stale(head)
        return None
    return refused(engine, h)  # only guards refused: the header decides


def missing_guard(engine: SegmentHost, seg: int) -> KeyError:
    """The error for a segment whose guard is gone while the header is not (checked here: a store
    deleted meanwhile gives the usual one). A delete cut short, or a guard expired a moment
    before its header: nothing to wait for; ``clear_redis()`` or ``tdstore rm`` deletes the rest."""
    engine.fetch_header()  # raises the usual KeyError when the whole store is gone
    return KeyError(
        f"segment {seg} of the store with {engine.where()} has lost its guard ({engine.keys.guard(seg)!r}): "
        "the store is being deleted, expiring, or a delete was cut short; clear_redis() or 'tdstore rm' removes the rest"
    )


def refused(engine: SegmentHost, h: Header) -> Any:
    """A segment's guard refused a call planned at ``h``: adopt the header and return None (plan
    again); when it has not moved, a schema change is under way or was left half done: wait a
    little, undo a dead one's work, and return :data:`WAIT`."""
    fresh = engine.fetch_header()
    engine.set_header(fresh)
    if fresh.version == h.version:
        unstick(engine, fresh)
        return WAIT
    return None


def unstick(engine: SegmentHost, h: Header) -> None:
    """Segments ahead of the header ``h``: wait while a live changer holds the lock; take it over when it is
    free or its lease ran out, roll every guard ahead of ``h`` back, and let it go."""
    try:
        # a read-only handle too: undoing a dead change restores what its schema says, writes no data
        token, undone = _take_lock(engine, h, undo_all=True)
    except PermissionError:  # an ACL user that may only read: wait for a client that may write
        token, undone = None, 0
    if isinstance(token, str):
        release(engine, token)
    if not undone and token is not WAIT:  # nothing was ahead: whatever refused the call, do not ask again at once
        time.sleep(0.001 + 0.004 * random.random())


def rollback(engine: SegmentHost, h: Header, token: str, upto_leaf: int, segments: int) -> int:
    """Every guard of segments 1..segments-1 that a change (``token``, or any: ``*``) moved ahead of
    ``h`` goes back to ``h``'s version, and the keys of leaf numbers the change added are deleted."""
    keys = engine.keys
    calls = []
    fields = " ".join(f"{k}={v}" for k, v in guard_fields(h).items() if k not in ("epoch", "version"))
    for seg in range(1, h.segments.n):
        extra = [k for n in range(h.next_leaf, upto_leaf) for k in keys.leaf_keys(n, seg)]
        calls.append(("guard", [keys.guard(seg), *extra], ["rollback", h.epoch, h.version, token, fields]))
    # segments the header does not have (a first change rolled back): their guard and keys go
    gone = range(h.segments.n, max(segments, h.segments.n))
    calls += [("clear", [keys.guard(seg), *keys.segment_keys(upto_leaf, seg)], ["*", keys.td_id, "noreg"]) for seg in gone]
    undone = 0
    for (name, _, _), reply in zip(calls, scripts.call_many(engine.cluster, calls) if calls else []):
        if isinstance(reply, Exception):
            raise reply
        undone += int(reply[1]) if name == "guard" else min(1, int(reply[1]))
    return undone


def guard_fields(h: Header) -> dict[str, str]:
    """What a segment's guard holds for the header ``h``: its epoch, version, key-set and leaf versions."""
    return {
        "epoch": h.epoch,
        "version": str(h.version),
        "kv": str(h.keyset_version),
        **{f"lv:{leaf.number}": str(leaf.version) for leaf in h.leaves.values()},
    }


def release(engine: SegmentHost, token: str) -> None:
    scripts.call(engine.client, "lock", [engine.keys.meta], ["release", token], engine.execute)


def new_token() -> str:
    """A schema lock holder's token: random, so a lock taken over is told from its old holder."""
    return str(secrets.randbelow(10**15) + 1)


# -- read transactions ---------------------------------------------------------------------


def run_transaction(engine: SegmentHost, h: Header, call: Call) -> Any:
    """A read transaction (see ``Transport._transaction``) as one MULTI/EXEC per segment (a transaction
    may not leave its slot), led by the segment's guard, sent as one pipeline per node, all nodes at
    once; the reply as ``Transport._transaction`` gives it, None to plan again."""

    assert call.ranges is not None and call.guards is not None
    keys = engine.keys
    if all(keys.segment_of(key) == 0 for pieces in call.ranges for key, _, _ in pieces):
        return LOCAL  # segment 0 only: one transaction on the header's node, as on any store
    client = engine.cluster
    names = list(call.guards)
    extra = call.fields or []
    # per segment: its commands (the guard's HMGET first) and where each GETRANGE's reply goes
    groups: dict[int, tuple[list[tuple[Any, ...]], list[tuple[int, int]]]] = {}

    def group(seg: int) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]]]:
        g = groups.get(seg)
        if g is None:
            head = ("HMGET", keys.meta, "version", *names, *extra) if seg == 0 else ("HMGET", keys.guard(seg), *names)
            g = groups[seg] = ([head], [])
        return g

    group(0)  # the header's guards, even when no range is in segment 0
    sizes = []
    for b, pieces in enumerate(call.ranges):
        count = 0
        for key, starts, lengths in pieces:
            commands, slots = group(keys.segment_of(key))
            for first, last in zip(*wire.chunked(starts, lengths, BULK_CHUNK)):
                commands.append(("GETRANGE", key, first, last))
                slots.append((b, count))
                count += 1
        sizes.append(count)
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for seg in groups:
        node = client.get_node_from_key(keys.guard(seg))
        by_node.setdefault(node.name, (node, []))[1].append(seg)

    def job(node: Any, segs: list[int]) -> list[Any]:
        pipe = node.redis_connection.pipeline(transaction=False)
        for seg in segs:
            pipe.execute_command("MULTI")
            for command in groups[seg][0]:
                pipe.execute_command(*command)
            pipe.execute_command("EXEC")
        replies = pipe.execute()
        out, pos = [], 0
        for seg in segs:
            pos += 2 + len(groups[seg][0])  # OK, QUEUED..., then the EXEC reply
            out.append(replies[pos - 1])
        return out

    jobs = list(by_node.values())
    results = scripts.on_nodes([partial(job, node, segs) for node, segs in jobs])
    chunks: list[list[Any]] = [[None] * n for n in sizes]
    head = None
    for (_, segs), per_seg in zip(jobs, results):
        for seg, res in zip(segs, per_seg):
            if seg == 0:
                head = res[0]
            elif [v.decode() if v is not None else None for v in res[0]] != [call.guards[n] for n in names]:
                if res[0][0] is None:  # no epoch: the guard is gone
                    raise missing_guard(engine, seg)
                return refused(engine, h)
            for (b, i), data in zip(groups[seg][1], res[1:]):
                chunks[b][i] = data
    assert head is not None
    if head[0] is None:
        raise engine.gone()
    if [v.decode() if v is not None else None for v in head[1 : 1 + len(names)]] != [call.guards[n] for n in names]:
        engine.set_header(engine.fetch_header())
        return None
    call.field_values = dict(zip(extra, head[1 + len(names) :]))
    return [b"OK", head[0], *(bytearray().join(parts) for parts in chunks)]


# -- the whole store -----------------------------------------------------------------------


def _segment_calls(engine: SegmentHost, h: Header, script: str, args: list[Any]) -> list[tuple[str, list[str], list[Any]]]:
    keys = engine.keys
    return [
        (script, [keys.guard(seg), *keys.segment_keys(h.next_leaf, seg)], [f"{h.epoch}:V{h.version}", *args])
        for seg in range(1, h.segments.n)
    ]


def _take_lock(engine: SegmentHost, h: Header, *, undo_all: bool = False) -> tuple[Any, int]:
    """Take the schema lock for a call that must not run while a schema change is half-way (delete,
    expiry, an undo): ``(token, guards rolled back)``, or ``(None, 0)`` when the header moved (the
    fresh one adopted: plan again) or ``(WAIT, 0)`` when a change holds it (after a short wait). A
    lock whose holder died is taken over and its work undone; with ``undo_all``, every guard ahead
    of ``h`` is rolled back even when the lock was free."""
    token = new_token()
    reply = scripts.call(
        engine.client,
        "lock",
        [engine.keys.meta],
        ["acquire", f"{h.epoch}:V{h.version}", token, LEASE_MS, h.next_leaf, h.segments.n, 0, "1"],
        engine.execute,
    )
    if reply[0] == b"STALE":
        engine.adopt_stale(reply)
        return None, 0
    if reply[0] == b"GONE":
        raise engine.gone()
    if reply[0] == b"BUSY":
        time.sleep(min(int(reply[1]) / 1000, 0.001 + 0.004 * random.random()))
        return WAIT, 0
    undone = 0
    if len(reply) > 2 or undo_all:
        try:
            upto, segments = (int(reply[2]), int(reply[3])) if len(reply) > 2 else (h.next_leaf, h.segments.n)
            undone = rollback(engine, h, "*", upto, segments)
        except BaseException:
            release(engine, token)
            raise
    return token, undone


def clear(engine: SegmentHost, h: Header) -> Any:
    """Delete every segment k > 0 (its guard and keys), then the header and segment 0 (one call), under
    the schema lock; the number of keys deleted, or None / :data:`WAIT` to plan again."""
    token, _ = _take_lock(engine, h)
    if not isinstance(token, str):
        return token
    try:
        calls = _segment_calls(engine, h, "clear", [engine.keys.td_id, "noreg"])
        deleted = 0
        orphans = []  # segments whose guard is gone (a delete cut short): their keys go without a check
        for (name, keys_, args), reply in zip(calls, scripts.call_many(engine.cluster, calls)):
            if isinstance(reply, Exception):
                raise reply
            if reply[0] == b"OK":
                deleted += int(reply[1])
            else:
                orphans.append((name, keys_, ["*", *args[1:]]))
        for reply in scripts.call_many(engine.cluster, orphans) if orphans else []:
            if isinstance(reply, Exception):
                raise reply
            deleted += int(reply[1])
        keys = engine.keys
        # the header goes last, and the lock with it
        reply = scripts.call(
            engine.client, "clear", [keys.meta, *keys.segment_keys(h.next_leaf, 0)], ["*", keys.td_id, "noreg"], engine.execute
        )
    except BaseException:
        release(engine, token)
        raise
    return deleted + int(reply[1])


def expire(engine: SegmentHost, h: Header, ttl_ms: int) -> Any:
    """Every segment's keys and guard get the time to live, then the header and segment 0, under the
    schema lock; True, or None / :data:`WAIT` to plan again.

    Every key gets the one absolute deadline read from the header node's clock, so the
    segments expire together as far as the nodes' clocks agree.
    """
    token, _ = _take_lock(engine, h)
    if not isinstance(token, str):
        return token
    try:
        keys = engine.keys
        at = deadline(engine, ttl_ms)
        calls = _segment_calls(engine, h, "expire", [ttl_ms, at])
        for (_, keys_, _), reply in zip(calls, scripts.call_many(engine.cluster, calls)):
            if isinstance(reply, Exception):
                raise reply
            if reply[0] == b"GONE":
                raise missing_guard(engine, keys.segment_of(keys_[0]))
            if reply[0] != b"OK":  # cannot be: the lock holds the schema still
                raise AssertionError(f"segment {keys.segment_of(keys_[0])} refused an expiry under the schema lock: {reply[0]!r}")
        reply = scripts.call(
            engine.client,
            "expire",
            [keys.meta, *keys.segment_keys(h.next_leaf, 0)],
            [f"{h.epoch}:V{h.version}", ttl_ms, at],
            engine.execute,
        )
        if reply[0] == b"GONE":
            raise engine.gone()
    finally:
        release(engine, token)
    return True


def deadline(engine: SegmentHost, ttl_ms: int) -> str:
    """The absolute deadline (Unix ms, from the header node's clock) of a time to live; '' for none."""
    if ttl_ms <= 0:
        return ""
    sec, usec = engine.command("TIME")
    return str(int(sec) * 1000 + int(usec) // 1000 + ttl_ms)


__all__ = ["spreads", "run_data", "run_transaction", "clear", "expire", "LOCAL"]
