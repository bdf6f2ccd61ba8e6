"""How a store reaches its server, and how that crosses a process boundary without secrets.

A :class:`ConnectionSpec` is what a store keeps and pickles: host/port/db or a unix
socket (URLs are parsed into those), TLS, and extra keyword arguments, but never a
password (nor ``ssl_password``).  The password lives only in the live client.

One rule gives the password, in every process and for every entry point (the
store classes, ``tdstore ls/info/rm/demo`` and the demo's actor processes), each
time a client is opened: the password given (``password=``, or the URL's user
info or ``?password=``), else what ``password_provider()`` returns (a picklable
callable, so a child calls it too), else ``$TDSTORE_PASSWORD``, else none.  A
pickle holds no password, so a child process gets it from the provider or the
environment it inherits.

A server that refuses the credentials (``NOAUTH``, ``WRONGPASS``, redis-py's
"HELLO must be called with the client already authenticated") raises
:class:`PasswordError`, which names the server and the ways to give a password.
"""

from __future__ import annotations

import os
import ssl
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.connection import SSLConnection

from tdstore._engine import deadline
from tdstore._engine.shared_clients import shared_client
from tdstore._engine.urls import parse_url_parts
from tdstore._format import wire

_HIREDIS_PACK: Any = None
_HIREDIS_PACKER: Any = None
try:  # redis-py's hiredis serializer packs with hiredis.pack_command (which takes memoryviews as they are)
    from hiredis import pack_command as _HIREDIS_PACK
    from redis.connection import HiredisRespSerializer as _HIREDIS_PACKER
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency
    pass

#: Keyword arguments that are secrets: never kept in a :class:`ConnectionSpec`, a pickle or a state dict.
SECRET_KWARGS = ("password", "ssl_password", "credential_provider")
PASSWORD_ENV = "TDSTORE_PASSWORD"


class PasswordError(redis.AuthenticationError):
    """The server wants a password and got none, or refused the one given (never holds the password)."""

    __module__ = "tdstore"  # its public home: pickles name it there


class TLSHandshakeError(redis.exceptions.RedisError):
    """A ``rediss://`` connection got no TLS handshake: most often a plain (non-TLS) server.

    Not a ``ConnectionError`` on purpose: redis-py retries those (ten times, by default), and a
    server that does not speak TLS will not start to; the first failed handshake is final.
    """


class _TLSHintConnection(SSLConnection):
    """redis-py's TLS connection whose handshake is bounded by the connect timeout and, when it
    fails for another reason than a certificate, says that the server may not speak TLS."""

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        try:
            wrapped = super()._wrap_socket_with_ssl(sock)
        except ssl.SSLCertVerificationError:
            raise  # a TLS server, with a certificate we do not trust: redis-py says so
        except (ssl.SSLError, TimeoutError, ConnectionError) as err:
            limit = "" if self.socket_connect_timeout is None else f" within {self.socket_connect_timeout:g} s"
            raise TLSHandshakeError(
                f"no TLS handshake with {self.host}:{self.port}{limit} ({type(err).__name__}: {err}): rediss:// asks for "
                "TLS, and this server may not speak it; use redis:// for a server without TLS"
            ) from None
        wrapped.settimeout(self.socket_timeout)
        return wrapped


class _RefusedLoginIsFinal:
    """Mixed into a client's connection class: a refused login ends the connect at once. redis-py
    retries a failed handshake as it would a dropped socket (ten times, seconds of backoff, an AUTH
    each time), but a wrong password stays wrong. Its retry loop disconnects before each new try:
    there the refusal is raised again, which ends the loop."""

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        super().disconnect(*args, **kwargs)  # type: ignore[misc]  # a redis-py connection class follows in the MRO
        error = args[0] if args else kwargs.get("error")
        if isinstance(error, PasswordError):
            raise error


_FINAL_LOGIN: dict[type, type] = {}


def _final_login(cls: type) -> type:
    """``cls`` with :class:`_RefusedLoginIsFinal` in front (one class per connection class)."""
    if issubclass(cls, _RefusedLoginIsFinal):
        return cls
    made = _FINAL_LOGIN.get(cls)
    if made is None:
        made = _FINAL_LOGIN[cls] = type(cls.__name__, (_RefusedLoginIsFinal, cls), {"__module__": __name__})
    return made


def password_message(where: str, err: Exception) -> str:
    """The one sentence for a refused login at ``where`` (the server's own text is no help: it may
    say "HELLO must be called..." when the only thing missing is a password)."""
    if "without any password configured" in str(err) or "no password is set" in str(err):
        return f"the server at {where} has no password, but one was given (password=, the URL, password_provider or ${PASSWORD_ENV})"
    return (
        f"the server at {where} needs a password (or the one given is wrong): give it in the URL "
        f"(redis://:PASSWORD@host:port), as password=, with password_provider=, or in ${PASSWORD_ENV}"
    )


#: What a server (or redis-py) says when it refuses a login, as redis-py's cluster client quotes it.
_LOGIN_REFUSED = (
    "NOAUTH",
    "WRONGPASS",
    "HELLO must be called",
    "invalid username-password",
    "Authentication required",
    "without any password configured",
)


def default_password(provider: Callable[[], str] | None) -> str | None:
    """The password when none was given: ``provider()``, else ``$TDSTORE_PASSWORD`` (empty counts as unset)."""
    if provider is not None:
        return provider()
    return os.environ.get(PASSWORD_ENV) or None


def _login_checked(where: str) -> Callable[[Any], None]:
    """A redis-py ``redis_connect_func``: the usual handshake, with a refused login turned into :class:`PasswordError`."""

    def on_connect(conn: Any) -> None:
        restore = _lean_handshake(conn)
        try:
            conn.on_connect()
        except PasswordError:
            raise
        except redis.AuthenticationError as err:
            raise PasswordError(password_message(where, err)) from None
        except redis.ResponseError as err:
            if "DB index" not in str(err):  # (Redis, Valkey, KeyDB: "ERR DB index is out of range")
                raise
            raise ValueError(_database_message(conn, where)) from None
        finally:
            restore()

    return on_connect


def _database_message(conn: Any, where: str) -> str:
    """Why ``SELECT`` refused the URL's database: the server's ``databases`` setting, read on the same
    connection (still on database 0, every reply of its handshake read); not named when ``CONFIG`` is refused."""
    count = None
    try:
        conn.send_command("CONFIG", "GET", "databases", check_health=False)
        reply = conn.read_response()
        values = list(reply.values()) if isinstance(reply, dict) else list(reply or [])[1::2]
        count = int(values[0]) if values else None
    except (redis.RedisError, OSError, ValueError):
        pass
    has = f"has {count} databases (0 to {count - 1}, its 'databases' setting)" if count else "has fewer databases"
    return (
        f"database {conn.db} (of the URL, or db=) is out of range: the server at {where} {has}; "
        "name one of those (redis://host:port/N, or db=N)"
    )


def _server_version(conn: Any) -> tuple[int, ...] | None:
    """The server's version as its ``HELLO`` reply gave it (None: not known, e.g. a RESP2 handshake)."""
    meta = getattr(conn, "handshake_metadata", None)
    if not isinstance(meta, dict):
        return None
    raw = meta.get(b"version", meta.get("version"))
    try:
        return tuple(int(p) for p in (raw.decode() if isinstance(raw, bytes) else str(raw)).split(".")[:3])
    except (AttributeError, ValueError):
        return None


#: Handshake commands redis-py sends after ``HELLO`` (one round trip each), and the server version that has them.
_SETINFO_SINCE, _MAINT_SINCE = (7, 2), (8, 0)


#: redis-py's methods that run right after ``HELLO`` in a connection's handshake, newest release first.
_HANDSHAKE_HOOKS = ("_add_maint_notifications_to_handshake", "activate_maint_notifications_handling_if_enabled")


def _lean_handshake(conn: Any) -> Callable[[], None]:
    """Skip what redis-py's handshake would ask a server that lacks it: ``CLIENT MAINT_NOTIFICATIONS``
    (not before Redis 8) and ``CLIENT SETINFO`` (Redis 7.2) each cost a round trip answered by an
    error, which redis-py ignores: three of the five round trips of a new connection to Redis 7.0
    (redis-py 8.2 sends them in one round trip with the rest of the handshake, still answered by errors).
    The version comes from the ``HELLO`` reply; a server that has them gets them as before.
    Returns what puts the connection's settings back (called once the handshake is done)."""
    # the hook redis-py calls between HELLO and CLIENT SETINFO: redis-py 8.2 queues the handshake's
    # tail (one round trip for all of it), earlier releases sent each command on its own
    hook = next((name for name in _HANDSHAKE_HOOKS if callable(getattr(conn, name, None))), None)
    if hook is None or not hasattr(conn, "driver_info"):  # another redis-py: its own handshake, untouched
        return lambda: None
    activate = getattr(conn, hook)
    info = conn.driver_info

    def lean(*args: Any, **kwargs: Any) -> Any:
        version = _server_version(conn)
        if version is not None and version < _SETINFO_SINCE:
            conn.driver_info = None
        if version is not None and version < _MAINT_SINCE:
            return None
        return activate(*args, **kwargs)

    setattr(conn, hook, lean)

    def restore() -> None:
        conn.__dict__.pop(hook, None)
        conn.driver_info = info

    return restore


@dataclass(frozen=True)
class ConnectionSpec:
    """Everything needed to open a client, minus secrets (safe to pickle and print).

    URLs are parsed with redis-py's own ``parse_url`` (percent-decoding, IPv6,
    query options) and kept as parts, so no password can ride along inside one.
    """

    host: str = "localhost"
    port: int = 6379
    db: int = 0
    unix_socket_path: str | None = None
    ssl: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    needs_password: bool = False
    """A password was given when the spec was made (informational: every connect applies the rule above)."""
    password_provider: Callable[[], str] | None = None
    cluster: bool = False
    """A Redis Cluster, reached through ``redis.cluster.RedisCluster`` from this seed node."""

    def describe(self) -> str:
        """Where the server is, for messages (never includes a password)."""
        if self.cluster:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"{'rediss' if self.ssl else 'redis'}+cluster://{host}:{self.port}"
        if self.unix_socket_path:
            return f"unix://{self.unix_socket_path}?db={self.db}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.ssl else 'redis'}://{host}:{self.port}/{self.db}"

    def connect(self, password: str | None = None, secrets: dict[str, Any] | None = None) -> redis.Redis:
        """A new client; bytes in and out (``decode_responses`` is forced off).

        ``password``: the one given; None applies the rest of the rule (provider, then
        ``$TDSTORE_PASSWORD``).
        """
        kwargs = dict(self.kwargs)
        kwargs.update(secrets or {})
        kwargs["decode_responses"] = False
        if password is None:
            password = default_password(self.password_provider)
        if password is not None:
            kwargs["password"] = password
        if self.cluster:
            from redis.cluster import RedisCluster

            if self.ssl:
                kwargs["ssl"] = True
            try:  # the seed node is reached here (the cluster's own connect hook runs first, so no hook of ours)
                return RedisCluster(host=self.host, port=self.port, **kwargs)  # type: ignore[return-value]  # serves the same commands as redis.Redis
            except redis.AuthenticationError as err:
                raise PasswordError(password_message(self.describe(), err)) from None
            except redis.RedisClusterException as err:  # redis-py wraps a refused seed node's error in this
                if any(text in str(err) for text in _LOGIN_REFUSED):
                    raise PasswordError(password_message(self.describe(), err)) from None
                if "Cluster mode is not enabled" in str(err):
                    plain = self.describe().replace("+cluster://", "://", 1)
                    raise ValueError(
                        f"the server at {self.describe()} is not a Redis Cluster (cluster mode is not enabled on it): "
                        f"reach it with {plain}/0, or point redis+cluster:// at a node of a cluster"
                    ) from None
                raise
        kwargs.setdefault("redis_connect_func", _login_checked(self.describe()))
        _skip_version_lookup(kwargs)
        if self.unix_socket_path:
            client = redis.Redis(unix_socket_path=self.unix_socket_path, db=self.db, **kwargs)
        else:
            if self.ssl:
                kwargs["ssl"] = True
            client = redis.Redis(host=self.host, port=self.port, db=self.db, **kwargs)
        pool = client.connection_pool
        if self.ssl and pool.connection_class is SSLConnection and hasattr(SSLConnection, "_wrap_socket_with_ssl"):
            pool.connection_class = _TLSHintConnection  # a plain server: one clear error, not a minute of retries
        pool.connection_class = _final_login(pool.connection_class)  # a refused login (PasswordError) is not retried
        return client


def _skip_version_lookup(kwargs: dict[str, Any]) -> None:
    """Tell redis-py its own version: redis-py 7+ otherwise reads it from the package metadata for
    every client (``importlib.metadata``, about 0.5 ms: a third of opening a store)."""
    if "driver_info" in kwargs or "lib_name" in kwargs or "lib_version" in kwargs:
        return
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # older redis-py computes it once, at import
        return
    kwargs["driver_info"] = DriverInfo(lib_version=redis.__version__)


def open_client(
    *,
    url: str | None,
    host: str,
    port: int,
    db: int,
    unix_socket_path: str | None,
    client: Any,
    redis_kwargs: dict[str, Any],
) -> tuple[redis.Redis, ConnectionSpec, bool]:
    """Open (or adopt) a client and describe it without its secrets.

    Returns ``(client, spec, owned)``: ``owned`` is False when the caller's own
    client is used as it is, which a store must then never close.
    """
    kwargs = dict(redis_kwargs)
    min_replicas = kwargs.pop("min_replicas", 0)
    if min_replicas:  # a sharded ring takes it before opening its client; any other store lands here
        raise ValueError(
            f"min_replicas={min_replicas!r} is for a sharded ring (tdstore.ShardedRing, on a Redis Cluster), whose writes "
            "wait for replicas; this store is not one"
        )
    provider = kwargs.pop("password_provider", None)
    if "credential_provider" in kwargs:
        raise TypeError("credential_provider is not supported; pass password= or password_provider=")
    kwargs.pop("decode_responses", None)
    if client is not None:
        return _adopt(client, provider)
    where: dict[str, Any] = {
        "host": host,
        "port": port,
        "db": db,
        "unix_socket_path": unix_socket_path,
        "ssl": bool(kwargs.pop("ssl", False)),
        "cluster": bool(kwargs.pop("cluster", False)),
    }
    if url is not None:
        parsed = parse_url_parts(url)
        kwargs = {**parsed.pop("rest"), **kwargs}
        where.update(parsed)
    secrets = {k: kwargs.pop(k) for k in SECRET_KWARGS if k in kwargs}
    password = secrets.pop("password", None)
    spec = ConnectionSpec(
        host=where["host"],
        port=int(where["port"]),
        db=int(where["db"] or 0),
        unix_socket_path=where["unix_socket_path"],
        ssl=where["ssl"],
        kwargs=kwargs,
        needs_password=password is not None or provider is not None,
        password_provider=provider,
        cluster=where["cluster"],
    )
    if spec.cluster and (spec.unix_socket_path or spec.db):
        raise ValueError("a Redis Cluster is reached over TCP, database 0")
    if spec.cluster:
        return spec.connect(password, secrets), spec, True
    # the password the client will log in with (given, else the rule's): the shared client is keyed on it
    login = password if password is not None else default_password(spec.password_provider)
    settings = (spec.describe(), spec.ssl, tuple(sorted(spec.kwargs.items())), login, tuple(sorted(secrets.items())))
    return shared_client(settings, lambda: spec.connect(login, secrets)), spec, False


#: The settings of a caller's client that a store's own clients copy (the rest are redis-py's defaults).
_ADOPTED_SETTINGS = (
    "username",
    "socket_timeout",
    "socket_connect_timeout",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "client_name",
)


def _adopt(client: Any, provider: Callable[[], str] | None) -> tuple[redis.Redis, ConnectionSpec, bool]:
    """Use a caller's client: a sync ``redis.Redis`` or ``RedisCluster`` as it is, an asyncio one through its settings."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return client, _cluster_spec(client, provider), False  # type: ignore[return-value]  # serves the same commands as redis.Redis
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        raise TypeError(f"client must be a redis.Redis or redis.asyncio.Redis, got {type(client).__name__}")
    ckw = dict(pool.connection_kwargs)
    password = ckw.pop("password", None)
    for secret in SECRET_KWARGS:
        ckw.pop(secret, None)
    path = ckw.pop("path", None)
    kwargs = {k: v for k, v in ckw.items() if k in (*_ADOPTED_SETTINGS, "ssl")}
    if issubclass(pool.connection_class, SSLConnection) or pool.connection_class.__name__.startswith("SSL"):
        kwargs["ssl"] = True
    ssl = bool(kwargs.pop("ssl", False))
    spec = ConnectionSpec(
        host=ckw.get("host", "localhost"),
        port=int(ckw.get("port", 6379)),
        db=int(ckw.get("db", 0) or 0),
        unix_socket_path=path,
        ssl=ssl,
        kwargs=kwargs,
        needs_password=password is not None or provider is not None,
        password_provider=provider,
    )
    if isinstance(client, redis.Redis) and not ckw.get("decode_responses", False):
        return client, spec, False
    # an asyncio client, or one that decodes replies: open our own sync client with its settings
    return spec.connect(password), spec, True


def _cluster_spec(client: Any, provider: Callable[[], str] | None) -> ConnectionSpec:
    """The spec of a caller's ``RedisCluster``: its default node as the seed, its settings minus secrets."""
    node = client.get_default_node()
    ckw = dict(client.nodes_manager.connection_kwargs)
    password = ckw.get("password")
    return ConnectionSpec(
        host=node.host,
        port=int(node.port),
        ssl=bool(ckw.get("ssl", False)),
        kwargs={k: v for k, v in ckw.items() if k in _ADOPTED_SETTINGS},
        needs_password=password is not None or provider is not None,
        password_provider=provider,
        cluster=True,
    )


_HELD: weakref.WeakSet[HeldConnection] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for held in list(_HELD):
        held._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class HeldConnection:
    """One connection taken from a client's pool and kept for a handle's script calls.

    redis-py checks a connection out of its pool and back in on every command,
    which costs about as much as the round trip itself on a local socket (measured:
    109 us per ``execute_command`` against 52 us on a held connection).  A handle
    keeps one connection for its calls instead.  Anything unusual falls back to
    ``execute_command`` and its retries: another thread using the handle at the same
    time, a forked child (the parent's socket is never used), fakeredis, or a
    connection error (the connection is dropped and, if the client's retry policy
    retries at all, the command is sent again by redis-py, as its own retry would).

    Under a call's deadline (``_engine.deadline``) the held connection's timeouts and the client's
    retry policy are cut to what is left, retries happen on the held connection itself, and a
    connection it must open is made outside the pool (whose checkout connects unbounded).
    """

    def __init__(self) -> None:
        self._conn: Any = None
        self._pool: Any = None
        self._pid = 0
        self._own = False  # the connection was made outside the pool (see _deadline)
        self._lock = threading.Lock()
        _HELD.add(self)

    def _after_fork_in_child(self) -> None:
        # a fork taken while another thread held the lock would leave it held in the child for
        # ever (close() and the finalizer would block); the parent's socket is never used here
        self._lock = threading.Lock()
        self._conn = self._pool = None
        self._pid = 0

    def execute(self, client: Any, *args: Any) -> Any:
        """One command; its reply as redis-py's ``read_response`` gives it."""

        def send(conn: Any) -> Any:
            if _HIREDIS_PACK is not None and type(getattr(conn, "_command_packer", None)) is _HIREDIS_PACKER:
                # what redis-py's hiredis serializer does, without its per-argument pass (memoryviews copied
                # to bytes): half of the packing time of a write's dozen arguments
                packed = [_HIREDIS_PACK(args)]
            else:
                packed = conn.pack_command(*args)
            conn.send_packed_command(packed, check_health=False)
            return conn.read_response()

        return self._on_held(client, send, lambda: deadline.execute_command(client, *args))

    def transaction(self, client: Any, body: bytes, n_commands: int) -> list[Any] | None:
        """``MULTI``, ``n_commands`` commands packed by ``_format.wire``, ``EXEC``: the raw ``EXEC`` reply;
        None when no connection can be held (see ``execute``)."""
        send: Callable[[Any], Any] = lambda conn: wire.transaction(conn, body, n_commands)  # noqa: E731
        return self._on_held(client, send, lambda: deadline.fallback(client, send, lambda: None))

    def _on_held(self, client: Any, send: Callable[[Any], Any], fallback: Callable[[], Any]) -> Any:
        if (
            type(client).__module__.startswith("fakeredis")
            or not hasattr(client, "connection_pool")
            or not self._lock.acquire(blocking=False)
        ):
            return fallback()
        try:
            pool = client.connection_pool
            due = deadline.active()
            if self._conn is None or self._pid != os.getpid() or self._pool is not pool:
                self._forget()
                # under a deadline, a connection of our own: the pool's checkout would connect unbounded
                self._own = due is not None
                self._conn = deadline.new_connection(pool) if self._own else pool.get_connection()
                self._pool, self._pid = pool, os.getpid()
            conn = self._conn
            if due is not None:
                return self._send_within(conn, send, due)
            try:
                # as redis-py does on checkout: a socket the server closed while idle (EOF) or
                # with stray data is replaced before use, since this handle never leaves a reply unread
                if conn.can_read(timeout=0):
                    conn.disconnect()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                conn.disconnect()
            try:
                return send(conn)
            except redis.ResponseError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._forget(disconnect=True)
                if getattr(getattr(conn, "retry", None), "_retries", 0) <= 0:
                    raise  # the client retries nothing: neither do we
                return fallback()
            except BaseException:
                self._forget(disconnect=True)  # interrupted mid-reply: the connection's state is unknown
                raise
        finally:
            self._lock.release()

    @staticmethod
    def _send_within(conn: Any, send: Callable[[Any], Any], due: deadline.Deadline) -> Any:
        """``send(conn)`` under a deadline: timeouts and the client's retry policy cut to what is left
        (see ``_engine.deadline``). A connection that failed stays held, disconnected: the next call
        reconnects it (within its own deadline, if it has one)."""
        with deadline.bounded(conn, due):
            try:
                if conn._sock is not None and conn.can_read(timeout=0):
                    conn.disconnect()  # closed by the server while idle, or stray data (see _on_held)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                conn.disconnect()
            try:
                return conn.retry.call_with_retry(lambda: send(conn), lambda *_: conn.disconnect())
            except redis.ResponseError:
                raise
            except BaseException:
                conn.disconnect()  # a timeout or interruption mid-reply: the connection's state is unknown
                raise

    def _forget(self, disconnect: bool = False) -> None:
        conn, pool, pid = self._conn, self._pool, self._pid
        self._conn = self._pool = None
        if conn is None or pid != os.getpid():
            return  # a forked child never touches its parent's socket
        if disconnect or self._own:
            conn.disconnect()
        if not self._own:  # one made under a deadline is not the pool's
            pool.release(conn)

    def release(self) -> None:
        """Give the connection back to its pool (``close()`` of the handle)."""
        with self._lock:
            self._forget()
