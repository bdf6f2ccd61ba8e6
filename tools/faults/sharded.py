"""Fault case ``sharded-failover``: a sharded ring on a private cluster of three primaries with one replica each.

In order, on one ring (shard ``A`` failed over, shard ``C`` taken down for good; neither holds the ring's
layout key):

1. leased and plain pops by two readers with leases outstanding (acked late, one let run out): every
   item settled exactly once, no error;
2. ``A``'s primary killed (kill -9): an ``extend(timeout=60)`` sent to ``A`` meanwhile lands on the
   promoted replica; then the old handle's ``sample``, ``extend``, ``pop`` and ``ack`` (``timeout=2``)
   succeed on the first try and ``shard_nodes()`` names the new primary;
3. ``min_replicas=1`` pops on ``A``, whose new primary has no replica: the first raises "may be lost"
   with the items it took (``taken``) and ``retry()``; the next takes nothing; once the killed node is
   back as the replica, ``retry()`` returns exactly the items taken;
4. ``C``'s replica and primary killed: ``pop(timeout=2)`` serves the other shards' items, then
   ``pop``, ``extend`` and ``sample`` with ``timeout=2`` raise ``TimeoutError`` by 2 s plus a slack.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import ShardedRing, ShardUnavailableError
from tdstore.cluster_server import EmbeddedCluster
from tools.faults.base import Check, Env, describe_exc

#: What a call given ``timeout=2`` may take beyond 2 s (it bounds a hang, not a speed: a busy machine).
SLACK_S = 1.0


def tagged_rows(tags: torch.Tensor) -> TensorDict:
    """Rows carrying their tag in every key (``tag``, and ``obs`` filled with it): an item lost or handed out twice shows."""
    n = tags.numel()
    return TensorDict(tag=tags, obs=tags.double().unsqueeze(-1).expand(n, 3).clone(), batch_size=[n])


def node_index(cluster: EmbeddedCluster, node: str) -> int:
    """The index in ``cluster.servers`` of ``node`` (``host:port``, as ``ShardedRing.shard_nodes`` names it)."""
    return cluster.ports.index(int(node.rsplit(":", 1)[1]))


def off_layout_shards(s: ShardedRing) -> list[int]:
    """The shards whose node does not hold the ring's layout key (the ring can still be attached with one down)."""
    layout_node = s._client.get_node_from_key(s._keys.shards).name
    return [k for k, node in enumerate(s.shard_nodes()) if node != layout_node]


def _index(env: Env, node: str) -> int:
    assert env.cluster is not None
    return node_index(env.cluster, node)


def case_sharded_failover(env: Env) -> list[Check]:
    """The four parts above, each a check (see the module docstring)."""
    cluster = env.cluster
    assert cluster is not None, "sharded-failover runs on a private cluster"
    s = ShardedRing(count=600, url=env.url, prefix=env.prefix)
    assert isinstance(s, ShardedRing)
    a, c = off_layout_shards(s)[:2]
    killed = _index(env, s.shard_nodes()[a])
    checks = [_leased_pops(env, s)]
    checks.append(_failover(env, s, a))
    checks.append(_min_replicas(env, s, a, killed))
    checks.append(_node_down(env, s, c))
    s.close()
    return checks


def _leased_pops(env: Env, s: ShardedRing) -> Check:
    total = 60 if env.opts.quick else 240
    for i in range(0, total, 4):
        s.extend(tagged_rows(torch.arange(i, i + 4)))
    s.pop(1, lease=0.3)  # left to run out: redelivered to a reader
    settled: list[int] = []
    errors: list[str] = []
    pops = [0]
    lock = threading.Lock()

    def reader(r: int) -> None:
        h = ShardedRing.from_store(url=env.url, prefix=env.prefix, td_id=s.td_id)
        held: list[tuple[Any, list[int]]] = []
        try:
            for step in range(10 * total):
                try:
                    got = h.pop(2, lease=30.0, timeout=1.5) if (step + r) % 2 else h.pop(2, timeout=1.5)
                except TimeoutError:
                    break
                tags = got.td["tag"].tolist()
                with lock:
                    pops[0] += 1
                if hasattr(got, "receipt"):
                    held.append((got, tags))
                    if len(held) > 2:
                        old, old_tags = held.pop(0)
                        h.ack(old)
                        with lock:
                            settled.extend(old_tags)
                else:
                    with lock:
                        settled.extend(tags)
            for got, tags in held:
                h.ack(got)
                with lock:
                    settled.extend(tags)
        except Exception as exc:  # what the user saw
            errors.append(describe_exc(exc))
        finally:
            h.close()

    threads = [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    once = sorted(settled) == list(range(total))
    return Check(
        "leased pops, leases outstanding",
        once and not errors,
        f"{pops[0]} pops by 2 readers (leased and plain, leases acked late, one run out): {errors[0] if errors else 'no error'}",
        f"{len(settled)} items settled, {len(set(settled))} distinct, of {total} written: each once"
        if once
        else f"settled {len(settled)} of {total}",
    )


def _failover(env: Env, s: ShardedRing, a: int) -> Check:
    cluster = env.cluster
    assert cluster is not None
    old = s.shard_nodes()[a]
    i = _index(env, old)
    j = cluster.replica_of(i)
    s._pop_next = a
    while True:  # shard a's unread items popped: what follows pops what it writes
        try:
            s.pop(100, timeout=0.2)
        except TimeoutError:
            break
    cluster.stop_node(i)  # kill -9
    t0 = time.monotonic()
    steps: list[str] = []
    try:
        s._next = a
        w = s.extend(tagged_rows(torch.arange(10_000, 10_003)), timeout=60)
        steps.append(f"extend in flight landed after {time.monotonic() - t0:.1f} s")
        assert s.shard_nodes()[a] == f"127.0.0.1:{cluster.ports[j]}", f"shard_nodes() names {s.shard_nodes()[a]}"
        for name, call in (
            ("sample", lambda: s.sample(8, timeout=2)),
            ("extend", lambda: (setattr(s, "_next", a), s.extend(tagged_rows(torch.arange(10_003, 10_005)), timeout=2))),
            ("pop+ack", lambda: (setattr(s, "_pop_next", a), s.ack(s.pop(5, lease=30.0, timeout=2), timeout=2))),
        ):
            t = time.monotonic()
            call()
            steps.append(f"{name} {time.monotonic() - t:.2f} s")
        back = s[w.indices]["tag"].tolist()
        ok = back == [10_000, 10_001, 10_002]
        return Check(
            "kill -9 failover",
            ok,
            "old handle: " + ", ".join(steps) + " (timeout=2 each, first try)",
            f"the write in flight reads back from the new primary {s.shard_nodes()[a]}" if ok else f"read back {back}",
        )
    except Exception as exc:
        return Check("kill -9 failover", False, describe_exc(exc), "; ".join(steps))


def _min_replicas(env: Env, s: ShardedRing, a: int, killed: int) -> Check:
    cluster = env.cluster
    assert cluster is not None
    up = next(p for i, p in enumerate(cluster.ports) if i != killed)  # env.url names node 0, which may be the one killed
    strict = ShardedRing.from_store(url=f"redis+cluster://127.0.0.1:{up}", prefix=env.prefix, td_id=s.td_id, min_replicas=1)
    s.shards[a].extend(tagged_rows(torch.arange(20_000, 20_006)))
    strict._pop_next = a
    try:
        try:
            strict.pop(5, timeout=5)
            return Check("min_replicas pop, no replica", False, "the pop returned with no replica to acknowledge it")
        except ShardUnavailableError as err:
            first = err
        taken = first.taken.td["tag"].tolist() if first.taken is not None else []
        try:
            strict.pop(1, timeout=5)
            took_nothing = False
        except ShardUnavailableError as err:
            took_nothing = "not sent" in str(err)
        cluster.start_node(killed)  # back, empty, as the new primary's replica, in sync
        again = first.retry(timeout=10).td["tag"].tolist()
        ok = len(taken) == 5 and again == taken and took_nothing
        return Check(
            "min_replicas pop, no replica",
            ok,
            f"ShardUnavailableError '...{_phrase(first)}'; the next pop: not sent" if took_nothing else describe_exc(first),
            f"err.taken {len(taken)} items; err.retry() once the replica was back: the same {len(again)} items",
        )
    finally:
        strict.close()


def _node_down(env: Env, s: ShardedRing, c: int) -> Check:
    cluster = env.cluster
    assert cluster is not None
    while True:  # every unread item popped, then two per shard
        try:
            s.pop(100, timeout=0.2)
        except TimeoutError:
            break
    for k in range(len(s.shards)):
        s.shards[k].extend(tagged_rows(torch.arange(30_000 + 10 * k, 30_002 + 10 * k)))
    i = _index(env, s.shard_nodes()[c])
    cluster.stop_node(cluster.replica_of(i))
    cluster.stop_node(i)
    seen: list[str] = []
    ok = True
    got: list[int] = []
    try:
        for _ in range(2 * (len(s.shards) - 1)):
            got += s.pop(1, timeout=2).td["tag"].tolist()
        ok = sorted(got) == sorted(30_000 + 10 * k + d for k in range(len(s.shards)) if k != c for d in (0, 1))
        for name, call in (
            ("pop", lambda: s.pop(1, timeout=2)),
            # pinned to the down shard (placing by the counts it reads, the handle would take one that is up)
            (
                "extend",
                lambda: (setattr(s, "_next", c), setattr(s, "_rw", [2] * len(s.shards)), s.extend(tagged_rows(torch.arange(2)), timeout=2)),
            ),
            ("sample", lambda: s.sample(8, timeout=2)),
        ):
            t0 = time.monotonic()
            try:
                call()
                seen.append(f"{name}: no error")
                ok = False
            except TimeoutError:
                took = time.monotonic() - t0
                seen.append(f"{name} TimeoutError {took:.2f} s")
                ok = ok and took < 2 + SLACK_S
    except Exception as exc:
        return Check("node down, deadlines", False, describe_exc(exc), "; ".join(seen))
    return Check(
        "node down, deadlines",
        ok,
        "timeout=2: " + ", ".join(seen),
        f"the {len(got)} items of the shards up popped while shard {c}'s node and replica were down",
    )


def _phrase(err: BaseException) -> str:
    """The part of a sharded ring's error that says what happened (without the ids and node it names)."""
    text = str(err)
    at = text.find("wrote on its primary")
    return text[at : text.find(" (the other shards", at)] if at >= 0 else text[:60]
