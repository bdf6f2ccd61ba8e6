"""The storage engine shared by every front class: plans, one server call, results.

Every public operation of a store ends here as *one* round trip: a call to a script of
``lua/`` (``EVALSHA``), or, for reads whose byte ranges the client can name itself
(homogeneous keys, heterogeneous rows whose offset tables it keeps, see ``_format.offsets``), one
``MULTI``/``EXEC`` of plain ``GETRANGE``s that reads the header's versions in the same
transaction. The engine plans the call from its cached :class:`~tdstore._format.schema.Header`;
the script (or the client, for a transaction) checks the versions first and, when the cache
is stale, the engine adopts the current header and plans again. So the common case costs
one round trip, and a stale cache costs one more, never wrong data.

How ``store[i] = td`` becomes one call:

1. The handle's write surface (``_front.write_surface``: the same for every store class and view)
   splits ``td`` into its leaves and hands :meth:`Engine.run_write`
   a *plan*: a function of the cached header that returns the ops, built with the op kinds of
   ``_format.op_kinds.Write`` (``_plan.element_write.plan_element_write``: one ``R`` op, a SETRANGE of the element's
   bytes, per homogeneous leaf, or one for the row of the small leaves the row block groups,
   and one ``E`` splice per heterogeneous leaf; ``_plan.write_plan.plan_write``
   for any other index, new keys or a key changing shape). Every check of the value happens
   there, before anything is sent.
2. :meth:`Engine.run_write_reply` turns the ops into ``write.lua``'s ARGV (``_engine.write_call``): the header's epoch,
   the ``number:version`` of each leaf touched, what each key must hold (``_format.integrity``), and the
   ops, cut per segment by ``_format.segments.localize_write`` when the store has several.
3. :meth:`Engine.run` sends it (``_engine.scripts.call``: one ``EVALSHA`` on the handle's held
   connection, ``_engine.transport``). The script checks the versions, checks every argument, then
   writes; a ``STALE`` reply carries the current header, which the engine adopts before it
   plans again. A spread store's call goes per segment and node instead (``_engine.spread_call``,
   ``_engine.spread``).

A read goes the same way: ``_plan.read_plan`` plans it (a transaction of GETRANGEs when the client
can name the bytes, else ``read.lua`` ops built with ``_format.op_kinds.Read``) and the call's ``parse``
(``_plan.read_results``)
turns the reply into tensors.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import redis

from tdstore._engine import limits, scripts
from tdstore._engine.batches import clear_lapsed
from tdstore._engine.connection import ConnectionSpec
from tdstore._engine.spread import LEASE_MS, LOCAL, WAIT
from tdstore._engine.spread_call import SCRIPT_READS, cut_per_segment, spread_call
from tdstore._engine.transport import NO_TRANSACTION, Transport, refused_for_good
from tdstore._engine.write_call import leaf_shapes, write_call
from tdstore._errors import MustWait, QueueOverrunError, ReadOnlyReplicaError, StoreDamagedError
from tdstore._format import integrity, segments
from tdstore._format.header_info import DELETING, HeaderDamagedError, int_field, ring_writes
from tdstore._format.keys import KeyTable, StoreKeys, check_td_id
from tdstore._format.offsets import OffsetTables
from tdstore._format.schema import Header, Leaf, NestedPath, StoreFormatError, check_paths
from tdstore._plan import read_plan
from tdstore._plan.call import Call, leaf_checks
from tdstore._plan.index import Plan
from tdstore._plan.read_results import DenseResult, ElementsResult, NotRagged

MAX_RETRIES = 64
#: The most keys ``Engine.wrong_type`` asks the type of (one pipeline, only after a ``WRONGTYPE``).
_TYPE_PROBES = 4096


class StaleSchemaError(RuntimeError):
    """The schema kept changing under this client for ``MAX_RETRIES`` calls in a row."""


def _pairs(flat: Sequence[bytes]) -> dict[bytes | str, bytes | str]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def lost_race(attempt: int) -> None:
    """The back-off of a call that lost a race against another client's schema change (``attempt``
    counts the losses so far, from 0): none for the first 8, then a random wait that doubles up to
    20 ms, so clients racing each other drift apart instead of colliding in step. (A spread store's
    call waiting for another client's change to finish waits on that instead: ``_engine.spread_call``.)"""
    if attempt >= 8:
        time.sleep(min(0.02, 0.0005 * 2 ** (attempt - 8)) * random.random())


def new_td_id() -> str:
    """A fresh store id (a UUID4 string)."""
    return str(uuid.uuid4())


def td_id_or_new(td_id: str | None) -> str:
    """The id a constructor's ``td_id=`` names: a fresh one for None, else the one given, checked
    (``keys.check_td_id``: an empty id is refused, never silently replaced)."""
    return new_td_id() if td_id is None else check_td_id(td_id)


def request_id() -> str:
    """A fresh request id (128 random bits, hex): one per public operation that changes state and is not
    naturally idempotent, sent with every attempt of it, so that the script runs it once however often
    redis-py resends it (see ``lua/_lib.lua`` ``tds_request``)."""
    return secrets.token_hex(16)


class Engine(Transport):
    """Plans and runs the calls of one store on one server (sent by ``Transport``)."""

    def __init__(
        self,
        spec: ConnectionSpec,
        keys: StoreKeys,
        client: redis.Redis | None = None,
        *,
        owns_client: bool = True,
        readonly: bool = False,
        segment_bytes: int | None = None,
        spread: bool = False,
    ) -> None:
        # on Redis Cluster every key of a store shares the header's hash tag (one slot), so a
        # call may still touch the header and any segment, unless the store is spread over the
        # nodes (see _spread; the header says which, and set_header follows it)
        check_td_id(keys.td_id)  # every way to a handle (from_store, attach, a pickle) comes here before any call
        self.spread = spread and spec.cluster  # a store this handle creates is spread
        super().__init__(spec, replace(keys, segment_tags=self.spread) if spec.cluster else keys, client, owns_client)
        self.readonly = readonly
        self._header: Header | None = None
        self._epoch: str | None = None  # the creation this handle belongs to
        self.transactions = True  # dense reads as MULTI/EXEC of plain GETRANGE (see Call); off for good once the server refuses MULTI
        self._script_reads = threading.local()  # .on: this thread's call is read again through read.lua
        self._counting = threading.local()  # .on: this thread's write.lua calls also count an in-place write ('tr')
        self.ring_full = False  # a sample saw every slot of the ring written (rw only grows)
        self.written_seen = 0  # the written length a sample_seen saw (its next draws go below it; 0: read it)
        self.offsets = OffsetTables()  # heterogeneous leaves' offset tables: their rows read as plain GETRANGEs
        self.segment_bytes = segments.check_segment_bytes(segment_bytes)  # used when a store's first data arrives
        self.checks_memo = integrity.ChecksMemo()  # write.lua's ARGV[6], built once per header and key list

    # -- connection and header ----------------------------------------------
    @property
    def segment_size(self) -> int:
        """Target bytes of one segment's blob of one leaf: ``segment_bytes``, within what the server accepts."""
        return min(self.segment_bytes, self.max_value_bytes)

    def check_room(self, h: Header, element_bytes: int, declared: int | None = None) -> None:
        """Refuse, before anything is written, a store whose declared size (``count`` elements of
        ``element_bytes``, or ``declared`` bytes when known exactly: an upload) cannot fit the
        server's maxmemory (on Redis Cluster: that of the node ``limits`` read, for a store in one
        slot), or that would need more segments than one call can name (``_format.segments.MAX_SEGMENTS``)."""
        declared = h.count * element_bytes if declared is None else declared
        # a spread store's segments are spread over the nodes: each node refuses its own part
        limit = 0 if (self.spread or h.spread) else self.limits.maxmemory
        if limit and declared > limit:  # read the setting again before refusing: it may have changed
            limits.forget(self.spec.describe())
            self._limits = None
            limit = self.limits.maxmemory
        if limit and declared > limit:
            raise MemoryError(
                f"a store of {h.count} elements ({element_bytes} bytes each) needs {declared} bytes, more than the server's "
                f"maxmemory ({limit} bytes); nothing was written ({self.where()})"
            )
        if h.segments.n > segments.MAX_SEGMENTS:
            raise ValueError(
                f"a store of {h.count} elements of {element_bytes} bytes needs {h.segments.n} segments of {self.segment_size} bytes, "
                f"more than {segments.MAX_SEGMENTS}; pass a larger segment_bytes or a smaller count; nothing was written ({self.where()})"
            )

    @property
    def header(self) -> Header:
        if self._header is None:
            self.set_header(self.fetch_header())
        assert self._header is not None  # set_header keeps the header it is given
        return self._header

    def set_header(self, header: Header | None) -> None:
        """Adopt ``header``; refuse one of another creation of the store (same id, recreated)."""
        if header is not None:
            if self._epoch is None:
                self._epoch = header.epoch
            elif header.epoch != self._epoch:
                self._header = None
                raise KeyError(
                    f"the store with {self.where()} was deleted and created again since this handle opened it; reopen it with from_store"
                )
            if self.spec.cluster and self.keys.segment_tags != header.spread:
                self.keys = replace(self.keys, segment_tags=header.spread)
        self._header = header

    def key_table(self, h: Header) -> KeyTable:
        """A call's KEYS: the header first, then the inventory when the store keeps one (see ``_format.integrity``)."""
        return KeyTable(self.keys.meta, self.keys.inventory) if h.tracked else KeyTable(self.keys.meta)

    def fetch_header(self) -> Header:
        """Read the header in one round trip (``HGETALL``); never writes."""
        try:
            raw = self.command("HGETALL", self.keys.meta)
        except (redis.exceptions.ConnectionError, redis.exceptions.ClusterDownError) as err:
            raise self.unreachable(err) from err
        except redis.exceptions.ResponseError as err:
            if "WRONGTYPE" in str(err):  # not a hash: another client wrote the header's name
                raise self.wrong_type([self.keys.meta]) from None
            raise
        if not raw:
            raise self.gone()
        return self._parse_header(raw if isinstance(raw, dict) else _pairs(raw))

    def _parse_header(self, raw: dict) -> Header:
        try:
            header = Header.from_fields(raw)
        except HeaderDamagedError as err:  # a value edited by hand: named like any damaged store
            raise integrity.damaged(self.where(), str(err), self.keys.td_id, header=True) from None
        except StoreFormatError as err:
            raise StoreFormatError(f"{err} ({self.where()})") from None
        if header.state == DELETING:
            raise self.gone()
        if header.state != "ready":
            raise KeyError(f"the store with {self.where()} is still being uploaded (state {header.state!r})")
        return header

    def adopt_stale(self, reply: list) -> None:
        """Adopt the current header that a script's reply carries (field, value, ... after the marker):
        a ``STALE`` reply's, or the new header a schema-changing script sends back with its ``OK``."""
        self.set_header(self._parse_header(_pairs(reply[1:])))

    def ring_writes(self, *, fresh: bool = False) -> int:
        """The ring write counter of the header, in one round trip (``HMGET``); never writes.

        ``rw`` as ring calls see it (``_format.header_info.ring_writes``): a store holding data the ring
        never wrote counts as a full ring of ``count`` writes. With ``fresh``, the read also carries the
        header's ``version`` and a header that moved is adopted first (:meth:`adopt_version`).
        """
        rw, epoch, na, version = self.command("HMGET", self.keys.meta, "rw", "epoch", "na", "version")
        if epoch is None:
            raise self.gone()
        if self._epoch is not None and epoch.decode() != self._epoch:
            raise KeyError(
                f"the store with {self.where()} was deleted and created again since this handle opened it; reopen it with from_store"
            )
        if fresh:
            self.adopt_version(version)
        return self.ring_writes_from(rw, na)

    def adopt_version(self, raw: Any) -> None:
        """Adopt the current header when ``raw``, the header field ``version`` as a read of other fields carried
        it (an ``HMGET``, a pipeline), is not the cached header's: one more round trip (``HGETALL``), only then.
        What the caller then derives from the fields it read (``ring_writes_from``, the sampling policy) goes
        by the header they belong to, not by one another handle changed since. Raises, naming the store, if
        it was deleted, recreated or damaged."""
        try:
            same = raw is not None and int(raw) == self.header.version
        except (TypeError, ValueError):
            same = False
        if not same:
            self.set_header(self.fetch_header())

    def ring_writes_from(self, rw: Any, na: Any, header: Header | None = None) -> int:
        """The ring write count from the header fields ``rw`` and ``na`` as read (here, or by a read
        transaction), as ring calls see it (``_format.header_info.ring_writes``: a store holding data the ring
        never wrote is a full ring), each range-checked as the scripts check them."""
        h = header or self.header
        na_count = None if na is None else self._checked_field(na, "na")
        return ring_writes(self.rw_field(rw), na_count, bool(h.leaves), h.count)

    def rw_field(self, raw: Any) -> int:
        """The header field ``rw`` as read (here, or by a read transaction), range-checked as the scripts
        check it: ``StoreDamagedError`` naming the store and the field for a value tdstore never writes."""
        return self._checked_field(raw, "rw")

    def _checked_field(self, raw: Any, name: str) -> int:
        try:
            return int_field(raw, name, default=0)
        except HeaderDamagedError as err:
            raise integrity.damaged(self.where(), str(err), self.keys.td_id, header=True) from None

    def create(self, header: Header, ttl_ms: int = 0) -> Header | None:
        """Create the header unless one exists; return the existing header if so (one round trip)."""
        if self.spread and not header.spread:
            header = replace(header, spread=True)
        # a store on one slot keeps an inventory of its keys, so it can allocate them when first written
        header = replace(header, tracked=not header.spread)
        args: list[Any] = [ttl_ms, self.keys.td_id]
        for k, v in header.fields().items():
            args += [k, v]
        with self.naming_errors():  # a header or registry of another type (WRONGTYPE), a server away
            for _ in range(3):
                if self.spec.cluster:  # the registry lives in another slot: added right after, not atomically
                    reply = scripts.call(self.client, "create", [self.keys.meta], args)
                    if reply[0] == b"OK":
                        self.client.sadd(self.keys.registry, self.keys.td_id)
                else:
                    reply = scripts.call(self.client, "create", [self.keys.meta, self.keys.registry], args)
                if reply[0] != b"LAPSED":
                    break
                # what a delete or a deadline change cut in batches left half-done: delete it, create again
                clear_lapsed(self.client, self.keys, _pairs(reply[1:]), self.spec.cluster)
        if reply[0] == b"OK":
            self.set_header(header)
            return None
        if reply[0] == b"LAPSED":  # deleted half-way again and again: another client keeps cutting it short
            raise KeyError(
                f"the store with {self.where()} is being deleted (or its time to live changed) by another client "
                "while this one creates it again; try again once that is done"
            )
        existing = _pairs(reply[1:])
        epoch = existing.get(b"epoch", existing.get("epoch"))
        if (epoch.decode() if isinstance(epoch, bytes) else epoch) == header.epoch:
            # this call's own header (its epoch is fresh): redis-py resent the create after a lost reply
            if self.spec.cluster:
                self.client.sadd(self.keys.registry, self.keys.td_id)
            self.set_header(header)
            return None
        return Header.from_fields(existing)

    # -- running calls ---------------------------------------------------------
    def run(self, plan: Callable[[Header], Call]) -> Any:
        """Plan with the cached header and call; on STALE refresh from the reply and re-plan.

        The fresh header comes with the STALE reply, so the retry is immediate; only
        a call that keeps losing the race against a storm of schema changes starts to
        wait a little (random, up to 20 ms) between tries.
        """
        with self.naming_errors():
            return self._run(plan)

    @contextmanager
    def naming_errors(self) -> Iterator[None]:
        """Errors raised inside name this store and its server (a damaged store, a read-only replica,
        a server that cannot be reached: the same types, so callers' handling keeps working)."""
        try:
            yield
        except integrity.WrongTypeError as err:
            raise self.wrong_type(err.keys) from None
        except StoreDamagedError as err:
            if err.named:
                raise
            raise integrity.damaged(self.where(), str(err), self.keys.td_id) from None
        except ReadOnlyReplicaError as err:
            if err.named:
                raise
            raise ReadOnlyReplicaError(f"{self.spec.describe()} (store {self.keys.td_id!r}): {err}") from None
        except (redis.exceptions.ConnectionError, redis.exceptions.ClusterDownError) as err:
            raise self.unreachable(err) from err

    def wrong_type(self, keys: Sequence[str]) -> StoreDamagedError:
        """The ``StoreDamagedError`` of a ``WRONGTYPE`` the server gave a call on ``keys`` (none known: the
        store's keys that are not data): which key holds what, read with one ``TYPE`` pipeline."""
        names = list(
            dict.fromkeys(keys or [self.keys.meta, self.keys.inventory, self.keys.replies, *self.keys.sampling_keys, *self.keys.lease_keys])
        )
        pipe = self.client.pipeline(transaction=False)
        for key in names[:_TYPE_PROBES]:
            pipe.type(key)
        found = {key: (t.decode() if isinstance(t, bytes) else str(t)) for key, t in zip(names, pipe.execute(raise_on_error=False))}
        return integrity.damaged(self.where(), integrity.wrong_types(self.keys, found), self.keys.td_id)

    def unreachable(self, err: Exception) -> Exception:
        """``err`` (a connection error) naming the store and the server: same type, so retry policies keep working."""
        if isinstance(err, redis.exceptions.AuthenticationError) or self.where() in str(err):
            return err
        what = "the cluster node that holds" if self.spec.cluster else "the server of"
        try:
            return type(err)(f"{what} the store with {self.where()} cannot be reached: {err}")
        except TypeError:  # an exception type that takes other arguments
            return err

    def _run(self, plan: Callable[[Header], Call]) -> Any:
        for attempt in range(MAX_RETRIES):
            header = self.header
            call = plan(header)
            if header.segments.n > 1 and call.script in ("read", "tx"):
                self.localize_read(header, call)
            if cut_per_segment(header, call):
                reply = spread_call(self, plan, header, call)
                if reply is None:  # refreshed: plan again
                    lost_race(attempt)
                    continue
                if reply is SCRIPT_READS:
                    return self.run_with_script_reads(plan)
                if reply is not LOCAL:
                    return reply[0]
            if call.script == "tx":
                try:
                    reply = self._transaction(call)
                except redis.exceptions.ResponseError as err:
                    return self.transaction_refused(err, plan)
                if reply is NO_TRANSACTION:  # a cluster slot that moved, a node away: the script follows redirects
                    return self.run_with_script_reads(plan)
                if reply is None:  # the header moved: refresh, plan again
                    self.set_header(self.fetch_header())
                    continue
                if self.short(call, reply):  # a key never allocated, or one lost: read.lua tells which
                    return self.run_with_script_reads(plan)
                if call.verify is not None:
                    reply = call.verify(reply)
                    if reply is None:  # rows moved since their offsets were kept: read.lua reads them
                        return self.run_with_script_reads(plan)
                out = call.parse(reply)
                if call.fields and isinstance(out, DenseResult):
                    out.fields = call.field_values
                return out
            self.check_argument_sizes(call)
            reply = self._staged_call(call) if call.staged else scripts.call(self.client, call.script, call.keys, call.args, self.execute)
            status = reply[0]
            if status == b"OK":
                return call.parse(reply)
            if call.staged:  # refused: the staged blobs will not be moved anywhere
                self.client.delete(*(k for k, _ in call.staged))
            if status == b"STALE":
                self.adopt_stale(reply)
                lost_race(attempt)
                continue
            if status == b"GONE":
                raise self.gone()
            if status == b"WAIT":  # the sampling policy holds the call back (see _waiting)
                raise MustWait(reply[1].decode(), reply[2].decode())
            if status == b"LOST":
                lost = int(reply[1])
                if len(reply) > 2:  # a resent pop whose items writers overwrote since it ran
                    raise QueueOverrunError(
                        f"the reply to a pop of {lost} items from the store with {self.where()} was lost, and writers "
                        "overwrote those items before it was sent again: they are lost; the next pop goes on after them",
                        lost,
                    )
                raise QueueOverrunError(
                    f"writers overwrote {lost} items of the store with {self.where()} before anyone popped them; "
                    "the next pop goes on with the oldest item left",
                    lost,
                )
            raise scripts.ServerScriptError(f"unexpected reply {status!r} from {call.script}")
        raise StaleSchemaError(f"the schema of the store with {self.where()} changed on each of {MAX_RETRIES} tries of one call")

    @staticmethod
    def short(call: Call, reply: list) -> bool:
        """Whether a read transaction's reply holds fewer bytes than it asked for: a key shorter than
        the header implies (never allocated, or lost), which only ``read.lua`` can tell apart."""
        assert call.ranges is not None
        for buf, pieces in zip(reply[2:], call.ranges):
            if len(buf) != sum(int(lengths.sum()) for _, _, lengths in pieces):
                return True
        return False

    def transaction_refused(self, err: redis.exceptions.ResponseError, plan: Callable[[Header], Call]) -> Any:
        """A server or ACL user without MULTI/EXEC (for good), or one that refuses the transaction now
        (at maxmemory a server refuses to queue commands): this call reads through the script."""
        if refused_for_good(err):
            self.transactions = False
        return self.run_with_script_reads(plan)

    @property
    def tx_reads(self) -> bool:
        """Whether this thread's dense reads go as transactions now (see ``transactions``)."""
        return self.transactions and not getattr(self._script_reads, "on", False)

    def run_with_script_reads(self, plan: Callable[[Header], Call]) -> Any:
        self._script_reads.on = True
        try:
            return self._run(plan)
        finally:
            self._script_reads.on = False

    # -- reads -------------------------------------------------------------------
    def read(
        self,
        index: Any,
        paths: Iterable[NestedPath] | None = None,
        *,
        under: NestedPath = (),
        per_element: bool = False,
        fields: Sequence[str] = (),
        counts: list[list[Any]] | None = None,
    ) -> tuple[Plan | None, DenseResult | ElementsResult]:
        """Read leaves at ``index`` in one round trip.

        ``paths`` names the leaves; ``None`` reads every leaf below ``under`` (all
        of them by default), chosen from the header the call is planned with, so a
        refresh after STALE picks up added, renamed or deleted keys.  Returns the
        plan (None for one whole element, read without planning) and either a dense result (tensors of the indexed batch shape) or, when
        a heterogeneous leaf is read or ``per_element`` is set, the touched elements
        one by one (to be stacked lazily by the caller). ``fields`` names header fields
        to read atomically with a dense read (``DenseResult.fields``; None when the read
        went through a script instead). ``counts``: commands a read transaction ends with (a sample's counters).
        """
        wanted = None if paths is None else list(paths)
        result: dict[str, Any] = {}
        out = self.run(lambda h: read_plan.read_call(self, h, index, wanted, under, per_element, fields, result, counts))
        return result["plan"], out

    def read_ragged(self, path: NestedPath, ids: np.ndarray) -> tuple[Leaf, np.ndarray, Any] | None:
        """Elements ``ids`` (sorted, unique) of the heterogeneous leaf ``path`` as raw pieces, in one
        round trip: ``(leaf, shape records (n, ndim), data)``, the elements' bytes back to back in
        one buffer. No tensor per element is made: padded and jagged reads build one result from
        them. None when the leaf is not heterogeneous tensor data (the caller reads it as usual).
        """

        if not ids.size:
            return None
        try:
            return self.run(lambda h: read_plan.ragged_call(self, h, path, ids))
        except NotRagged:
            return None

    def localize_read(self, h: Header, call: Call) -> None:
        """Turn a read planned on whole leaves into segment-local ops (see ``_format.segments``), in place."""
        if call.script == "tx":
            assert call.ranges is not None
            call.ranges = segments.localize_ranges(h.segments, self.keys, leaf_shapes(h), call.ranges)
            return
        if not call.args[2]:  # after the two version checks: the op count
            return
        call.keys, ops, merge = segments.localize_read(h.segments, self.keys, leaf_shapes(h), call.keys, call.args[2:])
        call.args[2:] = ops
        planned = call.parse
        call.parse = lambda reply: planned(merge(reply))

    # -- writes ------------------------------------------------------------------
    @contextmanager
    def counting_in_place(self) -> Iterator[None]:
        """Within: every ``write.lua`` call this thread makes also adds 1 to the header's ``tr`` (a 'B'
        op), in the same script, so the write and the count move together in one round trip (torchrl's
        in-place writes: ``Ring.counting_in_place``, ``_ring.marks``)."""
        self._counting.on = True
        try:
            yield
        finally:
            self._counting.on = False

    @property
    def counts_in_place(self) -> bool:
        """Whether this thread's ``write.lua`` calls count an in-place write now (see :meth:`counting_in_place`)."""
        return bool(getattr(self._counting, "on", False))

    def run_write(
        self, plan: Callable[[Header, KeyTable], tuple[Header | None, list[list[Any]], list[Leaf]]], *, keyset: bool = False
    ) -> Header:
        """Run a write planned as (new header or None, ops, leaves touched); returns the header now current.

        ``plan`` gets the header to plan with and a fresh key table, and returns the
        ops (each a list: marker then arguments, see ``lua/write.lua``).  A schema
        change is checked against the exact version it was planned from; a plain
        data write only against the versions of the leaves it touches, and also
        against the key-set version with ``keyset`` (a ring write that must cover
        every key of the store, so a key added meanwhile makes it plan again).
        """
        return self.run_write_reply(plan, keyset=keyset)[0]

    def run_write_reply(
        self,
        plan: Callable[[Header, KeyTable], tuple[Header | None, list[list[Any]], list[Leaf]]],
        *,
        keyset: bool = False,
        request: str | None = None,
    ) -> tuple[Header, bytes | None]:
        """:meth:`run_write`, also returning the third reply item of ``write.lua`` (ring cursor or applied rows), if any.

        ``request`` (a ring write or ``update_if``: :func:`request_id`) goes first as an 'N' op, so that a
        resend of the call gets its first reply back instead of writing again."""
        self.refuse_if_readonly()
        state: dict[str, Header] = {}
        header, extra = self.run(lambda h: write_call(self, plan, h, keyset=keyset, request=request, state=state))
        self.set_header(header)
        return header, extra

    # -- whole store ---------------------------------------------------------------
    def refuse_if_readonly(self) -> None:
        if self.readonly:
            raise PermissionError(f"the store with {self.where()} is open read-only (readonly=True); open another handle to write")

    def run_spread(self, step: Callable[[Engine, Header], Any]) -> Any:
        """``step(self, header)`` until it gives a result (None: it refreshed the header, try again;
        ``_engine.spread.WAIT``: a schema change holds the lock, wait for it, at most its lease)."""
        deadline = time.monotonic() + LEASE_MS / 1000 + 5
        attempt = 0
        while attempt < MAX_RETRIES:
            out = step(self, self.header)
            if out is WAIT:
                if time.monotonic() > deadline:
                    break
                continue
            if out is not None:
                return out
            attempt += 1
            lost_race(attempt)
        raise StaleSchemaError(f"the schema of the store with {self.where()} changed on each of {MAX_RETRIES} tries of one call")

    def ttl_ms(self) -> int | None:
        """Milliseconds left before the store expires, ``None`` when it does not (one round trip)."""
        pttl = self.command("PTTL", self.keys.meta)
        if pttl == -2:
            raise self.gone()
        return None if pttl < 0 else int(pttl)


__all__ = ["Engine", "DenseResult", "ElementsResult", "Call", "check_paths", "leaf_checks"]
