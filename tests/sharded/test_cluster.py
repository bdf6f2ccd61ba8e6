"""Redis Cluster: stores on a real three-primary cluster started by the tests.

The behavioural suite runs on the cluster too (the ``cluster`` parameter of the
``backend`` fixture); these tests add what only a cluster has: stores spread over
the primaries, the ways to reach one, scripts loaded per primary, atomic element
writes from concurrent processes, and a primary that goes down and comes back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import pytest
import redis
import torch
from helpers import consistent, stamp_writer, stamped, torn_while_running
from redis.cluster import RedisCluster
from redis.crc import key_slot
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, ShardedRing, TensorDictStore
from tdstore.cluster_server import SLOTS, EmbeddedCluster


def node_of(td_id: str, nodes: int = 3) -> int:
    """Which primary of an EmbeddedCluster serves the store ``td_id`` (slots are split in equal ranges)."""
    return key_slot(f"{{{td_id}}}".encode()) * nodes // SLOTS


def ids_on_every_node(stem: str, nodes: int = 3) -> dict[int, str]:
    out: dict[int, str] = {}
    i = 0
    while len(out) < nodes:
        out.setdefault(node_of(f"{stem}{i}"), f"{stem}{i}")
        i += 1
    return out


def test_stores_spread_over_every_primary(redis_cluster):
    ids = ids_on_every_node("spread")
    stores = [
        LazyStackedTensorDictStore.from_lazy_stack(
            lazy_stack([stamped(i) for i in range(20)]), url=redis_cluster.url, prefix="spread", td_id=t
        )
        for t in ids.values()
    ]
    for n, t in ids.items():
        node = redis_cluster.node_client(n)
        assert node.keys(f"spread:{{{t}}}*"), f"store {t} is not on node {n}"
    for s in stores:
        assert all(consistent(s[i].to_tensordict()) for i in range(20))
        s.clear_redis()


def test_ways_to_reach_a_cluster(redis_cluster):
    local = lazy_stack([stamped(i) for i in range(6)])
    a = LazyStackedTensorDictStore.from_lazy_stack(local, url=redis_cluster.url, prefix="reach")
    b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, cluster=True, host="127.0.0.1", port=redis_cluster.ports[1], prefix="reach")
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.ports[2])
    c = LazyStackedTensorDictStore.from_store(td_id=a.td_id, client=client, prefix="reach")
    d = pickle.loads(pickle.dumps(a))  # reconnects through the cluster in another process too
    b[2] = stamped(77)
    assert int(c[2]["stamp"]) == 77 and int(d[2]["stamp"]) == 77
    assert "redis+cluster://" in repr(a._engine.where())
    a.clear_redis()
    client.close()


def test_dense_store_and_clone_on_a_cluster(redis_cluster):
    td = TensorDict(x=torch.randn(30, 5), y=torch.arange(30), batch_size=[30])
    s = TensorDictStore.from_tensordict(td, url=redis_cluster.url, prefix="dense")
    c = s.clone()  # another td_id, perhaps another node: read whole, upload
    assert c.td_id != s.td_id and torch.equal(c["x"], td["x"])
    s.clear_redis()
    c.clear_redis()


def test_scripts_reload_after_a_flush_on_every_primary(redis_cluster):
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([stamped(i) for i in range(6)]), url=redis_cluster.url, prefix="flush")
    s[1] = stamped(11)
    for n in range(3):
        redis_cluster.node_client(n).script_flush()
    s[1] = stamped(12)
    assert int(s[1]["stamp"]) == 12
    s.clear_redis()


def test_element_calls_are_one_script_call_on_the_owning_node(redis_cluster):
    td_id = ids_on_every_node("count")[1]
    s = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([stamped(i) for i in range(10)]), url=redis_cluster.url, prefix="count", td_id=td_id
    )
    s[3] = stamped(30)
    s[3].to_tensordict()
    node = redis_cluster.node_client(1)

    def evalsha() -> int:
        return node.info("commandstats")["cmdstat_evalsha"]["calls"]

    before = evalsha()
    s[4] = stamped(40)
    assert evalsha() == before + 1
    assert consistent(s[4].to_tensordict())
    assert evalsha() == before + 2
    s[0:10]  # a slice over every segment of the store: still one call
    assert evalsha() == before + 3
    s.clear_redis()


@pytest.mark.slow
def test_concurrent_element_writes_stay_atomic(redis_cluster):
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([stamped(i) for i in range(8)]), url=redis_cluster.url, prefix="atomic")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=stamp_writer, args=(redis_cluster.url, "atomic", s.td_id, w + 1, 2.0, 8)) for w in range(3)]
    reads, torn = torn_while_running(s, procs, [0, 3, 5, 7])
    assert reads > 0 and torn == 0
    assert all(consistent(s[i].to_tensordict()) for i in range(8))
    assert max(int(s[i]["stamp"]) for i in range(8)) > 1_000_000  # the writers did write
    s.clear_redis()


@pytest.mark.slow
def test_a_primary_goes_down_and_comes_back():
    # append-only files on: a primary that restarts gets back what it acknowledged
    with EmbeddedCluster(extra_args=("--appendonly", "yes", "--appendfsync", "always")) as cluster:
        ids = ids_on_every_node("down")
        stores = {
            n: LazyStackedTensorDictStore.from_lazy_stack(
                lazy_stack([stamped(i) for i in range(10)]), url=cluster.url, prefix="down", td_id=t
            )
            for n, t in ids.items()
        }
        stores[1][2] = stamped(21)  # acknowledged before the node goes down
        cluster.stop_node(1)
        with pytest.raises(redis.ConnectionError, match=f"td_id '{ids[1]}'"):
            stores[1][3] = stamped(31)
        with pytest.raises(redis.ConnectionError, match="cannot be reached"):
            stores[1][2].to_tensordict()
        # the other primaries keep serving their stores, reads and writes
        stores[0][2] = stamped(20)
        stores[2][2] = stamped(22)
        assert int(stores[0][2]["stamp"]) == 20 and int(stores[2][2]["stamp"]) == 22
        cluster.start_node(1)
        deadline = time.monotonic() + 20
        while True:
            try:
                got = stores[1][2].to_tensordict()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert int(got["stamp"]) == 21 and consistent(got)  # nothing acknowledged was lost
        stores[1][3] = stamped(31)
        assert int(stores[1][3]["stamp"]) == 31
        assert [int(stores[n][2]["stamp"]) for n in (0, 2)] == [20, 22]


def test_cli_lists_inspects_and_removes_stores_on_a_cluster(redis_cluster, capsys):
    from tdstore.cli import main

    ids = ids_on_every_node("cli")
    for t in ids.values():
        LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([stamped(i) for i in range(4)]), url=redis_cluster.url, prefix="cli", td_id=t)
    assert main(["ls", "--url", redis_cluster.url, "--prefix", "cli"]) == 0
    out = capsys.readouterr().out
    assert all(t in out for t in ids.values()) and "3 stores under prefix 'cli' on redis+cluster://" in out
    assert main(["info", ids[2], "--url", redis_cluster.url, "--prefix", "cli"]) == 0
    assert "tokens" in capsys.readouterr().out
    assert main(["rm", ids[2], "--yes", "--url", redis_cluster.url, "--prefix", "cli"]) == 0
    capsys.readouterr()
    assert not redis_cluster.node_client(2).keys(f"cli:{{{ids[2]}}}*")
    for t in (ids[0], ids[1]):
        assert main(["rm", t, "--yes", "--url", redis_cluster.url, "--prefix", "cli"]) == 0


def test_calls_go_to_the_owning_primary_and_follow_a_redirect(redis_cluster):
    ids = ids_on_every_node("route")
    s = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([stamped(i) for i in range(6)]), url=redis_cluster.url, prefix="route", td_id=ids[0]
    )
    s[1] = stamped(10)
    assert s._engine._node is not None and s._engine._node.connection_pool.connection_kwargs["port"] == redis_cluster.ports[0]
    # as after a resharding or a failover: the cached node no longer serves the slot and answers MOVED
    s._engine._node = redis.Redis(host="127.0.0.1", port=redis_cluster.ports[1])
    s[2] = stamped(20)  # RedisCluster follows the redirect; the next call looks the node up again
    assert int(s[2]["stamp"]) == 20
    assert s._engine._node.connection_pool.connection_kwargs["port"] == redis_cluster.ports[0]
    s.clear_redis()


def test_a_write_after_a_finished_failover_is_acknowledged_by_the_new_primary():
    """``min_replicas``: a failover that finished before the call leaves the handle's slot map stale. The
    write follows the old primary's redirect to the new one; the fence and ``WAIT`` go to the node that
    took it, so the write is acknowledged (it used to raise ShardUnavailableError "it may be lost", a
    MOVED from the old node, though the write had landed: a caller retrying it wrote it twice)."""
    with EmbeddedCluster(replicas=1) as cluster:
        s = ShardedRing(count=30, url=cluster.url, prefix="fo", shards=3, min_replicas=1)
        s.extend(TensorDict(tag=torch.arange(30), batch_size=[30]))
        layout_node = s._client.get_node_from_key(s._keys.shards).name
        nodes = s.shard_nodes()
        k = next(k for k, n in enumerate(nodes) if n != layout_node)  # a read of the layout would not refresh k's slot
        old = int(nodes[k].rsplit(":", 1)[1])
        new = cluster.failover(cluster.ports.index(old))  # done, the replica in sync, before the write
        first = s._offsets[k]
        s[first] = TensorDict(tag=torch.tensor(100))  # an item write on shard k, through the old primary's redirect
        s[first + 1] = TensorDict(tag=torch.tensor(101))
        assert s.shard_nodes()[k] == f"127.0.0.1:{cluster.ports[new]}"
        assert s[first]["tag"].item() == 100 and s[first + 1]["tag"].item() == 101
        s.clear_redis()
        s.close()


def test_a_sharded_pop_whose_reply_is_late_loses_no_item():
    """``pop()`` with no timeout on a sharded ring: the node of the shard it pops from stops answering for
    1.5 s just as the shard's pop is sent, longer than the 1 s a shard pop waits. The pop must still hand
    out the shard's first items (it sends the same request again, which the server answers with the items
    the first one took), and every item must go to exactly one pop."""
    with EmbeddedCluster() as cluster:
        s = ShardedRing(count=30, url=cluster.url, prefix="late", shards=3)
        s.shards[0].extend(TensorDict(tag=torch.arange(6), batch_size=[6]))  # unread items in shard 0 only
        assert s.shards[0].pop(2).indices.tolist() == [0, 1]  # and the node knows the pop's script
        port = int(s.shard_nodes()[0].rsplit(":", 1)[1])
        srv = cluster.servers[cluster.ports.index(port)]
        assert srv.pid is not None
        pid = srv.pid
        real = s.shards[0].pop_items

        def paused_then_pop(*args, **kwargs):
            s.shards[0].pop_items = real
            os.kill(pid, signal.SIGSTOP)  # the pop's script reaches the node, which runs it 1.5 s later
            threading.Timer(1.5, os.kill, (pid, signal.SIGCONT)).start()
            return real(*args, **kwargs)

        s.shards[0].pop_items = paused_then_pop
        try:
            got = s.pop(2)
        finally:
            os.kill(pid, signal.SIGCONT)
        popped = got.indices.tolist()
        while True:  # what is left unread
            try:
                popped += s.pop(2, timeout=0.5).indices.tolist()
            except TimeoutError:
                break
        assert sorted(popped) == [2, 3, 4, 5], f"the late pop returned {got.indices.tolist()}; popped in all: {popped}"
        s.clear_redis()
        s.close()
