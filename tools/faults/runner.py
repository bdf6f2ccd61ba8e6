"""Running one fault case on its own server, and its lines of the report."""

from __future__ import annotations

import contextlib
import random
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer
from tools._probes import delete_prefix
from tools.faults.acl import case_readonly_acl
from tools.faults.ambiguous import case_ambiguous_timeout
from tools.faults.base import BULK_ARGS, CASE_NAMES, MAXMEMORY_ARGS, CaseResult, Check, Env, Options, describe_exc
from tools.faults.checkpoints import case_hostile_checkpoint
from tools.faults.connection import case_connection_drop, case_restart, case_script_flush
from tools.faults.eviction import EVICTION_ARGS, case_eviction
from tools.faults.limits import QUERY_BUFFER_ARGS, case_maxmemory, case_proto_max_bulk_len, case_query_buffer_limit
from tools.faults.processes import case_sigkill_writer, case_store_deleted, case_store_recreated
from tools.faults.sharded import case_sharded_failover


# ---------------------------------------------------------------------------------------------
# running the cases
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaseSpec:
    """A case: its function, the server arguments it needs, why it needs a private server."""

    run: Callable[[Env], list[Check]]
    server_args: tuple[str, ...] = ()
    private_reason: str = ""
    cluster: bool = False
    """Runs on a private cluster of three primaries with one replica each (``EmbeddedCluster(replicas=1)``)."""


CASES: dict[str, CaseSpec] = {
    "restart": CaseSpec(case_restart, private_reason="restarts the server"),
    "script-flush": CaseSpec(
        case_script_flush, private_reason="flushes the server's script cache, which other clients of a shared server rely on"
    ),
    "connection-drop": CaseSpec(case_connection_drop),
    "sigkill-writer": CaseSpec(case_sigkill_writer),
    "maxmemory": CaseSpec(case_maxmemory, MAXMEMORY_ARGS, "needs a server started with --maxmemory 20mb --maxmemory-policy noeviction"),
    "proto-max-bulk-len": CaseSpec(case_proto_max_bulk_len, BULK_ARGS, "needs a server started with --proto-max-bulk-len 1mb"),
    "client-query-buffer-limit": CaseSpec(
        case_query_buffer_limit, QUERY_BUFFER_ARGS, "needs a server started with --client-query-buffer-limit 1mb"
    ),
    "store-deleted": CaseSpec(case_store_deleted),
    "store-recreated": CaseSpec(case_store_recreated),
    "eviction": CaseSpec(case_eviction, EVICTION_ARGS, "needs a server started with --maxmemory 16mb --maxmemory-policy allkeys-lru"),
    "ambiguous-timeout": CaseSpec(case_ambiguous_timeout, private_reason="stops the server (SIGSTOP) under a call"),
    "hostile-checkpoint": CaseSpec(case_hostile_checkpoint),
    "readonly-acl": CaseSpec(case_readonly_acl, private_reason="creates an ACL user and sends it admin commands"),
    "sharded-failover": CaseSpec(
        case_sharded_failover, private_reason="kills cluster nodes (a private cluster with replicas)", cluster=True
    ),
}
assert tuple(CASES) == CASE_NAMES


@contextlib.contextmanager
def open_env(name: str, opts: Options) -> Iterator[Env]:
    """A private server with the case's arguments (or ``--url``), an inspection client and a fresh prefix."""
    spec = CASES[name]
    prefix = f"faults-{uuid.uuid4().hex[:8]}"
    rng = random.Random(f"{opts.seed}:{name}")
    if opts.url:
        client = redis.Redis.from_url(opts.url)
        try:
            yield Env(opts.url, client, None, prefix, opts, rng)
        finally:
            with contextlib.suppress(redis.RedisError):
                delete_prefix(client, prefix)
            client.close()
        return
    if spec.cluster:
        with EmbeddedCluster(replicas=1, binary=opts.binary) as cluster:
            client = cluster.node_client(0)  # an inspection client (server_label); the case's calls go through cluster.url
            try:
                yield Env(cluster.url, client, None, prefix, opts, rng, cluster=cluster)
            finally:
                client.close()
        return
    with EmbeddedServer(extra_args=spec.server_args, binary=opts.binary) as srv:
        client = srv.client()
        try:
            yield Env(srv.url, client, srv, prefix, opts, rng)
        finally:
            client.close()


def server_label(env: Env, name: str) -> str:
    """``redis <version> (<binary> <case arguments>)`` for a private server, the URL otherwise."""
    try:
        version = env.client.info("server")["redis_version"]
    except redis.RedisError:
        version = "?"
    if env.cluster is not None:
        return f"redis {version} (a cluster of {len(env.cluster.ports)} nodes: 3 primaries, 1 replica each)"
    if env.server is None:
        return f"redis {version} at {env.opts.url}"
    extra = "".join(f" {a}" for a in CASES[name].server_args)
    return f"redis {version} ({env.server.binary}{extra})"


def run_case(name: str, opts: Options) -> CaseResult:
    """Run one case on its own private server (or ``opts.url``) and return its result."""
    spec = CASES[name]
    t0 = time.monotonic()
    if opts.url and spec.private_reason:
        return CaseResult(name, "SKIP", 0.0, note=f"skipped with --url: this case {spec.private_reason}")
    label = ""
    try:
        with open_env(name, opts) as env:
            label = server_label(env, name)
            checks = spec.run(env)
    except Exception as exc:  # a case that breaks is a FAIL, with the traceback in the note
        tb = traceback.format_exc(limit=6)
        return CaseResult(name, "FAIL", time.monotonic() - t0, [Check("ran to the end", False, describe_exc(exc))], note=tb, server=label)
    status = "PASS" if checks and all(c.ok for c in checks) else "FAIL"
    return CaseResult(name, status, time.monotonic() - t0, checks, server=label)


def format_line(res: CaseResult) -> str:
    """The one line printed for a case."""
    head = f"{res.name:<25} {res.status:<4} {res.seconds:5.1f}s"
    if res.status == "SKIP":
        return f"{head}  {res.note}"
    return f"{head}  saw: {res.saw} | proof: {res.proof}"


def format_checks(res: CaseResult) -> str:
    """Every check of a case, one per line (``-v``, and the details of a failure)."""
    lines = [f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: saw {c.saw or '-'} | {c.proof or '-'}" for c in res.checks]
    if res.note and res.status == "FAIL":
        lines.append("  " + res.note.strip().replace("\n", "\n  "))
    return "\n".join(lines)
