"""The demo's server side: checking the ``url`` it was given, and passing its password to the actors.

Messages and returned figures never hold the password: :func:`redact_url` masks it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import redis

from tdstore._engine.connection import PASSWORD_ENV
from tdstore._engine.urls import redact_url
from tdstore.demo.actors import DemoError

__all__ = ["ServerUnreachable", "check_reachable", "password_for_children", "redact_url"]


class ServerUnreachable(DemoError):
    """The ``url`` given to the demo does not answer; the CLI turns this into exit code 2."""


def check_reachable(url: str, timeout: float = 5.0) -> str:
    """PING ``url`` once and return the server version; raise :class:`ServerUnreachable` otherwise.

    Without this, a wrong ``--url`` would surface as a traceback from deep inside
    the upload; checking first gives one clear sentence (and the CLI exit code 2).
    The connection follows tdstore's password rule (the URL's, else
    ``$TDSTORE_PASSWORD``), as the store and the actors will.
    """
    from tdstore._inspect.connect import InvalidURL, connect
    from tdstore._inspect.connect import ServerUnreachable as Unreachable

    try:
        conn = connect(url, timeout=timeout)
    except InvalidURL as err:
        raise ServerUnreachable(f"invalid server url {redact_url(url)!r}: {err}") from None
    except Unreachable as err:  # "cannot reach ...", or "the server at ... needs a password ..."
        raise ServerUnreachable(str(err)) from None
    with conn:
        try:
            return str(conn.client.info("server").get("redis_version", "unknown"))
        except redis.ResponseError:  # INFO may be forbidden by an ACL; PING was enough
            return "unknown"


@contextlib.contextmanager
def password_for_children(url: str) -> Iterator[None]:
    """Put the URL's password in ``$TDSTORE_PASSWORD`` while the actors are spawned, then restore it.

    A pickled store holds no password; a spawned actor reconnects with the password
    rule, whose last resort is the environment it inherits.  The environment is
    readable only by the same user (``/proc/PID/environ``), unlike a command line,
    which ``ps`` shows to everyone; nothing else carries the password to a child.
    """
    from redis.connection import parse_url

    try:
        password = parse_url(url.replace("+cluster://", "://", 1)).get("password")
    except ValueError:
        password = None
    if not password:
        yield
        return
    before = os.environ.get(PASSWORD_ENV)
    os.environ[PASSWORD_ENV] = password
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = before
