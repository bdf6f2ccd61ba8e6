"""Loads the Lua scripts in ``lua/`` and calls them (``call``, ``call_many``); the engine's staged
writes send the same ``EVALSHA`` at the end of their pipeline (``Transport._staged_call``).

Each script is sent as ``EVALSHA`` with the SHA1 computed locally, so the first
call costs no extra round trip when the server already knows the script.  On
``NOSCRIPT`` (server restart, failover, ``SCRIPT FLUSH``, script-cache eviction)
the script is loaded with ``SCRIPT LOAD`` (on Redis Cluster, on the primary that serves
the call's slot; on a connection of its own, see ``load``) and the call is retried once; if the
cache was flushed again in between, the call is sent as ``EVAL`` with the text.  redis-py
``Script`` objects are not used: in pipelines they add a ``SCRIPT EXISTS`` round
trip on every execute.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import cache, partial
from importlib import resources
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError

from tdstore._engine import deadline, slot_map
from tdstore._engine.script_text import assemble
from tdstore._errors import ReadOnlyReplicaError, StoreDamagedError
from tdstore._format.integrity import WrongTypeError

LIBRARY = "_lib"
SCRIPT_NAMES = (
    "create",
    "read",
    "write",
    "direct",
    "commit",
    "clear",
    "expire",
    "copy",
    "lock",
    "guard",
    "sampling",
    "priority",
    "tree_build",
    "ack",
    "restore",
    "marks",
    "fence",
    "rollouts",
    "trajectories",
    "sampled",
    "distinct",
)
#: Scripts that also get the priority tree's helpers (``lua/_tree.lua``), after the library.
TREE_LIBRARY = "_tree"
USES_TREE = frozenset({"read", "write", "sampling", "priority", "tree_build"})
#: Scripts that also get the lease table's helpers (``lua/_lease.lua``), after the others.
LEASE_LIBRARY = "_lease"
USES_LEASE = frozenset({"read", "ack"})
#: Scripts that also get the helpers that skip the rows a restore left absent (``lua/_absent.lua``), last.
ABSENT_LIBRARY = "_absent"
USES_ABSENT = frozenset({"read", "priority", "tree_build"})
#: Scripts that also get the rollout index's helpers (``lua/_rollouts.lua``), last.
ROLLOUT_LIBRARY = "_rollouts"
USES_ROLLOUT = frozenset({"read", "write", "rollouts"})
#: Scripts that also get the episode index's helpers (``lua/_episodes.lua``), after the others.
EPISODES_LIBRARY = "_episodes"
USES_EPISODES = frozenset({"read", "write", "trajectories"})
#: Scripts that also get the sampled-rows bitmap's helpers (``lua/_seen.lua``: distinct rows sampled), after the others.
SEEN_LIBRARY = "_seen"
USES_SEEN = frozenset({"read", "write", "direct"})


class ServerScriptError(RuntimeError):
    """A tdstore script refused a call (a bug or a corrupt store, never user input)."""


class EmptyRingError(ValueError):
    """A sample found no written slot (``read.lua``'s ``TDSTORE empty``); a sample given
    ``timeout=`` or ``min_size=`` waits for one instead (``_ring.policy_calls.wait_or_raise``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"cannot sample: {detail}")
        self.detail = detail


def _lua_dir() -> Any:
    """Where the ``.lua`` files are: the package data ``tdstore._lua``, found one way only.

    The wheel holds them as ``tdstore/_lua`` (``pyproject.toml`` maps that package to ``lua/``); a
    source checkout has ``tdstore/_lua`` as a link to ``lua/``, so both find the same files the
    same way.  Returns a ``Traversable`` (a namespace package gives a ``MultiplexedPath``, which
    is not a ``Path``), so files are only read through ``joinpath(...).read_text()``.
    """
    return resources.files("tdstore._lua")


@cache
def script_source(name: str) -> tuple[str, str]:
    """``(text, sha1)`` of script ``name`` with the shared helpers it uses prepended."""
    folder = _lua_dir()
    libraries = [LIBRARY, TREE_LIBRARY] if name in USES_TREE else [LIBRARY]
    if name in USES_LEASE:
        libraries.append(LEASE_LIBRARY)
    if name in USES_ABSENT:
        libraries.append(ABSENT_LIBRARY)
    if name in USES_ROLLOUT:
        libraries.append(ROLLOUT_LIBRARY)
    if name in USES_EPISODES:
        libraries.append(EPISODES_LIBRARY)
    if name in USES_SEEN:
        libraries.append(SEEN_LIBRARY)
    # only the helpers the script uses: every call makes each top-level helper again (see _engine.script_text)
    text = assemble([folder.joinpath(f"{lib}.lua").read_text() for lib in libraries], folder.joinpath(f"{name}.lua").read_text())
    return text, hashlib.sha1(text.encode()).hexdigest()  # lowercase, as fakeredis needs


def name_of(sha: str) -> str:
    """The name of the script whose text (:func:`script_source`) has ``sha``."""
    for name in SCRIPT_NAMES:
        if script_source(name)[1] == sha:
            return name
    raise KeyError(f"no tdstore script has sha {sha}")


def load(client: redis.Redis, text: str) -> None:
    """``SCRIPT LOAD text`` on a connection of its own (a real server; else on ``client``), bounded by the
    thread's deadline if it has one.

    Redis 7.0 keeps a script's text in the buffer it read it into, and a connection that just sent a
    large call (the write that met ``NOSCRIPT``) has a query buffer as large as that call's largest
    argument waiting for the next request: loading the 78 KB ``write.lua`` there after an 8 MiB
    extend kept 10 MiB of ``used_memory`` for as long as the script stays cached, room the memory
    guard then counts as used. A new connection reads the text into a buffer of its size (82 KB)."""
    if not deadline.is_real(client):
        deadline.execute_command(client, "SCRIPT", "LOAD", text)
        return
    conn = deadline.new_connection(client.connection_pool)

    def send() -> Any:
        conn.send_command("SCRIPT", "LOAD", text)
        return conn.read_response()

    try:
        dl = deadline.active()
        if dl is None:
            conn.retry.call_with_retry(send, lambda *_: conn.disconnect())
        else:
            with deadline.bounded(conn, dl):
                conn.retry.call_with_retry(send, lambda *_: conn.disconnect())
    finally:
        conn.disconnect()


def call(
    client: redis.Redis | RedisCluster, name: str, keys: list[str], args: list[Any], execute: Callable[..., Any] | None = None
) -> list:
    """Run script ``name`` in one round trip (two more only after NOSCRIPT).

    ``execute(client, *command)`` sends one command (a handle's held connection,
    see ``_engine.connection.HeldConnection``); by default ``client.execute_command``.
    """
    text, sha = script_source(name)
    run = execute or (lambda c, *command: c.execute_command(*command))
    try:
        try:
            return run(client, "EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            if isinstance(client, RedisCluster):
                # on the primary that serves the call's slot (after a failover, the new one):
                # a plain SCRIPT LOAD would go to every primary and fail while any one is down
                client.execute_command("SCRIPT", "LOAD", text, target_nodes=client.get_node_from_key(keys[0]))
            else:
                load(client, text)  # not on the call's connection: see load
        try:
            return run(client, "EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            # flushed again between our load and the retry: send the text itself
            return run(client, "EVAL", text, len(keys), *keys, *args)
    except ResponseError as err:
        raise translate(err, keys) from None


#: A cluster node's answer that the call belongs elsewhere or later (resharding, failover): RedisCluster
#: follows it. ``MovedError``'s text is only the slot and address, without the ``MOVED`` its class stands for.
REDIRECTS = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


class _Redirected(Exception):
    """A node answered a call with a cluster redirect: its calls go through RedisCluster."""


_pool: ThreadPoolExecutor | None = None


def _reset_pool() -> None:
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_reset_pool)  # a forked child has none of the parent's threads


def on_nodes(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` (one per cluster node, each one round trip) at the same time; their results in order.

    One thread per node beyond the first: the round trips overlap, so a call over
    segments on three nodes costs about one round trip, not three.
    """
    global _pool
    if len(jobs) == 1:
        return [jobs[0]()]
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tdstore-node")
    futures = [_pool.submit(deadline.carried(job)) for job in jobs[1:]]  # each under the call's deadline
    try:
        first = jobs[0]()
    finally:
        wait(futures)  # every node's round trip is over before anyone acts on the outcome
    return [first, *(f.result() for f in futures)]


def call_many(cluster: RedisCluster, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
    """Run script calls, each on the keys of one slot, as one pipeline per cluster node, all nodes at once.

    Replies come back in the order of ``calls``; a call the server refused comes back as
    its (translated) exception instead of raising, so the caller sees what the other
    calls did. A script a node does not know is loaded there and only the calls that
    missed it are sent again. A node that redirects (resharding, failover) or cannot
    be reached gets its calls through ``RedisCluster``, one by one, which follows the new
    map or raises. Under a call's deadline (``_engine.deadline``) every node's pipeline is bounded
    by it: a node that cannot be reached makes the calls it did not answer go to the node the slot map
    names once read again (``_engine.slot_map``), until the deadline (then its ``TimeoutError``).
    """
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, (_, keys, _) in enumerate(calls):
        node = cluster.get_node_from_key(keys[0])
        groups.setdefault(node.name, (node, []))[1].append(i)
    out: list[Any] = [None] * len(calls)

    def rest(idxs: list[int], node: Any) -> None:
        todo = [i for i in idxs if out[i] is None]
        if todo:
            _node_pipeline(node.redis_connection, calls, todo, out)

    def job(node: Any, idxs: list[int]) -> None:
        try:
            if deadline.active() is None:
                rest(idxs, node)
            else:  # a node that cannot be reached: the error at once, not tries there until the deadline
                with deadline.rerouting():
                    rest(idxs, node)
        except (_Redirected, *REDIRECTS):
            resend(idxs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            if deadline.active() is None:
                resend(idxs)
                return
            # under a call's deadline RedisCluster (no deadline bounds it) is no way out: past the deadline
            # the call's TimeoutError; before it, the calls not answered yet as a pipeline on the node the
            # slot map names once read again (a failover's promoted replica), until the deadline
            deadline.raise_if_over(err)
            try:
                slot_map.refresh(cluster, node.name)
                slot_map.on_slot_node(cluster, calls[idxs[0]][1][0], partial(rest, idxs), lambda: None)
            except (_Redirected, *REDIRECTS):
                resend(idxs)

    def resend(idxs: list[int]) -> None:
        """The calls of ``idxs`` not answered yet, through RedisCluster, one by one."""
        for i in idxs:
            if out[i] is None:
                name, keys, args = calls[i]
                try:
                    out[i] = call(cluster, name, keys, args)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterDownError):
                    raise
                except Exception as err:  # a refusal of this call: the caller decides
                    out[i] = err

    on_nodes([partial(job, node, idxs) for node, idxs in groups.values()])
    return out


def _node_pipeline(client: redis.Redis, calls: list[tuple[str, list[str], list[Any]]], idxs: list[int], out: list[Any]) -> None:
    """``calls[i]`` for i in ``idxs`` as one pipeline on one node's client, replies into ``out``."""
    todo = idxs
    for attempt in range(3):
        commands: list[tuple[Any, ...]] = []
        for i in todo:
            name, keys, args = calls[i]
            text, sha = script_source(name)
            if attempt < 2:
                commands.append(("EVALSHA", sha, len(keys), *keys, *args))
            else:  # flushed again between our load and the retry: the text itself
                commands.append(("EVAL", text, len(keys), *keys, *args))
        replies = deadline.pipeline(client, commands)  # under a call's deadline, bounded by it
        missing = []
        for i, reply in zip(todo, replies):
            if isinstance(reply, NoScriptError):
                missing.append(i)
            elif isinstance(reply, ResponseError):
                if isinstance(reply, REDIRECTS):
                    raise _Redirected(str(reply))
                out[i] = translate(reply, calls[i][1])
            else:
                out[i] = reply
        if not missing:
            return
        for name in {calls[i][0] for i in missing}:
            load(client, script_source(name)[0])
        todo = missing


def _tdstore_part(msg: str) -> str:
    """The ``TDSTORE ...`` message a script raised, without the script hash and line the server adds around it."""
    msg = msg[msg.index("TDSTORE") :]
    cut = msg.find(" script: ")  # Redis 7: '<message> script: <sha>, on @user_script:<line>.'
    msg = msg[:cut] if cut >= 0 else msg
    cut = msg.find("\nstack traceback")  # fakeredis (lupa) adds the Lua traceback
    return msg[:cut] if cut >= 0 else msg


def translate(err: Exception, keys: Sequence[str] = ()) -> Exception:
    """Turn a server error into the exception a user should see (never showing a script hash or line).
    ``keys``: those of the call, for a ``WRONGTYPE`` (one of them holds a value of another type: the
    engine names which, see ``_format.integrity.WrongTypeError``)."""
    msg = str(err)
    if "WRONGTYPE" in msg and "TDSTORE" not in msg:  # Redis 6 wraps a script's error in "ERR Error running script"
        return WrongTypeError(keys)
    if "TDSTORE" in msg:
        msg = _tdstore_part(msg)
    if "TDSTORE damaged" in msg:
        return StoreDamagedError(msg[msg.index("TDSTORE damaged") + 17 :], named=False)
    if "TDSTORE out of memory" in msg:
        return MemoryError(
            "the server has no room for this write (it does not evict); nothing was written: "
            f"{msg[msg.index('TDSTORE out of memory') + 22 :]}"
        )
    if "TDSTORE too large" in msg:
        return ValueError(
            f"the write would make a value larger than the server accepts; nothing was written: {msg[msg.index('TDSTORE') :]}"
        )
    if "TDSTORE exists" in msg:
        return ValueError(msg[msg.index("TDSTORE exists") + 16 :])
    if "TDSTORE refused" in msg:
        return ValueError(msg[msg.index("TDSTORE refused") + 17 :])
    if "TDSTORE empty" in msg:
        return EmptyRingError(msg[msg.index("TDSTORE empty") + 13 :].lstrip(": ").split("\n", 1)[0])  # fakeredis adds a traceback
    if "TDSTORE" in msg:
        return ServerScriptError(msg[msg.index("TDSTORE") :])
    low = msg.lower()
    if isinstance(err, ReadOnlyError) or ("replica" in low and ("readonly" in low or "read only" in low)):
        return ReadOnlyReplicaError(
            f"the server is a read-only replica: writes go to its primary (open a handle on the primary, or readonly=True here): {msg}",
            named=False,
        )
    if "unknown command" in low and ("evalsha" in low or "script" in low):
        return RuntimeError(f"the server does not support Lua scripting (EVALSHA), which tdstore needs: {msg}")
    if "oom" in low or "maxmemory" in low:
        return MemoryError(f"the server is out of memory (maxmemory reached); nothing was written by this call: {msg}")
    if "noperm" in low or "no permissions" in low or "can't run this command" in low:
        return PermissionError(f"the server's ACL refused the call: {msg}")
    if "string exceeds maximum allowed size" in low:
        return ValueError(f"the value is larger than the server allows for one string (proto-max-bulk-len): {msg}")
    return err
