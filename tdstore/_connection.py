"""How a store reaches its server, and how that crosses a process boundary without secrets.

A :class:`ConnectionSpec` is what a store keeps and pickles: host/port/db or a unix
socket (URLs are parsed into those), TLS, and extra keyword arguments, but never a
password (nor ``ssl_password``).  The password
lives only in the live client.  A store unpickled in another process reconnects
with the password from ``password_provider`` (a picklable callable the user gave),
else from the ``TDSTORE_PASSWORD`` environment variable, else without one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.connection import SSLConnection, parse_url

_SECRET_KWARGS = ("password", "ssl_password", "credential_provider")
PASSWORD_ENV = "TDSTORE_PASSWORD"


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
    password_provider: Callable[[], str] | None = None

    def describe(self) -> str:
        """Where the server is, for messages (never includes a password)."""
        if self.unix_socket_path:
            return f"unix://{self.unix_socket_path}?db={self.db}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.ssl else 'redis'}://{host}:{self.port}/{self.db}"

    def connect(self, password: str | None = None, secrets: dict[str, Any] | None = None) -> redis.Redis:
        """A new client; bytes in and out (``decode_responses`` is forced off)."""
        kwargs = dict(self.kwargs)
        kwargs.update(secrets or {})
        kwargs["decode_responses"] = False
        if password is None and self.needs_password:
            password = self.password_provider() if self.password_provider else os.environ.get(PASSWORD_ENV)
        if password is not None:
            kwargs["password"] = password
        if self.unix_socket_path:
            return redis.Redis(unix_socket_path=self.unix_socket_path, db=self.db, **kwargs)
        if self.ssl:
            kwargs["ssl"] = True
        return redis.Redis(host=self.host, port=self.port, db=self.db, **kwargs)


def _from_url(url: str) -> dict[str, Any]:
    """Parts of a ``redis://``, ``rediss://`` or ``unix://`` URL (redis-py's parser)."""
    parts = dict(parse_url(url))
    cls = parts.pop("connection_class", None)
    out: dict[str, Any] = {"ssl": cls is not None and issubclass(cls, SSLConnection)}
    if "path" in parts:
        out["unix_socket_path"] = parts.pop("path")
    for name in ("host", "port", "db"):
        if name in parts:
            out[name] = parts.pop(name)
    out["rest"] = parts  # username, password, query options
    return out


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
    provider = kwargs.pop("password_provider", None)
    if "credential_provider" in kwargs:
        raise TypeError("credential_provider is not supported; pass password= or password_provider=")
    kwargs.pop("decode_responses", None)
    if client is not None:
        return _adopt(client, provider)
    where: dict[str, Any] = {"host": host, "port": port, "db": db, "unix_socket_path": unix_socket_path, "ssl": bool(kwargs.pop("ssl", False))}
    if url is not None:
        parsed = _from_url(url)
        kwargs = {**parsed.pop("rest"), **kwargs}
        where.update(parsed)
    secrets = {k: kwargs.pop(k) for k in _SECRET_KWARGS if k in kwargs}
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
    )
    return spec.connect(password, secrets), spec, True


def _adopt(client: Any, provider: Callable[[], str] | None) -> tuple[redis.Redis, ConnectionSpec, bool]:
    """Use a caller's client: a sync ``redis.Redis`` as it is, an asyncio one through its settings."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        raise TypeError(f"client must be a redis.Redis or redis.asyncio.Redis, got {type(client).__name__}")
    ckw = dict(pool.connection_kwargs)
    password = ckw.pop("password", None)
    for secret in _SECRET_KWARGS:
        ckw.pop(secret, None)
    path = ckw.pop("path", None)
    kwargs = {k: v for k, v in ckw.items() if k in ("username", "socket_timeout", "socket_connect_timeout", "ssl", "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "client_name")}
    if pool.connection_class.__name__.startswith("SSL"):
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

