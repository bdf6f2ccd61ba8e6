"""A spread store's schema change: lock, prepare every other segment, commit the header, clean up.

The protocol is described in ``_engine.spread``'s docstring; this module runs it for one change
(:func:`run_schema_change`), and plans the copy-on-write that keeps what the old schema uses
untouched until the commit (:func:`copy_on_write`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

from tdstore._engine import scripts, spread
from tdstore._engine.spread import WAIT, Part, deadline, flat, missing_guard, new_token, refused, release, rollback, split, stage
from tdstore._format import integrity
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.op_kinds import WRITE_OPS, Write, write_kind
from tdstore._format.schema import Header
from tdstore._plan.call import Call, SegmentHost


def run_schema_change(engine: SegmentHost, h: Header, call: Call) -> Any:
    """A write with a schema change on a spread store: lock, prepare the segments, commit the header,
    clean up (see the module docstring). The commit's reply, or None to plan again."""
    new = call.schema
    assert new is not None and call.ops is not None
    parts = split(engine.keys, call.keys, call.ops, WRITE_OPS)
    change = _SchemaChange(engine, h, new, call, parts, new_token(), max(new.segments.n, h.segments.n))
    later = change.defer_deletes()
    if call.staged:
        stage(engine, call.staged)
    lock = change.acquire()
    if not isinstance(lock, list):
        return lock
    try:
        if len(lock) > 2:  # an expired lock taken over: undo what its holder left first
            rollback(engine, h, "*", int(lock[2]), int(lock[3]))
        refusal = change.prepare()
        if refusal is not _PREPARED:
            return refusal
        reply = change.commit()
        change.committed = True
    except BaseException:
        # before the commit was sent, undo what was prepared; after, only once the header says it did not
        # run (when it cannot say, the lock stays: its lease runs out and the next holder decides)
        if not change.committed and (not change.sent or _commit_outcome(engine, h, new, change.token) is False):
            try:
                change.abort()
            except Exception:
                pass  # the lease runs out and the next client rolls back
        raise
    if reply is not None:
        change.clean_up(later)
    return reply


#: :meth:`_SchemaChange.prepare`: every segment is prepared, the header may be committed.
_PREPARED = object()


@dataclass
class _SchemaChange:
    """One schema change of a spread store, step by step (see :func:`run_schema_change`)."""

    engine: SegmentHost
    h: Header  # the schema it was planned on
    new: Header  # the schema it commits
    call: Call
    parts: dict[int, Part]  # the call's ops per segment
    token: str  # the lock's holder
    after: int  # segments the store has after the change
    sent: bool = False  # the commit was sent (it may have run even when no reply says so)
    committed: bool = False

    @property
    def check(self) -> str:
        return f"{self.h.epoch}:V{self.h.version}"

    def write_args(self, check: str, schema: str, fields: str, checks: bytes, ops: list[list[Any]]) -> list[Any]:
        """The ARGV of a ``write.lua`` call of one segment."""
        return [check, "", schema, fields, self.engine.max_value_bytes, checks, len(ops), *flat(ops)]

    def defer_deletes(self) -> dict[int, list[list[Any]]]:
        """Take out of the other segments' parts the deletes that must wait for the commit (nothing
        the old schema uses may go before it); returns them per segment."""
        later: dict[int, list[list[Any]]] = {}
        for seg, part in self.parts.items():
            if seg == 0:
                continue
            keep, later[seg] = [], []
            for i, op in enumerate(part.ops):
                # a delete stays in place only when a later op of the call writes that key again (a key
                # set anew); one that is only read afterwards (the source of a copy) goes after the commit
                if op[0] == Write.D.marker and not any(op[1] in write_kind(nxt).written(nxt) for nxt in part.ops[i + 1 :]):
                    later[seg].append(op)
                else:
                    keep.append(op)
            part.ops = keep
        return later

    def acquire(self) -> Any:
        """Take the store's schema lock: lock.lua's reply, else None (plan again) or :data:`WAIT`."""
        engine, new = self.engine, self.new
        # the lease is read from _spread at each call: one setting for every lock this package takes
        args = ["acquire", self.check, self.token, spread.LEASE_MS, new.next_leaf, self.after, spread.QUIET_MS, "0"]
        reply = scripts.call(engine.client, "lock", [engine.keys.meta], args, engine.execute)
        status = reply[0]
        if status == b"OK":
            return reply
        _drop(engine, self.call)
        if status == b"STALE":
            engine.adopt_stale(reply)
            return None
        if status == b"GONE":
            raise engine.gone()
        # BUSY: another change is under way
        time.sleep(min(int(reply[1]) / 1000, 0.001 + 0.01 * random.random()))
        return WAIT

    def abort(self) -> None:
        _abort(self.engine, self.h, self.token, self.new, self.after, self.call)

    def ensure_guards(self) -> None:
        """The first data of new segments: their guards are made first, in a round trip of their own
        (a node that missed guard.lua would run the prepare before the guard exists)."""
        engine, keys = self.engine, self.engine.keys
        at = deadline(engine, engine.ttl_ms() or 0)  # a store with a time to live: the header's deadline
        made = scripts.call_many(
            engine.cluster, [("guard", [keys.guard(seg)], ["ensure", self.h.epoch, self.h.version, at]) for seg in range(1, self.after)]
        )
        for r in made:
            if isinstance(r, Exception):
                raise r
        if any(r[0] != b"OK" for r in made):  # a guard of another creation of the store (a delete cut short)
            self.abort()
            raise KeyError(
                f"the store with {engine.where()} has segments left by an earlier store of the same id; "
                "delete them with clear_redis() or 'tdstore rm'"
            )

    def prepare(self) -> Any:
        """Every segment but the header's written, under the lock: :data:`_PREPARED`, or the outcome
        of a refusal (the change undone)."""
        engine, h, new, keys = self.engine, self.h, self.new, self.engine.keys
        if self.after > h.segments.n or h.segments.n == 1:
            self.ensure_guards()
        fields = f"{new.version_fields(h)} lk={self.token}"
        calls: list[tuple[str, list[str], list[Any]]] = []
        for seg in range(1, self.after):
            part = self.parts.get(seg) or Part(KeyTable(keys.guard(seg)), [])
            # a guard needs the versions, not the schema: '-' stands for it (write.lua stores what it is given)
            checks = integrity.checks(keys, h, part.kt.keys, new)
            calls.append(("write", part.kt.keys, self.write_args(self.check, "-", fields, checks, part.ops)))
        replies = scripts.call_many(engine.cluster, calls)
        for i, r in enumerate(replies):
            if isinstance(r, Exception):
                raise r
            if r[0] == b"GONE":
                self.abort()
                raise missing_guard(engine, keys.segment_of(calls[i][1][0]))
        if any(r[0] != b"OK" for r in replies):
            self.abort()
            return refused(engine, h)
        return _PREPARED

    def commit(self) -> Any:
        """The header's segment written with the new schema: write.lua's reply, or None to plan again."""
        engine, h, new, keys = self.engine, self.h, self.new, self.engine.keys
        head = self.parts.get(0) or Part(KeyTable(keys.meta), [])
        checks = integrity.checks(keys, h, head.kt.keys, new)
        commit = self.write_args(f"{self.check}@{self.token}", new.schema_json(), new.version_fields(h), checks, head.ops)
        self.sent = True
        try:
            reply = scripts.call(engine.client, "write", head.kt.keys, commit, engine.execute)
        except BaseException:
            if _commit_outcome(engine, h, new, self.token) is not True:
                raise
            reply = [b"OK", str(new.version).encode()]  # it ran; its reply was lost
        if reply[0] != b"OK":
            # a commit sent again after a lost reply finds the header already moved: ask the header
            outcome = _commit_outcome(engine, h, new, self.token)
            if outcome is not True:
                if outcome is False:
                    self.abort()
                if reply[0] == b"GONE":
                    raise engine.gone()
                engine.adopt_stale(reply)
                return None
        return reply

    def clean_up(self, later: dict[int, list[list[Any]]]) -> None:
        """Delete the old schema's keys that the change left unreferenced, then let the lock go
        (best effort: a failure leaves garbage only, and a lock whose lease runs out)."""
        engine, h, new, keys = self.engine, self.h, self.new, self.engine.keys
        try:
            cleanup = []
            for seg, ops in later.items():
                if ops:
                    part = _renumber(keys, self.parts[seg], ops)
                    args = self.write_args(f"{h.epoch}:V{new.version}", "", "", integrity.checks(keys, new, part.kt.keys), part.ops)
                    cleanup.append(("write", part.kt.keys, args))
            if cleanup:
                scripts.call_many(engine.cluster, cleanup)
        finally:
            release(engine, self.token)


def _commit_outcome(engine: SegmentHost, h: Header, new: Header, token: str) -> bool | None:
    """Whether this change's commit ran, from the header: True (at the new version, still locked by
    ``token``), False (still at the version it was planned on), None when the header cannot tell
    (unreachable, or moved on by another client after the lock was taken over)."""
    try:
        version, holder = engine.command("HMGET", engine.keys.meta, "version", "lk")
    except Exception:
        return None
    if version is None:
        return False  # the store is gone: nothing to keep
    if int(version) == new.version and holder is not None and holder.decode() == token:
        return True
    return False if int(version) == h.version else None


def _renumber(keys: StoreKeys, part: Part, ops: list[list[Any]]) -> Part:
    """``ops`` (key indices into ``part``'s KEYS) on a key table of their own."""
    out = split(keys, part.kt.keys, ops, WRITE_OPS)
    ((_, only),) = out.items()
    return only


def _abort(engine: SegmentHost, h: Header, token: str, new: Header, after: int, call: Call) -> None:
    """Undo what this change prepared, then let the lock go. When the undo fails the lock is kept:
    its lease runs out and the next holder undoes the rest, with the leaf numbers and segments
    the lock records (a released lock would forget them)."""
    rollback(engine, h, token, new.next_leaf, after)
    _drop(engine, call)
    release(engine, token)


def _drop(engine: SegmentHost, call: Call) -> None:
    if call.staged:
        engine.client.delete(*(k for k, _ in call.staged))


def copy_on_write(keys: StoreKeys, h: Header, new: Header, kt: KeyTable, ops: list[list[Any]]) -> tuple[Header, list[list[Any]]]:
    """A spread store's schema change with its in-place writes turned into writes to copies.

    A schema change prepares the other segments before it commits the header, on other
    nodes: a key it wrote in place there would show its new bytes before the commit (next
    to the old bytes of a key whose layout changes, which appear only at the commit: a torn
    element), and would keep them if the change is rolled back. So every key of a leaf that
    lives on (the row block included) and that the call writes is first copied, on the
    server, to a new leaf number ('O'), the call writes the copy, the new header names the
    copy (with a new leaf version, so clients of the old schema are refused), and the old
    keys are deleted after the commit. Runs before localizing: ops name segment 0's keys (whole
    leaves), or one segment's (an element's own write), and each keeps its segment.
    """
    live = {leaf.number for leaf in new.leaves.values()} & {leaf.number for leaf in h.leaves.values()}
    if h.row is not None and new.row is not None and h.row[0] == new.row[0]:
        live.add(h.row[0])
    names = {}  # key -> (role, leaf number, segment), in every segment
    for seg in range(max(h.segments.n, new.segments.n)):
        for n in range(max(h.next_leaf, new.next_leaf)):
            for role, key in zip("dos", keys.leaf_keys(n, seg)):
                names[key] = (role, n, seg)
    written = set()
    for op in ops:
        if op[0] != Write.D.marker:
            for k in write_kind(op).written(op):
                w = names.get(kt.keys[k - 1])
                if w is not None and w[1] in live:
                    written.add(w[1])
    if not written:
        return new, ops
    remap = {n: new.next_leaf + i for i, n in enumerate(sorted(written))}

    def retarget(op: list[Any]) -> list[Any]:
        out = list(op)
        for i in write_kind(op).keys:
            w = names.get(kt.keys[op[i] - 1]) if op[i] else None
            if w is not None and w[1] in remap:
                out[i] = kt.ref(keys.leaf_keys(remap[w[1]], w[2])["dos".index(w[0])])
        return out

    copies = [Write.O(kt.ref(src), kt.ref(dst)) for n, m in remap.items() for src, dst in zip(keys.leaf_keys(n), keys.leaf_keys(m))]
    retire = [Write.D(kt.ref(k)) for n in remap for k in keys.leaf_keys(n)]
    block_moves = new.row is not None and new.row[0] in remap
    leaves = {
        path: replace(leaf, number=remap.get(leaf.number, leaf.number), version=new.version)
        if leaf.number in remap or (block_moves and leaf.col is not None)
        else leaf
        for path, leaf in new.leaves.items()
    }
    row = (remap[new.row[0]], new.row[1]) if block_moves and new.row is not None else new.row
    return replace(new, leaves=leaves, row=row, next_leaf=new.next_leaf + len(remap)), [*copies, *(retarget(op) for op in ops), *retire]
