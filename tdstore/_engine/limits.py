"""What the server allows, read once per server and process: string size, request size, memory.

* ``proto-max-bulk-len``: the largest string; ``write.lua`` refuses a call that would grow
  one past it, before writing anything.
* ``client-query-buffer-limit``: the largest request the server reads from a client before it
  drops the connection (a bare ``Broken pipe`` after redis-py's retries). Bulk bytes go in
  pieces of at most half of it, and a single call that cannot be cut is refused before it is
  sent, naming the setting.
* ``maxmemory`` and ``maxmemory-policy``: a store whose declared size cannot fit is refused up
  front, and a policy that can evict a store's keys is warned about once (tdstore then reports
  lost keys as :class:`~tdstore.StoreDamagedError`; ``noeviction`` never loses them).

Servers that refuse ``CONFIG`` (an ACL user without it, a managed service) are assumed to allow
512 MiB strings and 1 GiB requests, with no memory limit.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import redis

_DEFAULT_VALUE = 512 << 20
_DEFAULT_QUERY = 1 << 30


@dataclass(frozen=True)
class ServerLimits:
    value_bytes: int = _DEFAULT_VALUE
    """``proto-max-bulk-len``."""
    query_bytes: int = _DEFAULT_QUERY
    """``client-query-buffer-limit``."""
    maxmemory: int = 0
    """``maxmemory`` (0: none)."""
    policy: str = ""
    """``maxmemory-policy`` ('' when unknown)."""

    @property
    def piece_bytes(self) -> int:
        """Bytes of one plain ``SETRANGE`` of a bulk write: 1 MiB, or less under a small query buffer limit."""
        return max(1 << 12, min(1 << 20, self.query_bytes // 2))

    @property
    def evicts(self) -> bool:
        """Whether the server may evict keys of a store (``volatile-*`` only those with a time to live)."""
        return self.policy.startswith(("allkeys-", "volatile-"))


_cache: dict[str, ServerLimits] = {}
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _value(reply: dict, name: str) -> str | None:
    v = reply.get(name.encode()) or reply.get(name)
    return v.decode() if isinstance(v, bytes) else v


def read(client: redis.Redis, where: str) -> ServerLimits:
    """The limits of the server ``client`` talks to (one pipeline, the first time per server and process)."""
    with _lock:
        known = _cache.get(where)
    if known is not None:
        return known
    got: dict = {}
    for pattern in ("proto-max-bulk-len", "client-query-buffer-limit", "maxmemory*"):
        try:
            got.update(client.config_get(pattern))
        except (redis.exceptions.ResponseError, AttributeError):
            pass  # an ACL user or a service without CONFIG: the defaults
    out = ServerLimits(
        value_bytes=int(_value(got, "proto-max-bulk-len") or _DEFAULT_VALUE),
        query_bytes=int(_value(got, "client-query-buffer-limit") or _DEFAULT_QUERY),
        maxmemory=int(_value(got, "maxmemory") or 0),
        policy=_value(got, "maxmemory-policy") or "",
    )
    with _lock:
        _cache[where] = out
    return out


def warn_eviction(limits: ServerLimits, where: str) -> None:
    """Warn once per server and policy when the server may evict a store's keys."""
    if not limits.evicts or limits.maxmemory <= 0:
        return
    with _lock:
        if (where, limits.policy) in _warned:
            return
        _warned.add((where, limits.policy))
    which = "any key of a store" if limits.policy.startswith("allkeys-") else "keys of stores with a time to live (ttl=)"
    warnings.warn(
        f"the server at {where} has maxmemory {limits.maxmemory} with maxmemory-policy {limits.policy}: it may evict {which}. "
        "tdstore then raises StoreDamagedError instead of returning the lost data; maxmemory-policy noeviction is the safe setting",
        RuntimeWarning,
        stacklevel=3,
    )


def forget(where: str) -> None:
    """Drop what is known of a server (its settings changed: tests, tools)."""
    with _lock:
        _cache.pop(where, None)
        for key in [k for k in _warned if k[0] == where]:
            _warned.discard(key)
