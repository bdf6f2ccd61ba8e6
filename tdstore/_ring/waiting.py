"""Waiting for a ring without polling: retry a call when the store's Pub/Sub channel says something changed.

Ring writes, samples counted by a rate limiter, and pops publish on the store's
channel (``StoreKeys.events``) from inside their scripts. A call the server holds back
(a ``WAIT`` reply: too few items for ``min_size``, a rate limiter, a full queue, nothing
to pop, an empty ring) is tried again only after such a message, so a waiting learner or
writer costs the server nothing while it waits. The subscription is confirmed before the
retry that follows it, so a change made between the refused try and the subscription is
never missed. Keyspace notifications were the other way to wake a waiter; they need the
server's ``notify-keyspace-events`` setting (off by default, and refused by managed
servers), where a ``PUBLISH`` from a script works on every server tdstore supports.

A waiter also tries again once a second without a message (``SAFETY_S``): a message lost
with a dropped Pub/Sub connection then costs at most a second, never a hang.

A ``timeout`` is a deadline (``_engine.deadline``): the tries and the Pub/Sub connection (its
connect, subscribe and reads) all end by then, even when the server stops answering. A server
that stops answering (killed, restarting, failing over) is waited out within the deadline as any
other wait (each try's connection retries until the deadline, ``_engine.deadline.DeadlineRetry``;
a try that raises all the same is a wait too), and the ``TimeoutError`` says so. Where
the server's ACL refuses ``SUBSCRIBE`` (a read-only user without ``+subscribe`` and the
channel), the handle warns once and polls instead, every ``POLL_FIRST_S`` growing to
``POLL_MAX_S``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

import redis

from tdstore._engine.deadline import Deadline, answered, bounded, is_real, new_connection, within
from tdstore._engine.held import holding
from tdstore._errors import MustWait

T = TypeVar("T")

#: Longest wait between tries when no message comes (a lost message costs at most this).
SAFETY_S = 1.0
#: Polling where the ACL refuses SUBSCRIBE: the first pause, doubling up to the last.
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.2


def until_ready(engine: Any, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
    """``attempt()`` until the server stops answering ``WAIT``; ``TimeoutError`` after ``timeout`` seconds.

    ``timeout=None`` waits as long as it takes (or until the deadline of the call this one is
    part of); ``0`` tries once. ``what`` names the call in the timeout's message.
    """
    with within(timeout, what, engine.where) as deadline:
        try:
            return attempt()
        except MustWait as err:
            held = err
            answered()  # not run: a deadline passing from here on is a plain TimeoutError
        if deadline is not None and deadline.left() <= 0:
            raise _timed_out(engine, what, deadline, held)
        events = _Events(engine, deadline)
        timer = holding()
        timer.__enter__()  # the tries below carry the time held (counted by the one that goes through)
        try:
            events.start()
            while True:
                try:
                    return attempt()
                except MustWait as err:
                    held = err
                    answered()
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                    # the server went away (killed, restarting, failing over): a waiter with a deadline
                    # waits it out like any other wait, then times out naming it
                    if deadline is None or deadline.left() <= 0:
                        raise
                    held = MustWait("server", f"the server stopped answering while it waited ({type(err).__name__}: {err})")
                left = SAFETY_S if deadline is None else min(SAFETY_S, deadline.left())
                if left <= 0:
                    raise _timed_out(engine, what, deadline, held)
                events.wait(left)
        finally:
            timer.__exit__(None, None, None)
            events.close()


def _refused(err: Exception) -> bool:
    """Whether a Pub/Sub error is the server's ACL refusing the subscription."""
    text = str(err).lower()
    return "noperm" in text or "no permissions" in text


class _Events:
    """The store's channel as a waiter hears it: a Pub/Sub subscription, or polling where the ACL refuses one.

    Under a deadline the subscription has a connection of its own, bounded by the deadline
    (``_engine.deadline.bounded``); one that fails is opened again at the next wait, so a server
    that stops answering ends the wait at the deadline, with the call's ``TimeoutError``.
    """

    def __init__(self, engine: Any, deadline: Deadline | None) -> None:
        self.engine = engine
        self.deadline = deadline
        self.pubsub: Any = None
        self.poll = POLL_FIRST_S
        self._stack = ExitStack()

    def start(self) -> None:
        if getattr(self.engine, "events_refused", False):
            return
        client = self.engine.client
        pubsub = client.pubsub()
        if self.deadline is not None and is_real(client):
            conn = new_connection(client.connection_pool)
            conn.register_connect_callback(pubsub.on_connect)  # a reconnect subscribes again
            pubsub.connection = conn
            self._stack.callback(conn.disconnect)
            self._stack.enter_context(bounded(conn, self.deadline))
            self._stack.callback(_detach, pubsub)  # the connection is ours: never handed to the pool
        else:
            self._stack.callback(pubsub.close)
        self.pubsub = pubsub
        try:
            _subscribe(pubsub, self.engine.keys.events, self.deadline)
        except redis.exceptions.ResponseError as err:
            if not _refused(err):
                raise
            self._poll_from_now_on(err)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if self.deadline is None:
                raise
            self._drop()  # tried again at the next wait

    def wait(self, seconds: float) -> None:
        """Block until the next message on the channel, at most ``seconds``."""
        if self.pubsub is None and self.deadline is not None and not getattr(self.engine, "events_refused", False):
            self.start()
        if self.pubsub is None:
            time.sleep(min(seconds, self.poll))
            self.poll = min(2 * self.poll, POLL_MAX_S)
            return
        try:
            _next_event(self.pubsub, seconds)
        except redis.exceptions.ResponseError as err:
            if not _refused(err):
                raise
            self._poll_from_now_on(err)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if self.deadline is None:
                raise
            self._drop()

    def _drop(self) -> None:
        self._stack.close()
        self._stack = ExitStack()
        self.pubsub = None

    def _poll_from_now_on(self, err: Exception) -> None:
        """The ACL refuses the subscription: this handle polls from now on, with one warning."""
        self._drop()
        self.engine.events_refused = True
        warnings.warn(
            f"the server refuses this user SUBSCRIBE on the channel {self.engine.keys.events!r} ({err}); waiting calls "
            f"of the store with {self.engine.where()} poll every {POLL_FIRST_S:g}-{POLL_MAX_S:g} s instead "
            "(allow it with '+subscribe &<prefix>:*', see lua/README.md, Read transactions)",
            RuntimeWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        self._drop()


def _detach(pubsub: Any) -> None:
    pubsub.connection = None
    pubsub.close()


def _subscribe(pubsub: Any, channel: str, deadline: Deadline | None) -> None:
    """Subscribe and wait for the server's confirmation: from then on every publish reaches us."""
    pubsub.subscribe(channel)
    while True:
        left = SAFETY_S if deadline is None else deadline.left()
        msg = pubsub.get_message(timeout=left)
        if msg is not None and msg.get("type") == "subscribe":
            return
        if msg is None and deadline is not None and deadline.left() <= 0:
            return  # out of time: the caller's last try decides


def _next_event(pubsub: Any, timeout: float) -> None:
    """Block until a message arrives (or ``timeout``), then drain what else is queued: one retry per burst."""
    msg = pubsub.get_message(timeout=timeout)
    while msg is not None:
        msg = pubsub.get_message(timeout=0)


def _timed_out(engine: Any, what: str, deadline: Deadline | None, held: MustWait) -> TimeoutError:
    waited = "" if deadline is None else f" {deadline.timeout:g} s"
    return TimeoutError(f"{what} on the store with {engine.where()} waited{waited}: {held.message}")
