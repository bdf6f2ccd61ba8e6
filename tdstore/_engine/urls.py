"""Server URLs: the schemes tdstore accepts, their parts (redis-py's parser, checked first), and a URL fit
to print (without its password). No client is opened here (``_engine.connection`` does that).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.connection import SSLConnection, parse_url

#: The URL schemes tdstore reaches a server by: redis-py's, and a Redis Cluster's.
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


def redact_url(url: str) -> str:
    """``url`` without its password, for messages (and a child's command line: the password reaches it by
    ``$TDSTORE_PASSWORD``): the user info's masked, a ``?password=`` dropped. A URL without ``://``
    loses everything before its last ``@``."""
    if "://" not in url:
        return f"***@{url.rsplit('@', 1)[1]}" if "@" in url else url
    try:
        parts = urlsplit(url)
        query = "&".join(p for p in parts.query.split("&") if not p.lower().startswith("password=")) if parts.query else ""
        netloc = parts.netloc
        if parts.password is not None:
            netloc = (f"{parts.username}:***@" if parts.username else ":***@") + netloc.rsplit("@", 1)[1]
        if (netloc, query) == (parts.netloc, parts.query):
            return url  # (urlunsplit would write unix:///path as unix:/path)
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:
        return "<unparsable url>"


def check_scheme(url: str) -> None:
    """Refuse a URL without one of :data:`URL_SCHEMES` (redis-py's own message lists only its three)."""
    if not url.lower().startswith(URL_SCHEMES):
        raise ValueError(
            f"the URL {redact_url(url)!r} does not start with a scheme tdstore accepts: {', '.join(URL_SCHEMES)} "
            "(e.g. redis://localhost:6379/0, or redis+cluster://host:port for a Redis Cluster)"
        )


def parse_url_parts(url: str) -> dict[str, Any]:
    """Parts of a ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` URL (redis-py's parser)."""
    check_scheme(url)
    cluster = False
    for scheme in ("redis+cluster://", "rediss+cluster://"):
        if url.lower().startswith(scheme):
            url = scheme.replace("+cluster", "") + url[len(scheme) :]
            cluster = True
    parts = dict(parse_url(url))
    check_db(url)
    if cluster:
        if "path" in parts:
            raise ValueError("a Redis Cluster is reached over TCP: redis+cluster://host:port")
        if parts.pop("db", 0):
            raise ValueError("Redis Cluster has only database 0")
        parts["cluster"] = True
    cls = parts.pop("connection_class", None)
    out: dict[str, Any] = {"ssl": cls is not None and issubclass(cls, SSLConnection)}
    if "path" in parts:
        out["unix_socket_path"] = parts.pop("path")
    for name in ("host", "port", "db", "cluster"):
        if name in parts:
            out[name] = parts.pop(name)
    out["rest"] = parts  # username, password, query options
    return out


def check_db(url: str) -> None:
    """Refuse a URL whose path is not a database number (redis-py's parser reads ``redis://host/abc`` as db 0)."""
    split = urlsplit(url)
    if split.scheme.lower() == "unix":
        return  # the path is the socket's; the database comes in ?db=, which redis-py checks
    path = unquote(split.path).strip("/")
    if path and not path.isdigit():
        raise ValueError(
            f"the URL {split.scheme}://{split.hostname or ''}{':' + str(split.port) if split.port else ''}/{path} names database "
            f"{path!r}: a database is a number (redis://host:port/0)"
        )
