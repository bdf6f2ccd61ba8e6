"""A sharded ring's rate limiter, queue and pop (leases, ack), and waiting on its state."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis

from tdstore._engine.deadline import check_timeout, within
from tdstore._engine.engine import request_id
from tdstore._errors import AmbiguousTimeoutError, ShardUnavailableError
from tdstore._ring.args import check_batch_size
from tdstore._ring.leases import LeasedSample, Receipt
from tdstore._shards import rollout_refusal
from tdstore._shards.fan_out import _POLL_S, _UNREACHABLE, NotSentError, ShardsBase, _with_kwargs

#: A pop sent to a shard that had unread items waits there this long at most when another reader took them first.
_POP_WAIT_S = 1.0
#: A shard whose counters a pop (or a held extend) reads is skipped for this round when its node does not answer
#: within this many seconds (a node that is down: the other shards serve meanwhile).
_HEAD_WAIT_S = 0.5
#: ... and at least this long when the pop's deadline is nearer (what it may overrun its deadline by, a node down).
_HEAD_FLOOR_S = 0.25


@dataclass(frozen=True)
class ShardReceipt:
    """What ``ack`` needs for a leased pop of a sharded ring: the shard and its own receipt."""

    shard: int
    receipt: Receipt


class ShardQueue(ShardsBase):
    """The rate limiter, the queue and pop of a sharded ring."""

    _next: int  # this handle's next shard to extend
    _pop_next: int  # and to pop from

    def _guarded(self) -> bool:
        """Whether a shard may hold an extend back (a rate limiter or queue mode, as this handle knows the policy).

        Any shard's cached header tells: each is refreshed by the calls and reads on its shard (a shard's extend
        adopts a header another handle changed), so the first extend that meets a policy set elsewhere makes the
        next ones wait on the counters of every shard; a policy cleared elsewhere is seen by the counters' read."""
        return any(pol is not None and (pol.limit is not None or pol.queue) for pol in _policies(self._shards))

    def _heads(self, leases: bool = False, deadline: float | None = None) -> list[dict[str, int | None] | None]:
        """Each shard's ring and limiter counters (``rw``, ``sn``, ``lb``, ``rr``, ``lo``), read at once; with
        ``leases``, ``due``: whether a lease of the shard has run out (by this machine's clock) or items wait
        for redelivery. ``rw`` is the count the scripts work with (``Engine.ring_writes_from``): a shard filled
        by index is a full ring. None for a shard whose node did not answer within :data:`_HEAD_WAIT_S` (or
        what is left until ``deadline``, ``time.monotonic()``, but at least :data:`_HEAD_FLOOR_S`: a
        ``pop(timeout=0)`` reads every shard's counters, a busy machine's slow reply included): the caller
        goes on with the others and asks it again next time.

        The same read carries the shard's header version: when another handle changed the policy (cleared
        the rate limiter, say), this handle adopts the new header before judging the counters, so a
        waiting ``extend`` or ``pop`` never waits on a limiter that is gone."""

        wait = _HEAD_WAIT_S if deadline is None else max(min(_HEAD_WAIT_S, deadline - time.monotonic()), _HEAD_FLOOR_S)

        def one(k: int) -> dict[str, int | None] | None:
            e = self._shards[k]._engine
            try:
                with within(wait, f"reading shard {k}'s counters"):
                    raw = e.command("HMGET", e.keys.meta, "rw", "sn", "lb", "rr", "lo", "na", "version")
                    e.adopt_version(raw[6])  # raises, naming the store, if it was deleted or damaged
                    got: dict[str, int | None] = {f: None if v is None else int(v) for f, v in zip(("sn", "lb", "rr", "lo"), raw[1:5])}
                    got["rw"] = e.ring_writes_from(raw[0], raw[5])
                    if leases and got["lo"] is not None:
                        got["due"] = int(self._lease_due(e))
            except (*_UNREACHABLE, TimeoutError):
                return None
            return got

        return self._fan_out([(k, one, (k,)) for k in range(len(self._shards))])

    @staticmethod
    def _lease_due(e: Any) -> bool:
        """Whether shard engine ``e`` has a lease past its deadline (by this machine's clock) or items waiting
        for redelivery: ``ZCOUNT`` of the deadlines up to now and ``ZCARD`` of the redelivery queue, one
        transaction. Integer replies: the same on RESP2 and RESP3 (``ZRANGE ... WITHSCORES``, read here
        before, is a flat list on one and pairs on the other)."""
        _, deadlines, waiting = e.keys.lease_keys[:3]
        now = int(time.time() * 1000)
        replies = e.commands([("ZCOUNT", deadlines, "-inf", now), ("ZCARD", waiting)])
        return int(replies[0]) > 0 or int(replies[1]) > 0

    def _admitting(self, n: int, deadline: float | None) -> tuple[int, list[int | None]]:
        """Of the shards whose rate limiter and queue admit an extend of ``n`` rows now (as their counters
        say; waiting, polling them, while none does), the least written for its size, ties taken in turn,
        and every shard's ring write count as the same read found it (None: its node did not answer).
        Choosing by the fresh counts keeps the shards' fill even whatever the limiters hold back, so no
        shard wraps while another has room (``shard_writes.place`` cuts the extend if that shard's lap has
        too little room). The extend is then sent with what is left of the caller's ``deadline``
        (``time.monotonic()``; None: none): a shard that filled up meanwhile holds it back as on one node."""
        pause = _POLL_S[0]
        k_total = len(self._shards)
        while True:
            heads = self._heads()
            order = [(self._next + i) % k_total for i in range(k_total)]
            admitting = [k for k in order if (h := heads[k]) is not None and self._admits(k, h, n)]
            if admitting:
                k = min(admitting, key=lambda k: ((heads[k] or {}).get("rw") or 0) / self._layout.counts[k])
                return k, [None if h is None else h.get("rw") for h in heads]
            pause = self._pause(
                deadline, pause, f"extend: the rate limiter or queue of every shard of the sharded ring td_id={self.td_id!r} holds inserts"
            )

    def _admits(self, k: int, head: dict[str, int | None], n: int) -> bool:
        pol = self._shards[k]._engine.header.sampling
        if pol is None:
            return True
        rw, sn, lb, rr = (head[f] or 0 for f in ("rw", "sn", "lb", "rr"))
        if pol.limit is not None and (rw - lb + 1) * pol.limit.samples_per_insert - sn > pol.limit.max_diff:
            return False
        unread = rr if head["lo"] is None else min(rr, head["lo"] or 0)
        return not (pol.queue and rw + n - unread > self._layout.counts[k])

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        """A rate limiter on every shard: ``min_size`` and ``error_buffer`` split in proportion to the
        shards' counts (each at least ``max(1, samples_per_insert)``). The whole buffer's samples minus
        ``samples_per_insert`` times its inserts stays within the sum of the shards' buffers (see the module docstring)."""
        if isinstance(min_size, bool) or not isinstance(min_size, int) or not 1 <= min_size <= self._layout.count:
            raise ValueError(f"min_size must be an int from 1 to the ring's {self._layout.count} slots, got {min_size!r}")
        n = self._layout.count
        jobs = []
        for k, c in enumerate(self._layout.counts):
            m = max(1, math.ceil(min_size * c / n))
            eb = None
            if (
                error_buffer is not None
                and samples_per_insert is not None
                and isinstance(error_buffer, (int, float))
                and isinstance(samples_per_insert, (int, float))
            ):
                eb = max(error_buffer * c / n, max(1.0, float(samples_per_insert)))
                if error_buffer < max(1.0, samples_per_insert):
                    eb = error_buffer  # the shard refuses it, with the one-node message
            elif error_buffer is not None:
                eb = error_buffer
            jobs.append(
                (
                    k,
                    _with_kwargs(
                        self._shards[k].set_rate_limit, {"min_size": m, "samples_per_insert": samples_per_insert, "error_buffer": eb}
                    ),
                    (),
                )
            )
        self._fan_out(jobs)

    def clear_rate_limit(self) -> None:
        self._all("clear_rate_limit")

    def set_queue(self, on: bool = True) -> None:
        """Queue mode on every shard: an extend that would overwrite items no one popped waits."""
        self._all("set_queue", on)

    def track_distinct(self, on: bool = True) -> None:
        """Distinct rows sampled counted on every shard (each its own bitmap; ``stats()`` adds them up)."""
        self._all("track_distinct", on)

    # -- pop ---------------------------------------------------------------------------------
    def pop(self, *args: Any, **kwargs: Any) -> Any:
        """``pop(batch_size=1, *, timeout=None, keys=None, lease=None)``: see :meth:`pop_items`."""
        return self.pop_items(*args, **kwargs)

    def pop_items(
        self,
        batch_size: int = 1,
        *,
        timeout: float | None = None,
        keys: Sequence[Any] | None = None,
        lease: float | None = None,
        max_staleness: int | None = None,
        groups: int | None = None,
        token_budget: int | None = None,
        length_key: Any = None,
    ) -> Any:
        """Up to ``batch_size`` unread items of one shard, each handed to exactly one caller (in write
        order within the shard; not across shards). The shards are tried in turn; with none unread, the
        pop waits (polling the shards) up to ``timeout`` seconds (``TimeoutError``; ``None``: no limit).
        ``lease=S``: as the one-node ring, the items return ``S`` seconds after a pop that does not ``ack``.

        A shard whose node is down is skipped (the others serve); the call keeps its deadline (each shard's
        pop is given what is left; the shards' counters are read within :data:`_HEAD_FLOOR_S` at least). A pop
        that may have taken items without their reply reaching this handle raises an error carrying its
        request id and ``retry()``, which gets those items (``AmbiguousTimeoutError`` when the deadline
        passed, ``ShardUnavailableError`` when the node or its replicas failed)."""
        rollout_refusal.refuse("pop", max_staleness=max_staleness, groups=groups, token_budget=token_budget, length_key=length_key)
        check_batch_size(batch_size, "pop")
        check_timeout(timeout)
        return self._pop(batch_size, timeout, {"keys": keys, "lease": lease})

    def _pop(self, batch_size: int, timeout: float | None, kwargs: dict[str, Any]) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        k_total = len(self._shards)
        while True:
            heads = self._heads(leases=True, deadline=deadline)
            away = [k for k, h in enumerate(heads) if h is None]
            for i in range(k_total):
                k = (self._pop_next + i) % k_total
                h = heads[k]
                if h is None or ((h["rw"] or 0) <= (h["rr"] or 0) and not h.get("due")):
                    continue
                got = self._pop_shard(k, batch_size, deadline, kwargs)
                if got is None:
                    break
                self._pop_next = (k + 1) % k_total
                return self._global(k, got)
            else:
                pause = self._pause(deadline, pause, self._nothing_to_pop(away))
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self._nothing_to_pop(away)}, timed out")

    def _nothing_to_pop(self, away: list[int]) -> str:
        what = f"pop: no unread item in the {len(self._shards)} shards of the sharded ring td_id={self.td_id!r}"
        if away:
            what += f" (shards {away} on nodes {[self._node_of(k) for k in away]} did not answer: down, or failing over)"
        return what

    def _pop_shard(self, k: int, batch_size: int, deadline: float | None, kwargs: dict[str, Any]) -> Any:
        """One pop of shard ``k``, which had unread items: its items, or None when another reader took them first
        (the pop waited there :data:`_POP_WAIT_S` at most, and nothing was taken).

        A pop whose reply did not come in that time (the node slow or away: a ``TimeoutError`` caused by the
        connection) may have taken items: it is sent again with the same request id, which the server answers
        with the items the first one took, until it answers or the caller's deadline passes; then it raises
        ``AmbiguousTimeoutError`` (its ``retry()`` sends it again under that id)."""
        request = request_id()
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = _POP_WAIT_S if left is None else min(left, _POP_WAIT_S)
            try:
                return self._pop_once(k, batch_size, kwargs, request, wait)
            except TimeoutError as err:
                if not _lost_reply(err):
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    raise AmbiguousTimeoutError(
                        f"pop on shard {k} of the sharded ring td_id={self.td_id!r} (node {self._node_of(k)}): no reply "
                        f"within the timeout, and it may have taken items (err.retry() gets them, exactly once): {err}",
                        request_id=request,
                        resend=self._resend_pop(k, batch_size, kwargs, request),
                    ) from err

    def _pop_once(self, k: int, batch_size: int, kwargs: dict[str, Any], request: str, wait: float | None, again: bool = False) -> Any:
        """Shard ``k``'s pop under id ``request`` (its items in the shard's numbering; ``again``: a resend). A node
        or replicas that failed raise ``ShardUnavailableError`` with the id and a ``retry()`` that sends it
        again; a first pop refused before it was sent (too few replicas) raises without them."""
        pop = _with_kwargs(self._shards[k].pop_items, {**kwargs, "timeout": wait, "_request": request})
        try:
            return self._on(k, *self._acked(k, pop), batch_size)
        except ShardUnavailableError as err:
            if err.request_id is not None or (isinstance(err, NotSentError) and not again):
                raise
            taken = None if err.taken is None else self._global(k, err.taken)
            raise ShardUnavailableError(
                f"{err} [pop request {request}: err.retry() sends it again and gets the items it took]",
                k,
                request_id=request,
                resend=self._resend_pop(k, batch_size, kwargs, request),
                taken=taken,
            ) from err

    def _resend_pop(self, k: int, batch_size: int, kwargs: dict[str, Any], request: str) -> Any:
        """What ``retry(timeout)`` of a pop's error runs: the same pop on shard ``k`` under ``request``."""

        def resend(timeout: float | None) -> Any:
            with self._within(timeout, "pop (sent again)"):
                return self._global(k, self._pop_once(k, batch_size, kwargs, request, timeout, again=True))

        return resend

    def _global(self, k: int, got: Any) -> Any:
        off = self._offsets[k]
        if isinstance(got, LeasedSample):
            receipt: Any = ShardReceipt(k, got.receipt)  # what this ring's ack takes
            return replace(got, indices=got.indices + off, receipt=receipt, _store=self)
        return got._replace(indices=got.indices + off)

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        """Settle the items of a leased pop (its receipt, or the ``LeasedSample``) on their shard."""
        if isinstance(receipt, LeasedSample):
            receipt = receipt.receipt
        if not isinstance(receipt, ShardReceipt):
            raise ValueError(f"a sharded ring acks the receipts its own pops give (ShardReceipt), got {type(receipt).__name__}")
        k = receipt.shard
        with self._within(timeout, "ack"):
            return int(self._on(k, *self._acked(k, _with_kwargs(self._shards[k].ack, {"timeout": timeout})), receipt.receipt))


def _policies(shards: Sequence[Any]) -> list[Any]:
    """Each shard's sampling policy as this handle last saw it (its cached header)."""
    return [s._engine.header.sampling for s in shards]


def _lost_reply(err: BaseException) -> bool:
    """Whether a shard call's ``TimeoutError`` came from its connection (the reply lost or late: the call may
    have run), not from waiting for items (nothing taken)."""
    connection = (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError)
    return isinstance(err, AmbiguousTimeoutError) or isinstance(err.__cause__, connection)
