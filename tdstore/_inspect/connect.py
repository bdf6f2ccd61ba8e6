"""The connection of ``tdstore ls``/``info``/``check``/``rm``: which server, and one clear error when
it cannot be reached (messages never hold a password)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

from tdstore._engine.connection import PASSWORD_ENV, PasswordError, open_client
from tdstore._engine.urls import check_scheme, redact_url

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_URL",
    "REPLY_TIMEOUT",
    "URL_ENV",
    "InvalidURL",
    "LoginRefused",
    "ServerConnection",
    "ServerUnreachable",
    "connect",
    "resolve_url",
]

URL_ENV = "TDSTORE_URL"
#: Where ``ls``/``info``/``rm`` look without ``--url`` and without ``$TDSTORE_URL``.
DEFAULT_URL = "redis://localhost:6379/0"
#: Seconds to wait for the connection; a wrong address should fail fast, not hang a terminal.
CONNECT_TIMEOUT = 5.0
#: Seconds to wait for one reply; inspection commands are O(1) per key, so this is generous.
REPLY_TIMEOUT = 60.0


def resolve_url(url: str | None) -> str:
    """``url`` if given, else ``$TDSTORE_URL``, else :data:`DEFAULT_URL`."""
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


class InvalidURL(ValueError):
    """The URL is not one tdstore accepts (``URL_SCHEMES``), or names what the server lacks (a database, a cluster)."""


class ServerUnreachable(ConnectionError):
    """No connection, or the server refused it (wrong password, TLS...)."""


class LoginRefused(ServerUnreachable):
    """The server needs a password and got none, or refused the one given (the message says which server)."""


@dataclass
class ServerConnection:
    """An open client and a description of where it points, safe to print."""

    client: redis.Redis
    where: str
    secret: str | None = field(default=None, repr=False)

    def scrub(self, text: str) -> str:
        """``text`` with the password masked, for messages built from server errors."""
        return _scrub(text, self.secret)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ServerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scrub(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` masked: a belt on top of messages that should never hold it anyway."""
    return text.replace(secret, "***") if secret else text


def connect(url: str, *, timeout: float = CONNECT_TIMEOUT) -> ServerConnection:
    """Open a client on ``url`` and PING it once, so a wrong address fails here with one clear message.

    The URL is parsed by :func:`tdstore._engine.connection.open_client`, which keeps the
    password out of the spec, so ``where`` can be printed.  Raises
    :class:`InvalidURL` or :class:`ServerUnreachable`.
    """
    try:
        check_scheme(url)  # (redis-py's message would list its own three schemes)
        secret = parse_url(url.replace("+cluster://", "://", 1)).get("password") or os.environ.get(PASSWORD_ENV)
    except ValueError as err:
        raise InvalidURL(str(err)) from None
    try:
        client, spec, _ = open_client(
            url=url,
            host="localhost",
            port=6379,
            db=0,
            unix_socket_path=None,
            client=None,
            # redis-py retries a refused connection 10 times with backoff (seconds); one quick retry is
            # enough for a command a person is waiting on, and a wrong --url fails at once
            redis_kwargs={
                "socket_connect_timeout": timeout,
                "socket_timeout": REPLY_TIMEOUT,
                "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
            },
        )
    except PasswordError as err:  # a cluster's seed node is reached when the client is made (tdstore's text, no secret)
        raise LoginRefused(str(err)) from None
    except (ValueError, TypeError) as err:  # a bad URL, or a plain server named by redis+cluster://
        raise InvalidURL(_scrub(str(err), secret)) from None
    except redis.RedisClusterException as err:  # no node of the cluster answered (not a RedisError)
        raise ServerUnreachable(f"cannot reach the Redis Cluster at {redact_url(url)}: {_scrub(str(err), secret)}") from None
    where = spec.describe()
    try:
        client.ping()
    except PasswordError as err:  # tdstore's own sentence: no server text, no secret
        client.close()
        raise LoginRefused(str(err)) from None
    except ValueError as err:  # the URL's database is past the server's (tdstore's sentence, no secret)
        client.close()
        raise InvalidURL(_scrub(str(err), secret)) from None
    except redis.RedisError as err:  # refused, timed out, NOPERM...
        client.close()
        raise ServerUnreachable(f"cannot reach the server at {where}: {_scrub(str(err), secret)}") from None
    except OSError as err:  # e.g. a TLS setup problem raised before redis-py wraps it
        client.close()
        raise ServerUnreachable(f"cannot reach the server at {where}: {_scrub(str(err), secret)}") from None
    return ServerConnection(client, where, secret)
