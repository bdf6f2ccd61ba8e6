"""Waiting for a ring without polling: retry a call when the store's Pub/Sub channel says something changed.

Ring writes, samples counted by a rate limiter, and pops publish on the store's
channel (``StoreKeys.events``) from inside their scripts. A call the server holds back
(a ``WAIT`` reply: too few items for ``min_size``, a rate limiter, a full queue, nothing
to pop) is tried again only after such a message, so a waiting learner or writer costs
the server nothing while it waits. The subscription is confirmed before the retry that
follows it, so a change made between the refused try and the subscription is never
missed. Keyspace notifications were the other way to wake a waiter; they need the
server's ``notify-keyspace-events`` setting (off by default, and refused by managed
servers), where a ``PUBLISH`` from a script works on every server tdstore supports.

A waiter also tries again once a second without a message (``SAFETY_S``): a message lost
with a dropped Pub/Sub connection then costs at most a second, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import MustWait

T = TypeVar("T")

#: Longest wait between tries when no message comes (a lost message costs at most this).
SAFETY_S = 1.0


def until_ready(engine: Any, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
    """``attempt()`` until the server stops answering ``WAIT``; ``TimeoutError`` after ``timeout`` seconds.

    ``timeout=None`` waits as long as it takes; ``0`` tries once. ``what`` names the call
    in the timeout's message.
    """
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    try:
        return attempt()
    except MustWait as err:
        held = err
    deadline = None if timeout is None else time.monotonic() + timeout
    if deadline is not None and time.monotonic() >= deadline:
        raise _timed_out(engine, what, timeout, held)
    pubsub = engine.client.pubsub()
    try:
        _subscribe(pubsub, engine.keys.events, deadline)
        while True:
            try:
                return attempt()
            except MustWait as err:
                held = err
            left = SAFETY_S if deadline is None else min(SAFETY_S, deadline - time.monotonic())
            if left <= 0:
                raise _timed_out(engine, what, timeout, held)
            _next_event(pubsub, left)
    finally:
        pubsub.close()


def _subscribe(pubsub: Any, channel: str, deadline: float | None) -> None:
    """Subscribe and wait for the server's confirmation: from then on every publish reaches us."""
    pubsub.subscribe(channel)
    while True:
        left = SAFETY_S if deadline is None else max(0.0, deadline - time.monotonic())
        msg = pubsub.get_message(timeout=left)
        if msg is not None and msg.get("type") == "subscribe":
            return
        if msg is None and deadline is not None and time.monotonic() >= deadline:
            return  # out of time: the caller's last try decides


def _next_event(pubsub: Any, timeout: float) -> None:
    """Block until a message arrives (or ``timeout``), then drain what else is queued: one retry per burst."""
    msg = pubsub.get_message(timeout=timeout)
    while msg is not None:
        msg = pubsub.get_message(timeout=0)


def _timed_out(engine: Any, what: str, timeout: float | None, held: MustWait) -> TimeoutError:
    return TimeoutError(f"{what} on the store with {engine.where()} waited {timeout:g} s: {held.message}")
