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
  builtin ``TimeoutError`` naming the call (``within``);
- a call that changes state (a ring write, a pop) says when its deadline passed after its command
  may have reached the server: it marks the moment it sends that command (:func:`arm`), the
  connections note each command written from then on (``DeadlineRetry``), a ``WAIT`` reply clears
  the mark (:func:`answered`: the server answered without running it), and :func:`resolvable` turns
  the call's ``TimeoutError`` into ``AmbiguousTimeoutError`` carrying its request id and a resend.
  A call that timed out before anything of it was written (a server that cannot be reached, a wait
  that ran out after a ``WAIT`` reply) still raises the plain ``TimeoutError``: it did not run.

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

from tdstore._errors import AmbiguousTimeoutError

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

    __slots__ = ("at", "timeout", "what", "_where", "armed", "sent")

    def __init__(self, timeout: float, what: str, where: Callable[[], str] | None = None) -> None:
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout
        self.what = what
        self._where = where
        self.armed = False  # the call's state-changing command goes out next (see arm)
        self.sent = False  # a command was written since: the call may have run on the server

    def branch(self) -> Deadline:
        """The same moment for work on another thread, with marks of its own: whether *its* command was
        sent (:func:`arm`, ``sent``) is its own; shared, one thread's call ending would clear the marks
        of another's still waiting for its reply, which then looked as if it had not run."""
        other = Deadline.__new__(Deadline)
        other.timeout, other.at, other.what, other._where = self.timeout, self.at, self.what, self._where
        other.armed = other.sent = False
        return other

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


def arm() -> None:
    """The thread's call sends its state-changing command next (a ring write, a pop): from now on any
    command a connection writes under its deadline may run it (``DeadlineRetry`` notes it). Called by
    the call's plan, right before the command goes out, so a header read before it does not count."""
    dl = active()
    if dl is not None:
        dl.armed = True


def answered() -> None:
    """The server answered the call's command without running it (``WAIT``: nothing written or taken,
    nothing recorded under its request id), so nothing sent so far runs it: a deadline that passes
    while it waits for the next try is a plain ``TimeoutError``."""
    dl = active()
    if dl is not None:
        dl.armed = dl.sent = False


@contextmanager
def resolvable(request: str, resend: Callable[[float | None], Any] | None, keyword: bool = False) -> Iterator[None]:
    """Run a state-changing call sent under ``request`` (its request id): a ``TimeoutError`` of its
    deadline raised after its command may have reached the server (written, its reply not read
    whole) becomes ``AmbiguousTimeoutError`` with the id and ``resend(timeout)``, which sends the
    same call again under the same id (the server answers a recorded id with the first reply). One
    that passed before anything was written stays the plain ``TimeoutError``: the call did not run.
    ``keyword``: the call takes ``request_id=`` (the message says so).

    Without a deadline, a redis-py ``TimeoutError`` (a client's ``socket_timeout``) keeps its type, says
    in its message that the call may have run (unless redis-py timed out connecting: nothing was sent)
    and carries ``request_id`` too."""
    dl = active()
    if dl is None:
        try:
            yield
        except redis.exceptions.TimeoutError as err:
            if "connecting" in str(err).lower():  # "Timeout connecting to server": nothing was sent
                raise
            how = f"the same call with request_id={request!r} returns its first reply, applied once" if keyword else ""
            said = type(err)(f"{err}; {_MAY_HAVE_RUN} (request id {request}){': ' + how if how else ''}")
            said.request_id = request  # type: ignore[attr-defined]  # as AmbiguousTimeoutError's
            raise said from err
        return
    outer = dl.armed, dl.sent  # a call made inside another's (under its deadline) has marks of its own
    dl.armed = dl.sent = False
    answered_whole = False
    try:
        yield
        answered_whole = True
    except AmbiguousTimeoutError:
        raise
    except TimeoutError as err:
        if not dl.sent:
            raise
        # caused by what the deadline's error was caused by (the redis-py error of the late reply), as a
        # caller that tells a lost reply from a wait by the cause expects (a sharded ring's pop)
        raise ambiguous(err, request, resend, keyword) from err.__cause__ or err
    except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError) as err:
        if dl.left() > _SLACK_S:
            raise
        # a reply read past the deadline on a path no DeadlineRetry bounds (a staged write's pipeline)
        # was sent all the same: only redis-py's own word says nothing was ("Timeout connecting")
        late = dl.armed and isinstance(err, redis.exceptions.TimeoutError) and "connecting" not in str(err).lower()
        if not (dl.sent or late):
            raise dl.error(err) from err
        raise ambiguous(dl.error(err), request, resend, keyword) from err
    finally:  # the outer call's marks back, and this one's if it may have run unanswered
        sent = dl.sent and not answered_whole
        dl.armed, dl.sent = outer[0], outer[1] or sent


_MAY_HAVE_RUN = "its command reached the server, which may have run it (the reply was not read in time)"


def ambiguous(
    err: BaseException, request: str, resend: Callable[[float | None], Any] | None, keyword: bool = False
) -> AmbiguousTimeoutError:
    """The ``AmbiguousTimeoutError`` of a call that timed out with ``err`` after its command may have run."""
    how = f"request id {request}"
    if resend is not None:
        how = f"err.retry() sends it again under its request id {request} and returns its first reply, applied once"
        how += f" (so does the same call with request_id={request!r})" if keyword else ""
    return AmbiguousTimeoutError(f"{err}; {_MAY_HAVE_RUN}: {how}", request_id=request, resend=resend)


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
        _local.deadline = dl.branch()
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
        self._connecting = False  # inside note_send's connect (redis-py's connect retries through us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def clamp(self) -> None:
        read, connect = self.configured
        _set_timeouts(self.conn, self.deadline.socket_timeout(read), self.deadline.socket_timeout(connect))

    def note_send(self) -> None:
        """Before a try of a call that :func:`arm` armed: connect first (a connect that fails writes
        nothing of the call), then mark the deadline, since the try writes its command at once (every
        try here starts with its send). Nothing for a try of anything else."""
        dl = self.deadline
        if not dl.armed or self._connecting:
            return
        if getattr(self.conn, "_sock", True) is None:
            self._connecting = True
            try:
                self.conn.connect()
            finally:
                self._connecting = False
        dl.sent = True

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
                self.note_send()
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
