"""Fault case ``readonly-acl``: a learner logged in as README.md's read-only server user (issue 38 item 4).

The learner is hostile or buggy: it sends, on its own connection, what the user it logs in as might
let it (``CLIENT PAUSE``, ``CLIENT KILL``, ``CONFIG SET``, ``DEBUG``, ``FLUSHALL``, a write script of its
own, tdstore's write scripts through a handle without ``readonly=True``), while a writer extends the
ring. Every one must be refused by the server, and the writer never held up nor cut off; the learner's
``readonly=True`` handle must still read, sample and wait (subscribed, without the polling warning).
On Redis 7 every command is asked of ``ACL DRYRUN`` too. The line is read from README.md, so the case
checks what users copy.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import redis
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tools._probes import raw_snapshot
from tools.faults.base import Check, Env, describe_exc

README = Path(__file__).resolve().parents[2] / "README.md"

#: Commands the learner must be refused (a server's harmless form of each, should one be let through:
#: 0.5 s pauses, a client id no one has, the current maxmemory-policy set again).
REFUSED: tuple[tuple[str, ...], ...] = (
    ("CLIENT", "PAUSE", "500"),
    ("CLIENT", "KILL", "ID", "999999999"),
    ("CLIENT", "LIST"),
    ("CLIENT", "NO-EVICT", "ON"),
    ("CONFIG", "SET", "maxmemory-policy", "noeviction"),
    ("CONFIG", "GET", "maxmemory"),
    ("DEBUG", "SLEEP", "0"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("ACL", "LIST"),
    ("KEYS", "*"),
    ("INFO",),
    ("SLOWLOG", "GET"),
    ("EVAL", "return 1", "0"),
    ("PUBLISH", "x", "y"),
    ("REPLICAOF", "NO", "ONE"),
    ("SWAPDB", "0", "1"),
    ("BGSAVE",),
)

#: Refused by ``ACL DRYRUN`` (Redis 7), never sent: they would stop or block the server if let through.
REFUSED_DRY_ONLY: tuple[tuple[str, ...], ...] = (("SHUTDOWN", "NOSAVE"), ("MONITOR",), ("CLIENT", "PAUSE", "3000"), ("FAILOVER",))


def readme_acl(prefix: str, user: str = "learner", password: str = "pw") -> list[str]:
    """README.md's ``ACL SETUSER learner ...`` line as a command for ``prefix``, ``user`` and ``password``."""
    found = re.search(r"`ACL SETUSER learner ([^`]+)`", README.read_text().replace("\n", " "))
    if found is None:
        raise LookupError("README.md names no read-only ACL (`ACL SETUSER learner ...`)")
    rules = [f">{password}" if r == ">pw" else r for r in found.group(1).replace("<prefix>", prefix).split()]
    return ["ACL", "SETUSER", user, *rules]


def server_version(client: redis.Redis) -> tuple[int, ...]:
    """The server's ``redis_version`` as a tuple of ints."""
    return tuple(int(x) for x in str(client.info("server")["redis_version"]).split(".")[:2])


def learner_url(env: Env, user: str = "learner", password: str = "pw") -> str:
    """``env``'s URL, logged in as ``user``."""
    scheme, rest = env.url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def learner_client(env: Env, user: str = "learner", password: str = "pw") -> redis.Redis:
    """A plain redis-py client logged in as ``user`` (what a learner could send by hand)."""
    return redis.Redis.from_url(learner_url(env, user, password))


def _refused(client: redis.Redis, command: tuple[str, ...]) -> tuple[bool, str]:
    """Whether the server refuses ``command`` to ``client``'s user for its ACL, and what it said."""
    try:
        reply = client.execute_command(*command)
    except redis.exceptions.NoPermissionError as err:
        return True, str(err)
    except redis.exceptions.ResponseError as err:
        text = str(err)  # Redis 7 refuses DEBUG to every client unless enable-debug-command is set (6.2: the ACL)
        return "NOPERM" in text or "no permissions" in text or "not allowed" in text, text
    return False, f"ran: {str(reply)[:60]}"


def _extend_seconds(store: LazyStackedTensorDictStore, tag: float) -> float:
    t0 = time.monotonic()
    store.extend([TensorDict(obs=torch.full((4,), tag))])
    return time.monotonic() - t0


def case_readonly_acl(env: Env) -> list[Check]:
    """README.md's read-only user against admin commands and writes, with a writer at work; its reader still works."""
    admin = env.client
    admin.execute_command(*readme_acl(env.prefix))
    writer = LazyStackedTensorDictStore(count=64, url=env.url, prefix=env.prefix, td_id=env.td_id("acl"))
    writer.extend([TensorDict(obs=torch.full((4,), float(i))) for i in range(4)])
    dense = TensorDictStore(batch_size=[16], url=env.url, prefix=env.prefix, td_id=env.td_id("acl-dense"))
    dense.extend(TensorDict(obs=torch.arange(12.0).reshape(4, 3), batch_size=[4]))
    learner = learner_client(env)
    checks: list[Check] = []

    # the commands a hostile learner sends by hand, each while the writer's handle is connected
    writers_before = sum(1 for c in admin.client_list() if c.get("user") == "default")
    results = [(" ".join(cmd), *_refused(learner, cmd)) for cmd in REFUSED]
    stalled = max(_extend_seconds(writer, 100.0 + k) for k in range(3))
    writers_after = sum(1 for c in admin.client_list() if c.get("user") == "default")
    let = [name for name, ok, _ in results if not ok]
    checks.append(
        Check(
            "admin commands refused",
            not let,
            "NOPERM for each" if not let else "; ".join(f"{name}: {said}" for name, ok, said in results if not ok),
            f"{len(results) - len(let)}/{len(results)} refused; the writer's next extends took at most {stalled * 1000:.0f} ms; "
            f"the server's clients of user default: {writers_before} before, {writers_after} after",
        )
    )

    # a write script of the learner's own, and tdstore's write scripts through a handle without readonly=True
    key = writer._engine.keys.meta
    before = raw_snapshot(admin, env.prefix)
    try:
        sha = learner.script_load("return redis.call('HSET', KEYS[1], 'count', '1')")
        learner.evalsha(sha, 1, key)
        own = "ran"
    except redis.exceptions.ResponseError as err:
        own = describe_exc(err)
    rw = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, url=learner_url(env), prefix=env.prefix)
    try:
        rw.extend([TensorDict(obs=torch.zeros(4))])
        tds = "wrote"
    except PermissionError as err:
        tds = describe_exc(err)
    rw.close()
    written = raw_snapshot(admin, env.prefix)
    changed = sorted(k for k in set(before) | set(written) if before.get(k) != written.get(k))
    checks.append(
        Check(
            "writes refused",
            own != "ran" and tds != "wrote" and not changed,
            f"own script: {own}; tdstore extend: {tds}",
            f"{len(before)} keys under the prefix, {len(changed)} changed",
        )
    )

    # the learner's tdstore handle (readonly=True): reads, samples, waits subscribed
    ro = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, url=learner_url(env), prefix=env.prefix, readonly=True)
    rd = TensorDictStore.from_store(td_id=dense.td_id, url=learner_url(env), prefix=env.prefix, readonly=True)
    out: dict[str, Any] = {}

    def wait() -> None:
        try:
            out["sample"] = ro.sample(2, min_size=9, timeout=60)
            out["wait"] = ro.wait_for(written=10, timeout=60)
        except BaseException as err:  # reported by the check below
            out["err"] = err

    channel = writer._engine.keys.events

    def subscribed_or(done: str) -> None:  # the waiter is subscribed to the store's channel (or has returned)
        for _ in range(6000):
            if done in out or "err" in out or dict(admin.pubsub_numsub(channel)).get(channel.encode(), 0) >= 1:
                return
            time.sleep(0.01)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        th = threading.Thread(target=wait)
        th.start()
        for done, n in (("sample", 9), ("wait", 10)):
            subscribed_or(done)
            while len(writer.written) < n:
                writer.extend([TensorDict(obs=torch.full((4,), 200.0 + len(writer.written)))])
        th.join(60)
        read = ro.to_tensordict()["obs"].shape[0] == ro.batch_size[0] and rd[0:4]["obs"].shape == (4, 3)
        sampled = ro.sample(3).indices.numel() == 3 and rd.sample(3).indices.numel() == 3
    polled = [w for w in seen if "SUBSCRIBE" in str(w.message)]
    try:
        ro.pop(1)
        popped = "popped"
    except PermissionError as err:
        popped = describe_exc(err, 60)
    ok = read and sampled and "err" not in out and "wait" in out and not polled and popped != "popped"
    checks.append(
        Check(
            "the reader reads, samples and waits",
            ok,
            describe_exc(out.get("err")) if "err" in out else f"waited subscribed ({len(polled)} polling warnings); pop: {popped}",
            f"to_tensordict, dense slice, sample(3) lazy and dense; sample(min_size=9) and wait_for(written=10) woke: {'wait' in out}",
        )
    )

    # Redis 7: ACL DRYRUN of the refused commands, and of those too dangerous to send
    if server_version(admin) >= (7, 0):
        dry = [(" ".join(c), admin.execute_command("ACL", "DRYRUN", "learner", *c)) for c in (*REFUSED, *REFUSED_DRY_ONLY)]
        let = [name for name, reply in dry if reply in (b"OK", "OK")]
        allowed = [admin.execute_command("ACL", "DRYRUN", "learner", *c) for c in (("EVALSHA", "0" * 40, "1", key), ("HGETALL", key))]
        checks.append(
            Check(
                "ACL DRYRUN",
                not let and all(r in (b"OK", "OK") for r in allowed),
                "refused" if not let else f"allowed: {', '.join(let)}",
                f"{len(dry) - len(let)}/{len(dry)} admin commands refused (SHUTDOWN, MONITOR, CLIENT PAUSE 3000 included); "
                "EVALSHA and HGETALL of the store allowed",
            )
        )
    for handle in (ro, rd, writer, dense):
        handle.close()
    learner.close()
    admin.execute_command("ACL", "DELUSER", "learner")
    return checks
