"""A sharded ring under faults (issue 38, item 2): pops with leases outstanding, a handle that follows a
failover within its call's deadline, deadlines kept with a node down, ``min_replicas`` pops that fail
and hand back what they took.

Everything runs on real clusters: the session's three primaries, or a private one for a node that
goes away (``EmbeddedCluster``: no replicas, cluster-node-timeout 2 s; ``replicas=1``: 5 s, so those
tests are marked slow).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import load_tool

from tdstore import AmbiguousTimeoutError, ShardedRing, ShardUnavailableError
from tdstore.cluster_server import EmbeddedCluster

faults = load_tool("faults.sharded")  # the fault tool's helpers, written once

PREFIX = "shfaults"
#: What a call given ``timeout=T`` may take beyond T on this busy machine (it bounds a hang, not a speed).
SLACK_S = 1.0


def ring(url: str, count: int = 30, **kw) -> ShardedRing:
    s = ShardedRing(count=count, url=url, prefix=PREFIX, **kw)
    assert isinstance(s, ShardedRing)
    return s


def off_layout_shard(s: ShardedRing) -> int:
    """A shard whose node does not hold the ring's layout key (so the ring can still be attached with it down)."""
    return faults.off_layout_shards(s)[0]


# -- pops with leases outstanding ---------------------------------------------------------------
def test_leased_and_plain_pops_with_leases_outstanding_hand_each_item_out_once(redis_cluster):
    """Two readers, leased and plain pops mixed, leases left outstanding (some acked, some let run out and
    redelivered): every item is handed out and settled exactly once. Before: every pop that met a shard
    with a lease outstanding raised ``IndexError`` (``ZRANGE ... WITHSCORES`` read as a flat list)."""
    s = ring(redis_cluster.url, count=300)
    total = 120
    for i in range(0, total, 4):
        s.extend(faults.tagged_rows(torch.arange(i, i + 4)))
    first = s.pop(1, lease=0.3)  # a lease outstanding from the start: it runs out and goes to another pop
    settled: list[int] = []  # tags acked or popped plainly
    errors: list[BaseException] = []
    lock = threading.Lock()

    def reader(r: int) -> None:
        h = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
        held = []  # this reader's leases left outstanding for a while
        try:
            for step in range(400):
                try:
                    got = h.pop(2, lease=30.0, timeout=1.5) if (step + r) % 2 else h.pop(2, timeout=1.5)
                except TimeoutError:
                    break
                tags = got.td["tag"].tolist()
                if hasattr(got, "receipt"):
                    held.append((got, tags))
                    if len(held) > 2:  # acked two pops later: leases stay outstanding meanwhile
                        old, old_tags = held.pop(0)
                        assert h.ack(old) == len(old_tags)
                        with lock:
                            settled.extend(old_tags)
                else:
                    with lock:
                        settled.extend(tags)
            for got, tags in held:
                assert h.ack(got) == len(tags)
                with lock:
                    settled.extend(tags)
        except BaseException as err:  # raised in the test's thread below
            errors.append(err)
        finally:
            h.close()

    threads = [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(settled) == list(range(total)), f"{len(settled)} settled, {sorted(set(range(total)) - set(settled))} missing"
    assert first.indices.numel() == 1  # its item was redelivered (it is among the settled ones) and is not popped again
    with pytest.raises(TimeoutError):
        s.pop(1, lease=1.0, timeout=0.2)
    s.clear_redis()


def test_a_pop_reads_each_shards_counters_and_leases_in_two_round_trips(redis_cluster):
    """With a lease outstanding on every shard, a pop's read of the shards' state is, per shard, one
    ``HMGET`` and one transaction (``ZCOUNT`` of the lease deadlines, ``ZCARD`` of the redelivery queue):
    replies that are integers whatever the protocol."""
    from helpers import round_trips_per_node

    s = ring(redis_cluster.url, count=30)
    for k in range(3):
        s.shards[k].extend(faults.tagged_rows(torch.arange(10 * k, 10 * k + 3)))
        s.shards[k].pop(1, lease=60.0)
    nodes = round_trips_per_node(redis_cluster, lambda: s._heads(leases=True))
    assert sorted(nodes) == [["hmget", "transaction"]] * 3, nodes
    heads = s._heads(leases=True)
    assert [h["due"] for h in heads] == [0, 0, 0] and [h["rr"] for h in heads] == [1, 1, 1]
    s.clear_redis()


# -- min_replicas: a pop that fails hands back what it took ------------------------------------
def test_a_min_replicas_pop_that_fails_hands_back_its_items_and_the_next_takes_none(redis_cluster):
    """The session's cluster has no replicas: a ``min_replicas=1`` pop runs on the primary, no replica
    acknowledges it, and it raises ``ShardUnavailableError`` "may be lost" carrying the items the primary
    handed out (``taken``), its request id and ``retry()`` (the same pop again under that id: the same
    items, still unacknowledged). The next pop on that shard asks the primary its replicas first and
    takes nothing. A plain handle then pops every other item: each item once. Before: the error carried
    nothing, and the items were gone."""
    plain = ring(redis_cluster.url, count=30, shards=1)
    plain.extend(faults.tagged_rows(torch.arange(6)))
    strict = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=plain.td_id, min_replicas=1)
    with pytest.raises(ShardUnavailableError, match="0 of min_replicas=1 replicas acknowledged it: it may be lost") as err:
        strict.pop(5, timeout=5)
    taken = err.value.taken.td["tag"].tolist()
    assert len(taken) == 5 and err.value.request_id and err.value.shard == 0
    with pytest.raises(ShardUnavailableError, match="replicas") as again:  # the resend: the same id, still no replica
        err.value.retry(timeout=5)
    assert again.value.request_id == err.value.request_id
    rr = int(plain.shards[0]._engine.command("HMGET", plain.shards[0]._engine.keys.meta, "rr")[0])
    with pytest.raises(ShardUnavailableError, match="0 of min_replicas=1 replicas connected: this call was not sent"):
        strict.pop(1, timeout=5)
    assert int(plain.shards[0]._engine.command("HMGET", plain.shards[0]._engine.keys.meta, "rr")[0]) == rr  # nothing taken
    rest = plain.pop(6, timeout=1).td["tag"].tolist()
    assert sorted(taken + rest) == list(range(6))
    strict.close()
    plain.clear_redis()


# -- a pop whose reply does not come by its deadline ------------------------------------------------
def test_a_pop_whose_reply_misses_its_deadline_is_resolvable(redis_cluster):
    """The shard's node holds writes (``CLIENT PAUSE ... WRITE``: the pop's script waits, its counters' read
    does not): ``pop(2, timeout=0.5)`` sent the script, which runs once the pause ends. It raises
    ``AmbiguousTimeoutError`` carrying its request id; ``retry()`` gets the items it took, and the next pop
    the others: each item once. Before: a plain ``TimeoutError`` "no unread item", and the items were gone."""
    s = ring(redis_cluster.url, count=30, shards=1)
    s.extend(faults.tagged_rows(torch.arange(5)))
    node = redis_cluster.node_client(faults.node_index(redis_cluster, s.shard_nodes()[0]))
    node.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    try:
        with pytest.raises(AmbiguousTimeoutError) as err:
            s.pop(2, timeout=0.5)
    finally:
        node.execute_command("CLIENT", "UNPAUSE")
        node.close()
    assert err.value.request_id
    taken = err.value.retry(timeout=5).td["tag"].tolist()
    assert taken == [0, 1]
    assert s.pop(5, timeout=1).td["tag"].tolist() == [2, 3, 4]
    s.clear_redis()


def test_an_extend_whose_reply_misses_its_deadline_retries_at_the_rings_slots(redis_cluster):
    """An extend to the second shard, whose node holds writes (``CLIENT PAUSE ... WRITE``), raises
    ``AmbiguousTimeoutError``; its ``retry()`` answers with the ring's global slots (the shard's offset
    added: before, the shard's own slots 0..2 came back) and writes the rows once, however often it is
    retried. An extend cut over both shards, one of them held, retries only the held part and answers
    for the whole call (before: a plain ``TimeoutError``, the part on the other shard's thread having
    cleared the call's mark that its command was sent)."""
    s = ring(redis_cluster.url, count=30, shards=2)
    nodes = [faults.node_index(redis_cluster, n) for n in s.shard_nodes()]
    offset = s._offsets[1]

    def held(call, shard):
        node = redis_cluster.node_client(nodes[shard])
        node.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        try:
            with pytest.raises(AmbiguousTimeoutError) as err:
                call()
        finally:
            node.execute_command("CLIENT", "UNPAUSE")
            node.close()
        return err.value

    s._next = 1
    err = held(lambda: s.extend(faults.tagged_rows(torch.arange(3)), timeout=0.5), 1)
    assert err.request_id
    first = err.retry(timeout=5)
    assert first.indices.tolist() == [offset, offset + 1, offset + 2]
    assert err.retry(timeout=5).indices.tolist() == first.indices.tolist()  # applied once
    assert s.write_count == 3 and s[offset + 2]["tag"].item() == 2
    if nodes[0] != nodes[1]:  # the cut extend: shard 0's part runs, shard 1's is held
        s._next = 0
        err = held(lambda: s.extend(faults.tagged_rows(torch.arange(100, 120)), timeout=0.5), 1)
        whole = err.retry(timeout=5)
        assert whole.indices.tolist() == list(range(15)) + list(range(offset + 3, offset + 8))
        assert err.retry(timeout=5).indices.tolist() == whole.indices.tolist()
        assert s.write_count == 23
    s.clear_redis()


# -- a node down: deadlines kept, the other shards serve -----------------------------------------
def test_deadlines_are_kept_with_a_node_down_and_the_other_shards_serve():
    """One primary killed (no replica: it stays down). ``pop(timeout=2)`` pops the items of the shards that
    are up at once, and with none left raises ``TimeoutError`` naming the shard that did not answer;
    ``extend``, ``sample`` and ``pop`` given ``timeout=2`` end by 2 s plus a small slack. Before: the pop
    raised ``ShardUnavailableError`` (the other shards' items unread) after 2.9 to 4.9 s."""
    with EmbeddedCluster() as cluster:
        s = ring(cluster.url, count=30)
        down = off_layout_shard(s)
        for k in range(3):
            s.shards[k].extend(faults.tagged_rows(torch.arange(10 * k, 10 * k + 2)))  # two items per shard
        cluster.stop_node(faults.node_index(cluster, s.shard_nodes()[down]))
        got = []
        for _ in range(4):
            got += s.pop(1, timeout=2).td["tag"].tolist()
        assert sorted(got) == sorted(t for k in range(3) if k != down for t in (10 * k, 10 * k + 1))
        for name, call in (
            ("pop", lambda: s.pop(1, timeout=2)),
            # (pinned to the down shard: placing by the counts it read, the handle would take a shard that is up)
            (
                "extend",
                lambda: (setattr(s, "_next", down), setattr(s, "_rw", [2, 2, 2]), s.extend(faults.tagged_rows(torch.arange(2)), timeout=2)),
            ),
            ("sample", lambda: s.sample(8, timeout=2)),
        ):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError) as err:
                call()
            took = time.monotonic() - t0
            assert took < 2 + SLACK_S, f"{name}(timeout=2) took {took:.2f} s"
            if name == "pop":
                assert f"shards [{down}]" in str(err.value), err.value
        w = s.extend(faults.tagged_rows(torch.arange(50, 52)), timeout=2)  # not pinned: placed on a shard that answered
        assert down not in s._locate(w.indices).tolist()
        s.close()


# -- a failover: the handle follows the slot within its call's deadline -----------------------------
@pytest.mark.slow
def test_a_handle_adopts_the_promoted_replica_within_the_calls_deadline():
    """A primary is killed (kill -9) and its replica promoted. A call made meanwhile with a deadline long
    enough (``extend(timeout=60)`` to that shard) waits and lands on the new primary; after the
    promotion the old handle's ``sample``, ``extend``, ``pop`` and ``ack`` with ``timeout=2`` succeed on
    the first try, and ``shard_nodes()`` names the new primary. Before: the old handle kept sending to
    the dead node (``sample(8, timeout=2)`` raised ``TimeoutError`` call after call)."""
    with EmbeddedCluster(replicas=1) as cluster:
        s = ring(cluster.url, count=300)
        s.extend(faults.tagged_rows(torch.arange(30)))
        down = off_layout_shard(s)
        old = s.shard_nodes()[down]
        i = faults.node_index(cluster, old)
        j = cluster.replica_of(i)
        cluster.stop_node(i)  # kill -9
        s._next = down
        w = s.extend(faults.tagged_rows(torch.arange(100, 103)), timeout=60)  # in flight until the replica is promoted
        assert set(s._locate(w.indices).tolist()) == {down} and s.shard_nodes()[down] == f"127.0.0.1:{cluster.ports[j]}"
        assert torch.equal(s[w.indices]["tag"], torch.arange(100, 103))
        fresh = ShardedRing.from_store(url=f"redis+cluster://127.0.0.1:{cluster.ports[j]}", prefix=PREFIX, td_id=s.td_id)
        assert fresh.shard_nodes() == s.shard_nodes()
        assert len(s.sample(8, timeout=2).indices) == 8
        s._next = down
        s.extend(faults.tagged_rows(torch.arange(200, 202)), timeout=2)
        s._pop_next = down
        got = s.pop(2, lease=30.0, timeout=2)
        assert s.ack(got, timeout=2) == 2
        s.close()
