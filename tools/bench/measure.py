"""Timing contenders interleaved on the same arguments, and the server they connect to."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from tdstore.server import EmbeddedServer
from tools._probes import command_delta, commandstats
from tools.bench.workload import SYSTEM_REDIS, MiB, Settings


# --------------------------------------------------------------------------- measuring
@dataclass
class Contender:
    """How one contender runs one operation: ``call(args)``, then ``post(result)`` untimed."""

    name: str
    call: Callable[[Any], Any]
    post: Callable[[Any], None] | None = None


@dataclass
class OpOutcome:
    """What was measured for one contender on one operation."""

    samples_ns: list[int] = field(default_factory=list)
    error: str | None = None
    commands: dict[str, int] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON form: timings in ms, or the error it raised."""
        if self.error is not None:
            return {"status": "raises", "error": self.error, "commands": self.commands}
        if not self.samples_ns:
            return {"status": "not run"}
        ms = sorted(s / 1e6 for s in self.samples_ns)
        return {
            "status": "ok",
            "n": len(ms),
            "median_ms": statistics.median(ms),
            "mean_ms": statistics.fmean(ms),
            "min_ms": ms[0],
            "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "commands": self.commands,
        }


def _describe(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:200]}"


def measure(
    contenders: Sequence[Contender],
    next_args: Callable[[], Any],
    *,
    reps: int,
    settings: Settings,
    stats_client: redis.Redis | None,
) -> dict[str, OpOutcome]:
    """Run warm-up rounds, one command-counting round, then ``reps`` timed rounds.

    Every round draws its arguments once and runs each contender on them, the
    order rotating from round to round.  A contender that raises is recorded
    with its error and skipped from then on.  Rounds stop early once
    ``settings.min_reps`` are done and the operation took ``op_budget_s``.
    """
    out = {c.name: OpOutcome() for c in contenders}

    def one(c: Contender, args: Any, timed: bool, count_commands: bool = False) -> None:
        res = out[c.name]
        if res.error is not None:
            return
        before = commandstats(stats_client) if count_commands and stats_client is not None else None
        try:
            t0 = time.perf_counter_ns()
            result = c.call(args)
            t1 = time.perf_counter_ns()
        except Exception as err:  # recorded, e.g. the reference on heterogeneous batches
            res.error = _describe(err)
            return
        finally:
            if before is not None:
                res.commands = command_delta(before, commandstats(stats_client))
        if c.post is not None:
            c.post(result)
        if timed:
            res.samples_ns.append(t1 - t0)

    for _ in range(settings.warmup):
        args = next_args()
        for c in contenders:
            one(c, args, False)
    if stats_client is not None:
        args = next_args()
        for c in contenders:
            one(c, args, False, count_commands=True)
    start = time.monotonic()
    for rep in range(reps):
        args = next_args()
        k = rep % len(contenders)
        for c in (*contenders[k:], *contenders[:k]):
            one(c, args, True)
        if rep + 1 >= settings.min_reps and time.monotonic() - start > settings.op_budget_s:
            break
    return out


# --------------------------------------------------------------------------- server
@dataclass
class Target:
    """Where the contenders connect: a URL (tdstore, raw) and the reference's keywords."""

    url: str
    ref_kwargs: dict[str, Any]
    server_version: str
    started_here: bool

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def reference_kwargs(url: str) -> dict[str, Any]:
    """``host``/``port``/``db`` or ``unix_socket_path`` for the reference, from a URL."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    kw: dict[str, Any] = {}
    if parts.scheme == "unix":
        kw["unix_socket_path"] = unquote(parts.path)
        kw["db"] = int(query.get("db", ["0"])[0])
    elif parts.scheme in ("redis", "rediss"):
        kw["host"] = parts.hostname or "localhost"
        kw["port"] = parts.port or 6379
        path_db = parts.path.lstrip("/")
        kw["db"] = int(path_db) if path_db else int(query.get("db", ["0"])[0])
        if parts.scheme == "rediss":
            kw["ssl"] = True
    else:
        raise SystemExit(f"--url must be redis://, rediss:// or unix://, got {url!r}")
    if parts.password:
        kw["password"] = unquote(parts.password)
    if parts.username:
        kw["username"] = unquote(parts.username)
    return kw


@contextlib.contextmanager
def open_target(args: argparse.Namespace, settings: Settings) -> Iterator[Target]:
    """Start a private redis-server (or use ``--url``) for the whole run."""
    if args.url:
        client = redis.Redis.from_url(args.url)
        version = str(client.info("server")["redis_version"])
        client.close()
        yield Target(args.url, reference_kwargs(args.url), version, False)
        return
    binary = SYSTEM_REDIS if os.path.exists(SYSTEM_REDIS) else None
    extra: list[str] = []
    if max(settings.large_leaf_bytes) >= 256 * MiB:
        # one command then carries a whole leaf: raise the 512 MiB / 1 GiB defaults
        extra += ["--proto-max-bulk-len", "4gb", "--client-query-buffer-limit", "4gb"]
    with EmbeddedServer(unix_socket=not args.tcp, binary=binary, extra_args=extra) as srv:
        yield Target(srv.url, reference_kwargs(srv.url), srv.version, True)
