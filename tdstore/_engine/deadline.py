"""Deadlines: a call given ``timeout=`` ends by then, even when the server stops answering.

A waiting call (``pop``, ``sample``, ``extend``, ``wait_for``) used to bound only its
waiting: each command inside it still ran on redis-py's own terms, a socket timeout of 5 s
and up to 10 retries with a backoff of seconds, so ``pop(timeout=3)`` against a paused server
raised after a minute. Here a call given ``timeout=`` opens a :class:`Deadline` (``within``,
or the ``honours_timeout`` decorator at its entry) that the thread carries down to every
connection the call uses, once, instead of checks sprinkled over the call paths:

- the handle's held connection (``_engine.connection.HeldConnection``), the Pub/Sub connection a
  waiter listens on (``_ring.waiting``) and any connection made meanwhile get their socket read and
  connect timeouts clamped to what is left (:func:`bounded`, at least ``MIN_SOCKET_S``);
- their retry policy is the client's own (backoff, errors) with every pause cut to what is left
  (:class:`DeadlineRetry`): no retry starts after the deadline, and tries go on until it whatever
  the client's retry count (a server down for part of the deadline is ridden out; one down
  throughout ends the call at the deadline, with the builtin ``TimeoutError``);
- a redis-py timeout or connection error that escapes once the deadline has passed becomes the
  builtin ``TimeoutError`` naming the call (``within``).

Without a ``timeout`` nothing here runs: the call keeps redis-py's behaviour exactly. A
connection that must be opened under a deadline is made outside the client's pool (the pool's
``get_connection`` connects before the caller can bound it) with the pool's own settings.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import redis

#: The shortest socket timeout a command gets under a deadline: a call with ``timeout=0`` (or
#: one whose time ran out mid-call) still gets one try of each command, bounded.
MIN_SOCKET_S = 0.1
#: A redis-py error this close to the deadline (seconds) counts as the deadline's.
_SLACK_S = 0.02
#: The least pause between tries once the client's retry count is used up (tries go on to the deadline).
_OVERTIME_PAUSE_S = 0.05

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()


def check_timeout(timeout: Any) -> None:
    """``ValueError`` unless ``timeout`` is None or a number of seconds >= 0."""
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0):
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")


class Deadline:
    """The moment a call must be over by (``time.monotonic()`` seconds), and what to say when it is."""

    __slots__ = ("at", "timeout", "what", "_where")

    def __init__(self, timeout: float, what: str, where: Callable[[], str] | None = None) -> None:
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout
        self.what = what
        self._where = where

    def left(self) -> float:
        """Seconds left (0 once past)."""
        return max(0.0, self.at - time.monotonic())

    def socket_timeout(self, configured: float | None) -> float:
        """A socket timeout for the next operation: the configured one (None: no limit), cut to what is left."""
        left = max(self.left(), MIN_SOCKET_S)
        return left if configured is None else min(float(configured), left)

    def where(self) -> str:
        if self._where is None:
            return ""
        try:
            return f" on the store with {self._where()}"
        except Exception:  # a message must never fail
            return ""

    def error(self, cause: BaseException | None = None) -> TimeoutError:
        """The ``TimeoutError`` of a call whose server did not answer in time."""
        why = f": the server did not answer in time ({cause})" if cause is not None else ""
        return TimeoutError(f"{self.what}{self.where()} did not finish within its timeout of {self.timeout:g} s{why}")


def active() -> Deadline | None:
    """The deadline the current thread's call runs under, or None (no ``timeout=``)."""
    return getattr(_local, "deadline", None)


@contextmanager
def within(timeout: float | None, what: str, where: Callable[[], str] | None = None) -> Iterator[Deadline | None]:
    """Run the block under a deadline ``timeout`` seconds from now (None: the caller's, if any).

    Nested deadlines keep the earlier one. A redis-py ``TimeoutError`` or ``ConnectionError``
    escaping once the deadline has passed becomes the builtin ``TimeoutError``.
    """
    check_timeout(timeout)
    outer = active()
    if timeout is None or (outer is not None and outer.at <= time.monotonic() + timeout):
        yield outer
        return
    dl = Deadline(timeout, what, where)
    _local.deadline = dl
    try:
        yield dl
    except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError) as err:
        if dl.left() <= _SLACK_S:
            raise dl.error(err) from err
        raise
    finally:
        _local.deadline = outer


def raise_if_over(err: BaseException) -> None:
    """Raise the thread's call's ``TimeoutError`` (from ``err``, a redis-py timeout or connection error)
    once its deadline has passed; nothing without a deadline or with time left. A cluster path that
    would send a command again elsewhere (``RedisCluster``, which no deadline bounds) calls this first."""
    dl = active()
    if dl is not None and dl.left() <= _SLACK_S:
        raise dl.error(err) from err


@contextmanager
def rerouting() -> Iterator[None]:
    """Within: a connection error past the client's own retry count is raised at once, not tried again
    on the same node until the deadline. A call on a cluster node uses it: a node that is down may have
    handed its slots to a replica, so the caller asks the cluster's slot map again and tries the node
    it names (``_engine.slot_map``), within the same deadline."""
    outer = getattr(_local, "rerouting", False)
    _local.rerouting = True
    try:
        yield
    finally:
        _local.rerouting = outer


def carried(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to run on another thread under this thread's deadline (a call's work spread over threads
    keeps the call's deadline); ``fn`` itself without one."""
    dl = active()
    if dl is None:
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        outer = active()
        _local.deadline = dl
        try:
            return fn(*args, **kwargs)
        finally:
            _local.deadline = outer

    return call


def honours_timeout(what: str) -> Callable[[F], F]:
    """Decorate a ring call ``f(engine, ..., timeout=...)``: the whole call, every command of it
    included, runs under the deadline its ``timeout`` sets (see :func:`within`)."""

    def wrap(fn: F) -> F:
        position = list(inspect.signature(fn).parameters).index("timeout")

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            timeout = kwargs.get("timeout", args[position] if len(args) > position else None)
            if timeout is None and active() is None:
                return fn(*args, **kwargs)
            engine = args[0]
            with within(timeout, what, getattr(engine, "where", None)):
                return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


# -- connections -----------------------------------------------------------------------------
def _set_timeouts(conn: Any, read: float | None, connect: float | None) -> None:
    """Set a connection's read and connect timeouts, on its socket and its parser too (the parser
    puts its own copy back on the socket after each ``can_read``)."""
    conn.socket_timeout = read
    conn.socket_connect_timeout = connect
    parser = getattr(conn, "_parser", None)
    if parser is not None and hasattr(parser, "_socket_timeout"):  # hiredis
        parser._socket_timeout = read
    buffer = getattr(parser, "_buffer", None)
    if buffer is not None and hasattr(buffer, "socket_timeout"):  # the pure-Python parser
        buffer.socket_timeout = read
    sock = getattr(conn, "_sock", None)
    if sock is not None:
        with suppress(OSError):
            sock.settimeout(read)


class DeadlineRetry:
    """A connection's retry policy (count, backoff, retried errors) with every pause cut to the
    deadline: a failure with no time left for another try raises the deadline's ``TimeoutError``.
    Before each try the connection's timeouts are clamped again to what is left."""

    def __init__(self, inner: Any, deadline: Deadline, conn: Any, configured: tuple[float | None, float | None]) -> None:
        self.inner = inner
        self.deadline = deadline
        self.conn = conn
        self.configured = configured

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def clamp(self) -> None:
        read, connect = self.configured
        _set_timeouts(self.conn, self.deadline.socket_timeout(read), self.deadline.socket_timeout(connect))

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        retries = getattr(self.inner, "_retries", 0)
        backoff = getattr(self.inner, "_backoff", None)
        supported = getattr(self.inner, "_supported_errors", (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))
        if backoff is not None:
            backoff.reset()
        failures = 0
        while True:
            self.clamp()
            try:
                return do()
            except supported as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if 0 <= retries < failures and self.deadline.left() <= _SLACK_S:
                    raise self.deadline.error(error) from error
                if 0 <= retries < failures and getattr(_local, "rerouting", False):
                    raise  # a cluster node's call: the caller asks where the slot is now (see rerouting)
                # under a deadline the deadline bounds the tries, not the count: a server that is down
                # (killed, restarting, failing over) gets tried until then, so the call ends the same way
                # every time (TimeoutError naming the last error), not by how redis-py's jitter fell
                pause = backoff.compute(min(failures, max(retries, 1))) if backoff is not None else 0.0
                if 0 <= retries < failures:
                    pause = max(pause, _OVERTIME_PAUSE_S)  # past the client's count: never a tight loop
                left = self.deadline.left()
                if pause >= left:  # no time for another try: wait out the deadline, as the call was asked to
                    time.sleep(left)
                    raise self.deadline.error(error) from error
                if pause > 0:
                    time.sleep(pause)


@contextmanager
def bounded(conn: Any, deadline: Deadline) -> Iterator[Any]:
    """Within the block, ``conn`` (a connection this thread holds alone) reads, connects and
    retries within ``deadline``; its own settings come back afterwards."""
    configured = (conn.socket_timeout, getattr(conn, "socket_connect_timeout", None))
    retry = getattr(conn, "retry", None)
    conn.retry = DeadlineRetry(retry, deadline, conn, configured)
    try:
        conn.retry.clamp()
        yield conn
    finally:
        conn.retry = retry
        _set_timeouts(conn, *configured)


def is_real(client: Any) -> bool:
    """Whether ``client`` talks to a server over a socket through a pool (not fakeredis, not a cluster client)."""
    return not type(client).__module__.startswith("fakeredis") and hasattr(client, "connection_pool")


def new_connection(pool: Any) -> Any:
    """A connection with ``pool``'s settings, outside the pool (not connected yet): one that a
    deadline can bound before it connects. The caller disconnects it when done."""
    return pool.connection_class(**pool.connection_kwargs)


def fallback(client: Any, send: Callable[[Any], Any], otherwise: Callable[[], Any]) -> Any:
    """What a handle does when its held connection is busy (another thread) or gone: ``otherwise()``;
    under a deadline, ``send(conn)`` on a connection of its own, bounded by the deadline (same
    retry policy, cut to it), which no pool checkout can keep waiting."""
    dl = active()
    if dl is None or not is_real(client):
        return otherwise()
    conn = new_connection(client.connection_pool)
    try:
        with bounded(conn, dl):
            return conn.retry.call_with_retry(lambda: send(conn), lambda *_: conn.disconnect())
    finally:
        conn.disconnect()


def execute_command(client: Any, *args: Any) -> Any:
    """``client.execute_command(*args)`` (the same reply, redis-py's callbacks applied), bounded by the
    thread's deadline if it has one (see :func:`fallback`)."""
    return fallback(client, lambda conn: _send_parse(client, conn, args), lambda: client.execute_command(*args))


def pipeline(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The replies of ``commands`` sent as one pipeline (no transaction) on ``client``, an error reply as
    its exception (redis-py's ``execute(raise_on_error=False)``), bounded by the thread's deadline if it
    has one (see :func:`fallback`)."""

    def send(conn: Any) -> list[Any]:
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        out: list[Any] = []
        for _ in commands:
            try:
                out.append(conn.read_response())
            except redis.exceptions.ResponseError as err:  # the reply was read whole: the next one follows
                out.append(err)
        return out

    def otherwise() -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    return fallback(client, send, otherwise)


def _send_parse(client: Any, conn: Any, args: tuple[Any, ...]) -> Any:
    conn.send_command(*args)
    return client.parse_response(conn, args[0])
