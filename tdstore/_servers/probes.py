"""Helpers the tests and tools share around a server: its command counts, and the loopback rule.

They need no server of ours (unlike :mod:`tdstore.server`), only a client or a URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis

__all__ = ["check_loopback", "commandstats"]


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Number of calls per command since the server started (or CONFIG RESETSTAT).

    Tests and benchmarks use this to assert *how* tdstore talks to redis (e.g.
    "one EVALSHA, no KEYS"), which is stable where timings are not.

    Keys are lower-case command names without the ``cmdstat_`` prefix.  Redis
    7 reports only subcommands for container commands (``script|load``,
    ``config|get``) whereas 6.2 reports the container (``script``); so each
    ``parent|sub`` entry is kept *and* added to ``parent``, which makes
    ``stats["script"]`` meaningful on every version.
    """
    raw = client.info("commandstats")
    out: dict[str, int] = {}
    parents: dict[str, int] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        name = name.lower()
        if not name.startswith("cmdstat_"):
            continue
        name = name[len("cmdstat_") :]
        calls = _calls(value)
        out[name] = out.get(name, 0) + calls
        if "|" in name:
            parent = name.split("|", 1)[0]
            parents[parent] = parents.get(parent, 0) + calls
    for parent, calls in parents.items():
        out[parent] = out.get(parent, 0) + calls
    return out


def _calls(value: Any) -> int:
    """Extract ``calls`` from a parsed ({"calls": n}) or raw ("calls=n,...") entry."""
    if isinstance(value, dict):
        return int(value["calls"] if "calls" in value else value.get(b"calls", 0))
    text = value.decode() if isinstance(value, bytes) else str(value)
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() == "calls":
            return int(v)
    return 0


def check_loopback(url: str) -> None:
    """Refuse a ``--url`` that is not a unix socket or a loopback address."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return
    if parts.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ValueError(f"--url must be redis://, rediss://, redis+cluster:// or unix://, got {url!r}")
    host = parts.hostname or ""
    if not (host in ("localhost", "::1") or host.startswith("127.")):
        raise ValueError(f"--url must point to a loopback address (127.x, localhost, ::1) or a unix socket, got host {host!r}")
