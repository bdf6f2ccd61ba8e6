"""Server probes the tools share: command counts and server time per command, keys left under a prefix, timing.

Command counts come from ``INFO commandstats``: :func:`tdstore.server.commandstats` counts calls (subcommands
folded into their parent); :func:`raw_commandstats` keeps each command's raw entry (``calls``, ``usec``,
``usec_per_call``) for the tools that report the server's own time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import redis

from tdstore.server import commandstats

__all__ = [
    "command_delta",
    "raw_commandstats",
    "commandstats",
    "connections_received",
    "delete_prefix",
    "error_count",
    "keys_under",
    "raw_snapshot",
    "server_cpu",
    "stray_keys",
    "timed",
    "total_calls",
    "usec_per_call",
    "usec_while",
]


# -- command counts and server time (INFO commandstats) -----------------------------------------


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands executed between two ``commandstats`` snapshots, minus the first INFO itself."""
    out = {}
    for name, n in after.items():
        if "|" in name:  # redis 7 lists subcommands both as 'script|load' and 'script'
            continue
        d = n - before.get(name, 0) - (1 if name == "info" else 0)
        if d:
            out[name] = d
    return out


def raw_commandstats(client: Any) -> dict[str, dict[str, Any]]:
    """``INFO commandstats`` as parsed by redis-py, keyed by command name (``cmdstat_evalsha`` -> ``evalsha``)."""
    return {name.removeprefix("cmdstat_"): value for name, value in client.info("commandstats").items()}


def usec_per_call(client: Any, command: str = "evalsha") -> float:
    """The server's mean time per call of ``command`` in microseconds, since the last CONFIG RESETSTAT."""
    return float(raw_commandstats(client)[command]["usec_per_call"])


def usec_while(client: Any, fn: Callable[[], Any], calls: int = 20, command: str = "evalsha") -> float:
    """Server time per ``command`` call in microseconds while ``fn`` runs ``calls`` times."""
    before = raw_commandstats(client).get(command, {})
    for _ in range(calls):
        fn()
    after = raw_commandstats(client).get(command, {})
    n = after.get("calls", 0) - before.get("calls", 0)
    return (after.get("usec", 0) - before.get("usec", 0)) / max(n, 1)


def total_calls(client: Any) -> int:
    """Calls of every command since the server started (each ``INFO commandstats`` entry summed)."""
    return sum(v["calls"] for v in raw_commandstats(client).values())


def server_cpu(client: redis.Redis) -> float:
    """Seconds of CPU the server has used (user + system, all its threads): parsing and replies included."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def error_count(client: redis.Redis, name: str) -> int | None:
    """How many replies with error prefix ``name`` (e.g. NOSCRIPT) the server sent (INFO errorstats, Redis 6.2+)."""
    try:
        stats = client.info("errorstats")
    except redis.ResponseError:
        return None
    value = stats.get(f"errorstat_{name}")
    if isinstance(value, dict):
        return int(value.get("count", 0))
    if isinstance(value, str):
        m = re.search(r"count=(\d+)", value)
        return int(m.group(1)) if m else 0
    return 0


def connections_received(client: redis.Redis) -> int:
    """Connections the server accepted since it started (INFO stats)."""
    return int(client.info("stats")["total_connections_received"])


# -- keys under a prefix -------------------------------------------------------------------------


def raw_snapshot(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix:``, with its raw content (``GET`` for strings, ``HGETALL`` for the header)."""
    out: dict[bytes, Any] = {}
    cursor = 0
    for _ in range(100_000):
        cursor, keys = client.scan(cursor, match=f"{prefix}:*", count=1000)
        for key in keys:
            kind = client.type(key)
            if kind == b"string":
                out[key] = client.get(key)
            elif kind == b"hash":
                out[key] = sorted(client.hgetall(key).items())
            else:
                out[key] = kind
        if cursor == 0:
            break
    return out


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key under ``prefix:`` (SCAN), e.g. what a store left behind once deleted."""
    return list(client.scan_iter(match=f"{prefix}:*", count=1000))


def stray_keys(client: redis.Redis, prefix: str) -> list[tuple[bytes, int]]:
    """Staging keys (``...:stage:<token>``) under ``prefix``, with their TTL in ms (-1: none)."""
    return [(k, int(client.pttl(k))) for k in raw_snapshot(client, prefix) if b":stage:" in k]


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (exact names from SCAN, never a pattern DEL)."""
    n = 0
    cursor = 0
    for _ in range(100_000):
        cursor, keys = client.scan(cursor, match=f"{prefix}*", count=1000)
        if keys:
            n += client.delete(*keys)
        if cursor == 0:
            break
    return n


# -- timing --------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
