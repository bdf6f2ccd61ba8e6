"""Spread stores: one store's segments on every primary of a Redis Cluster (``spread=True``).

The behavioural suite also runs on spread stores cut into 64-byte segments
(``test_segmented_suite.py``); these tests add what only a spread store has: where
its keys live, the per-segment guards, one pipeline per node, the schema lock and
its rollback, a store larger than one node's memory, and a node that goes away.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import redis
import torch
from conftest import ClusterBackend
from helpers import consistent, pttls, stamp_writer, stamped, torn_while_running
from redis.client import Pipeline
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._engine import scripts as _scripts
from tdstore._engine import spread as _spread
from tdstore._engine import spread_change as _spread_change
from tdstore._format.keys import StoreKeys
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import commandstats

PREFIX = "spread"


def spread_store(cluster: EmbeddedCluster, n: int = 30, **kw) -> LazyStackedTensorDictStore:
    # 8 float32 + a row of int64 per element: 128-byte segments hold one or two elements
    return LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([stamped(i) for i in range(n)]), url=cluster.url, prefix=PREFIX, spread=True, segment_bytes=128, **kw
    )


def keys_per_node(cluster: EmbeddedCluster, td_id: str) -> list[list[bytes]]:
    out = []
    for i in range(len(cluster.ports)):
        node = cluster.node_client(i)
        out.append(sorted(node.keys(f"{PREFIX}:{{{td_id}*")))
        node.close()
    return out


def guard_versions(cluster: EmbeddedCluster, s: LazyStackedTensorDictStore) -> set[int]:
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    h = s._engine.header
    versions = {int(client.hget(s._engine.keys.guard(k), "version")) for k in range(1, h.segments.n)}
    client.close()
    return versions


def one_deadline(cluster: EmbeddedCluster, s: LazyStackedTensorDictStore, slack_ms: int = 0) -> list[int]:
    """Each key's time to live as of one instant (``test_lifecycle.pttls``), asserted to be one deadline for
    every key, however long the reads across the nodes take: the same number, or within ``slack_ms``."""
    backend = ClusterBackend(cluster)
    backend.prefix = PREFIX
    ttls = pttls(backend, s)
    assert ttls and max(ttls.values()) - min(ttls.values()) <= slack_ms, ttls
    return list(ttls.values())


def test_a_spread_store_puts_its_segments_on_every_primary(redis_cluster):
    s = spread_store(redis_cluster)
    h = s._engine.header
    assert h.spread and h.segments.n > 3
    per_node = keys_per_node(redis_cluster, s.td_id)
    assert all(per_node), f"a primary holds none of the store's keys: {[len(k) for k in per_node]}"
    # every segment k > 0 has its guard, at the header's version and epoch
    assert guard_versions(redis_cluster, s) == {h.version}
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
    assert other._engine.keys.segment_tags and all(consistent(other[i].to_tensordict()) for i in range(30))
    assert [int(v) for v in other[torch.tensor([29, 3, 17, 3])]["stamp"]] == [29, 3, 17, 3]
    assert s.clear_redis() == sum(len(k) for k in per_node)
    assert not any(keys_per_node(redis_cluster, s.td_id))


def test_a_spread_store_opens_on_one_server_as_any_other_store(redis_server):
    s = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([stamped(i) for i in range(6)]), url=redis_server.url, prefix=PREFIX, spread=True, segment_bytes=128
    )
    assert not s._engine.header.spread  # one server: every segment is reached by one script already
    assert all(consistent(s[i].to_tensordict()) for i in range(6))
    s.clear_redis()


class _CountPipelines:
    """Pipelines executed per node port while the block runs."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self._orig = Pipeline.execute

    def __enter__(self) -> _CountPipelines:
        counter = self

        def execute(pipe, *args, **kwargs):
            counter.ports.append(pipe.connection_pool.connection_kwargs.get("port"))
            return counter._orig(pipe, *args, **kwargs)

        Pipeline.execute = execute
        return self

    def __exit__(self, *exc) -> None:
        Pipeline.execute = self._orig


def test_a_call_over_many_segments_is_one_pipeline_per_node(redis_cluster):
    s = spread_store(redis_cluster)
    s[:] = s.to_tensordict()  # every node has loaded the scripts (a NOSCRIPT costs one more pipeline)
    nodes = [redis_cluster.node_client(i) for i in range(3)]
    for node in nodes:
        node.config_resetstat()
    n = s._engine.header.segments.n
    with _CountPipelines() as count:
        whole = s.to_tensordict()  # every segment, a heterogeneous key: a read.lua call per segment
    assert sorted(count.ports) == sorted(redis_cluster.ports)  # one pipeline on each node, no more
    calls = [commandstats(node).get("evalsha", 0) for node in nodes]
    assert sum(calls) == n and all(calls)
    assert all(consistent(whole[i]) for i in range(30))
    for node in nodes:
        node.config_resetstat()
    with _CountPipelines() as count:
        obs = s["obs"]  # homogeneous: a read transaction (MULTI/EXEC) per segment
    assert sorted(count.ports) == sorted(redis_cluster.ports)
    assert sum(commandstats(node).get("exec", 0) for node in nodes) == n
    assert torch.equal(obs, whole["obs"])
    for node in nodes:
        node.config_resetstat()
    with _CountPipelines() as count:
        s[:] = lazy_stack([stamped(100 + i) for i in range(30)])  # a write over every segment: a script per segment
    assert sorted(count.ports) == sorted(redis_cluster.ports)
    assert sum(commandstats(node).get("evalsha", 0) for node in nodes) == s._engine.header.segments.n
    assert all(consistent(s[i].to_tensordict()) and int(s[i]["stamp"]) == 100 + i for i in range(30))
    s.clear_redis()


def test_an_element_call_is_one_script_on_the_node_of_its_segment(redis_cluster):
    s = spread_store(redis_cluster)
    seg = s._engine.header.segments.of(20)
    nodes = [redis_cluster.node_client(i) for i in range(3)]
    owner = [i for i in range(3) if nodes[i].keys(s._engine.keys.guard(seg))]
    s[20] = stamped(219)  # the node loads the scripts (a NOSCRIPT retry would count twice), whatever ran before
    s[20].to_tensordict()
    for node in nodes:
        node.config_resetstat()
    s[20] = stamped(220)
    got = s[20].to_tensordict()
    stats = [commandstats(node) for node in nodes]
    assert [st.get("evalsha", 0) for st in stats] == [2 if i == owner[0] else 0 for i in range(3)]
    assert consistent(got) and int(got["stamp"]) == 220
    s.clear_redis()


def test_schema_changes_reach_every_segment(redis_cluster):
    s = spread_store(redis_cluster)
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
    s.set("extra", torch.arange(30.0).reshape(30, 1))  # a new key: a blob per segment
    assert torch.equal(s["extra"], torch.arange(30.0).reshape(30, 1))
    s.set("extra", torch.arange(30, dtype=torch.int64))  # another dtype: a new leaf, the old one's keys go
    s.rename_key_("extra", "renamed")
    s[4] = stamped(4).set("renamed", torch.tensor(7))
    other[5] = stamped(55)  # a stale header, but these keys did not change: the guards let it through
    s[6] = stamped(6).set("renamed", torch.tensor(9)).set("obs", torch.full((3,), 6.0))  # obs becomes heterogeneous, copy-on-write
    assert s._engine.header.leaves[("obs",)].het
    assert [int(v) for v in s["renamed"][3:7]] == [3, 7, 5, 9] and consistent(s[5].to_tensordict())
    # obs moved to a new leaf number: the guards refuse the other handle's stale plan, it refreshes
    assert other[6]["obs"].tolist() == [6.0] * 3 and other[7]["obs"].tolist() == [7.0] * 8
    s.del_("renamed")
    h = s._engine.header
    assert guard_versions(redis_cluster, s) == {h.version}
    # nothing is left of the replaced, converted or deleted leaves, on any node
    live = {leaf.number for leaf in h.leaves.values()} | ({h.row[0]} if h.row else set())
    for keys in keys_per_node(redis_cluster, s.td_id):
        numbers = {int(k.rsplit(b":", 1)[1]) for k in keys if k.split(b":")[-2] in (b"d", b"o", b"s")}
        assert numbers <= live, f"keys of dead leaves {numbers - live} remain"
    assert all(consistent(other[i].to_tensordict()) for i in (0, 9, 29))
    s.clear_redis()


def test_concurrent_schema_changes_take_turns(redis_cluster):
    s = spread_store(redis_cluster)
    errors: list[BaseException] = []

    def add(tag: str) -> None:
        h = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
        try:
            for i in range(4):
                h.set(f"{tag}{i}", torch.full((30, 2), float(i)))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=add, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    fresh = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
    for tag in "ab":
        for i in range(4):
            assert torch.equal(fresh[f"{tag}{i}"], torch.full((30, 2), float(i)))
    assert guard_versions(redis_cluster, fresh) == {fresh._engine.header.version}
    s.clear_redis()


def _dead_keys(cluster: EmbeddedCluster, s: LazyStackedTensorDictStore) -> set[int]:
    """Leaf numbers that keys of the store still use on the server but its header does not."""
    h = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=cluster.url, prefix=PREFIX)._engine.header
    live = {leaf.number for leaf in h.leaves.values()} | ({h.row[0]} if h.row else set())
    numbers = {
        int(k.rsplit(b":", 1)[1]) for keys in keys_per_node(cluster, s.td_id) for k in keys if k.split(b":")[-2] in (b"d", b"o", b"s")
    }
    return numbers - live


CHANGES = {
    # a new key on every segment
    "add a key": lambda s: s.set("half", torch.ones(30, 3)),
    # obs turns heterogeneous (copied to a new leaf number) while tokens and stamp are written in place
    "an element write that changes a key's layout": lambda s: s.__setitem__(6, stamped(106).set("obs", torch.full((3,), 106.0))),
    # obs gets another dtype (a new leaf) in the same call that writes tokens and stamp of every element
    "a key retyped with others written": lambda s: s.update(
        {"obs": torch.zeros(30, 8, dtype=torch.float64), "stamp": torch.full((30,), -1)}
    ),
}


@pytest.mark.parametrize("die", [True, False], ids=["the changer dies", "the commit fails"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_schema_change_cut_short_leaves_the_store_as_it_was(redis_cluster, monkeypatch, change, die):
    s = spread_store(redis_cluster)
    before = s._engine.header
    monkeypatch.setattr(_spread, "LEASE_MS", 300)
    real_call = _scripts.call

    def fail_at_commit(client, name, keys, args, execute=None):
        if name == "write" and "@" in str(args[0]):
            raise SystemExit("the changer dies between prepare and commit") if die else redis.ConnectionError("the header's node went away")
        return real_call(client, name, keys, args, execute)

    monkeypatch.setattr(_scripts, "call", fail_at_commit)
    if die:
        monkeypatch.setattr(_spread_change, "_abort", lambda *a, **k: None)  # a dead process cleans nothing up
    with pytest.raises((SystemExit, redis.ConnectionError)):
        CHANGES[change](s)
    monkeypatch.undo()
    if die:
        # every guard moved ahead, the header did not: the old schema's clients are held off...
        assert guard_versions(redis_cluster, s) == {before.version + 1}
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
    t0 = time.monotonic()
    # ...until the lease runs out: then the next call rolls the guards back and goes on
    got = other.to_tensordict()
    # the 0.3 s lease, not the most a call waits for a lease (LEASE_MS / 1000 + 5 = 35 s): a generous
    # bound, since a busy machine may take seconds
    assert time.monotonic() - t0 < 25
    # nothing of the change shows: every element whole and as it was, no key of the change left
    assert set(got.keys()) == {"obs", "tokens", "stamp"} and [int(v) for v in got["stamp"]] == list(range(30))
    assert all(consistent(got[i]) for i in range(30))
    assert guard_versions(redis_cluster, s) == {before.version}
    assert not _dead_keys(redis_cluster, s)
    CHANGES[change](other)  # the store takes the change now
    assert not _dead_keys(redis_cluster, s) and guard_versions(redis_cluster, s) == {other._engine.header.version}
    s.clear_redis()


def test_a_segment_whose_guard_is_gone_fails_fast(redis_cluster):
    s = spread_store(redis_cluster)
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    seg = s._engine.header.segments.of(20)
    client.delete(s._engine.keys.guard(seg))  # as a delete cut short would leave it
    client.close()
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="lost its guard"):
        s[20].to_tensordict()
    with pytest.raises(KeyError, match="lost its guard"):
        s["obs"]
    assert time.monotonic() - t0 < 20  # not waiting as for a lease (LEASE_MS / 1000 + 5 = 35 s)
    assert s.clear_redis() > 0 and not any(keys_per_node(redis_cluster, s.td_id))


def test_ring_calls_are_refused_with_a_clear_error(redis_cluster):
    s = LazyStackedTensorDictStore(count=8, url=redis_cluster.url, prefix=PREFIX, spread=True, shards=0)  # segments, not shards
    with pytest.raises(NotImplementedError, match="spread over several cluster nodes"):
        s.extend(lazy_stack([stamped(1)]))
    s.clear_redis()


def test_dense_spread_store_and_its_clone(redis_cluster):
    td = TensorDict(x=torch.randn(40, 6), y=torch.arange(40), batch_size=[40])
    s = TensorDictStore.from_tensordict(td, url=redis_cluster.url, prefix=PREFIX, spread=True, segment_bytes=64)
    assert s._store._engine.header.spread and s._store._engine.header.segments.n > 3
    c = s.clone()  # read whole, uploaded spread under another id
    assert c._store._engine.header.spread and torch.equal(c["x"], td["x"]) and torch.equal(c[7:33]["y"], td[7:33]["y"])
    s[3] = TensorDict(x=torch.zeros(6), y=torch.tensor(-1), batch_size=[])
    assert torch.equal(s[3]["x"], torch.zeros(6)) and int(c[3]["y"]) == 3
    s.expire(600)  # read back within a tenth of it: a busy machine never runs out the window
    assert 540 < s.ttl() <= 600
    s.clear_redis()
    c.clear_redis()


def test_cli_shows_and_removes_a_spread_store(redis_cluster, capsys):
    from tdstore.cli import main

    s = spread_store(redis_cluster)
    assert main(["info", s.td_id, "--url", redis_cluster.url, "--prefix", PREFIX]) == 0
    assert "spread over the cluster's nodes" in capsys.readouterr().out
    assert main(["rm", s.td_id, "--yes", "--url", redis_cluster.url, "--prefix", PREFIX]) == 0
    assert not any(keys_per_node(redis_cluster, s.td_id))


def _schema_racer(url: str, td_id: str, seconds: float) -> None:
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=PREFIX)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        store.set("extra", torch.zeros(30, 2))
        store.del_("extra")


@pytest.mark.slow
def test_element_writes_stay_atomic_while_the_schema_changes(redis_cluster):
    s = spread_store(redis_cluster)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=stamp_writer, args=(redis_cluster.url, PREFIX, s.td_id, w + 1, 2.0, 30)) for w in range(2)]
    procs.append(ctx.Process(target=_schema_racer, args=(redis_cluster.url, s.td_id, 2.0)))
    reads, torn = torn_while_running(s, procs, [0, 7, 15, 29])
    assert reads > 0 and torn == 0
    assert all(consistent(s[i].to_tensordict()) for i in range(30))
    assert guard_versions(redis_cluster, s) == {s._engine.header.version}
    s.clear_redis()


def _balanced_id(cluster: EmbeddedCluster, segments: int) -> str:
    """A td_id whose segments' hash tags fall on the three primaries about evenly (at most 7 of 18)."""
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        for i in range(1000):
            keys = StoreKeys(PREFIX, f"big{i}")
            ports = [client.get_node_from_key(keys.guard(k)).port for k in range(segments)]
            if max(ports.count(p) for p in cluster.ports) <= 7:
                return f"big{i}"
    finally:
        client.close()
    raise AssertionError("no balanced td_id found")


@pytest.mark.slow
def test_a_spread_store_outgrows_one_node():
    # three primaries of 24 MiB each: a 36 MiB store (18 segments of 2 MiB) fits only spread over all three
    with EmbeddedCluster(extra_args=("--maxmemory", "24mb", "--maxmemory-policy", "noeviction")) as cluster:
        x = torch.randint(0, 255, (36, 1 << 20), dtype=torch.uint8)
        big = lazy_stack([TensorDict(x=row) for row in x])
        td_id = _balanced_id(cluster, 18)
        with pytest.raises(MemoryError):
            LazyStackedTensorDictStore.from_lazy_stack(
                big, url=cluster.url, prefix=PREFIX, td_id=td_id, segment_bytes=2 << 20, chunk_bytes=2 << 20
            )
        s = LazyStackedTensorDictStore.from_lazy_stack(
            big, url=cluster.url, prefix=PREFIX, td_id=td_id, spread=True, segment_bytes=2 << 20, chunk_bytes=2 << 20
        )
        assert s._engine.header.segments.n == 18
        assert torch.equal(s["x"], x)
        used = [cluster.node_client(i).info("memory")["used_memory"] for i in range(3)]
        assert all(u > 6 << 20 for u in used), used


@pytest.mark.slow
def test_a_node_that_goes_down_fails_only_the_calls_that_need_it():
    with EmbeddedCluster(extra_args=("--appendonly", "yes", "--appendfsync", "always")) as cluster:
        s = spread_store(cluster)
        keys = s._engine.keys
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        header_port = client.get_node_from_key(keys.meta).port
        segs = s._engine.header.segments
        down = next(i for i, p in enumerate(cluster.ports) if p != header_port)
        on_down = [e for e in range(30) if client.get_node_from_key(keys.guard(segs.of(e))).port == cluster.ports[down] and segs.of(e)]
        elsewhere = [e for e in range(30) if client.get_node_from_key(keys.guard(segs.of(e))).port != cluster.ports[down]]
        client.close()
        s[on_down[0]] = stamped(500)  # acknowledged before the node goes down
        cluster.stop_node(down)
        with pytest.raises(redis.ConnectionError, match=f"td_id '{s.td_id}'"):
            s[on_down[1]] = stamped(501)
        s[elsewhere[0]] = stamped(502)  # segments on the other primaries keep working
        assert int(s[elsewhere[0]]["stamp"]) == 502
        cluster.start_node(down)
        deadline = time.monotonic() + 60  # a limit on a hang only
        while True:
            try:
                got = s[on_down[0]].to_tensordict()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert int(got["stamp"]) == 500 and consistent(got)
        s[on_down[1]] = stamped(501)
        assert all(consistent(t) for t in s.to_tensordict().unbind(0))


def test_keys_a_schema_change_adds_take_the_stores_deadline(redis_cluster):
    s = LazyStackedTensorDictStore(count=30, url=redis_cluster.url, prefix=PREFIX, spread=True, shards=0, segment_bytes=128, ttl=600)
    s.set("obs", torch.zeros(30, 8))  # the first keys: the segments and their guards are made
    s.set("more", torch.ones(30, 4))
    # the deadline of the keys a schema change adds is the header's time to live read, then the node's
    # clock read (_engine.spread.deadline): a round trip apart, so up to that much later than the store's
    ttls = one_deadline(redis_cluster, s, slack_ms=1_000)
    assert len(ttls) > 2 * s._engine.header.segments.n
    # the store's deadline: read within a tenth of the time to live, so a busy machine never runs out the window
    assert 540_000 < ttls[0] <= 600_000, ttls
    s.clear_redis()


def test_a_commit_whose_reply_is_lost_counts_as_done(redis_cluster, monkeypatch):
    s = spread_store(redis_cluster)
    real_call = _scripts.call

    def lose_the_reply(client, name, keys, args, execute=None):
        out = real_call(client, name, keys, args, execute)
        if name == "write" and "@" in str(args[0]):
            raise redis.ConnectionError("the commit ran, its reply was lost")
        return out

    monkeypatch.setattr(_scripts, "call", lose_the_reply)
    s.set("half", torch.ones(30, 3))  # the header says the commit ran: the change stands
    monkeypatch.undo()
    fresh = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)
    assert torch.equal(fresh["half"], torch.ones(30, 3))
    assert guard_versions(redis_cluster, s) == {fresh._engine.header.version} and not _dead_keys(redis_cluster, s)
    s.clear_redis()


def test_an_element_write_beside_a_key_changing_layout_is_all_or_nothing(redis_cluster, monkeypatch):
    # 'wide' has its own blob (too wide for the row block): its element write names the element's segment
    local = lazy_stack([TensorDict(wide=torch.full((1100,), float(i)), small=torch.full((2,), float(i))) for i in range(12)])
    s = LazyStackedTensorDictStore.from_lazy_stack(local, url=redis_cluster.url, prefix=PREFIX, spread=True, segment_bytes=8 << 10)
    assert s._engine.header.segments.of(9) > 0
    real_call = _scripts.call

    def fail_at_commit(client, name, keys, args, execute=None):
        if name == "write" and "@" in str(args[0]):
            raise SystemExit("the changer dies between prepare and commit")
        return real_call(client, name, keys, args, execute)

    monkeypatch.setattr(_spread, "LEASE_MS", 300)
    monkeypatch.setattr(_scripts, "call", fail_at_commit)
    monkeypatch.setattr(_spread_change, "_abort", lambda *a, **k: None)
    with pytest.raises(SystemExit):
        s[9] = TensorDict(wide=torch.full((1100,), 99.0), small=torch.full((3,), 99.0))  # small turns heterogeneous
    monkeypatch.undo()
    got = LazyStackedTensorDictStore.from_store(td_id=s.td_id, url=redis_cluster.url, prefix=PREFIX)[9].to_tensordict()
    assert bool((got["wide"] == 9.0).all()) and got["small"].tolist() == [9.0, 9.0]  # neither key was written
    assert not _dead_keys(redis_cluster, s)
    s[9] = TensorDict(wide=torch.full((1100,), 99.0), small=torch.full((3,), 99.0))
    got = s[9].to_tensordict()
    assert bool((got["wide"] == 99.0).all()) and got["small"].tolist() == [99.0] * 3
    s.clear_redis()


def test_delete_and_expiry_wait_for_a_schema_change_in_flight(redis_cluster):
    s = spread_store(redis_cluster)
    h = s._engine.header
    # another client holds the schema lock for 0.5 s (a change under way, or one whose holder died);
    # the lease starts after t0, so at least 0.5 s pass before expire() can take the lock over
    t0 = time.monotonic()
    _scripts.call(
        s._engine.client,
        "lock",
        [s._engine.keys.meta],
        ["acquire", f"{h.epoch}:V{h.version}", "42", 500, h.next_leaf, h.segments.n, 0, "0"],
    )
    s.expire(600)
    # waited for the lease, then took the lock over (and let it go); not the most a call waits for a
    # lease (LEASE_MS / 1000 + 5 = 35 s): a generous bound, since a busy machine may take seconds
    assert 0.45 < time.monotonic() - t0 < 25
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    assert client.hget(s._engine.keys.meta, "lk") is None
    client.close()
    ttls = one_deadline(redis_cluster, s)
    assert len(ttls) > 2 * s._engine.header.segments.n and 540_000 < ttls[0] <= 600_000, ttls
    h = s._engine.header
    _scripts.call(
        s._engine.client,
        "lock",
        [s._engine.keys.meta],
        ["acquire", f"{h.epoch}:V{h.version}", "43", 500, h.next_leaf, h.segments.n, 0, "0"],
    )
    assert s.clear_redis() > 0 and not any(keys_per_node(redis_cluster, s.td_id))


def test_a_first_change_rolled_back_leaves_no_guard_behind(redis_cluster, monkeypatch):
    s = LazyStackedTensorDictStore(count=30, url=redis_cluster.url, prefix=PREFIX, spread=True, shards=0, segment_bytes=128, ttl=600)
    real_call = _scripts.call

    def fail_at_commit(client, name, keys, args, execute=None):
        if name == "write" and "@" in str(args[0]):
            raise redis.ResponseError("the commit is refused")
        return real_call(client, name, keys, args, execute)

    monkeypatch.setattr(_scripts, "call", fail_at_commit)
    with pytest.raises(redis.ResponseError):
        s.set("obs", torch.zeros(30, 8))  # the first keys: guards are made, then rolled back
    monkeypatch.undo()
    assert [len(k) for k in keys_per_node(redis_cluster, s.td_id)] != [] and sum(
        len(k) for k in keys_per_node(redis_cluster, s.td_id)
    ) == 1  # the header only
    s.expire(3600)
    s.set("obs", torch.zeros(30, 8))
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    ttls = [client.pttl(k) for keys in keys_per_node(redis_cluster, s.td_id) for k in keys]
    client.close()
    assert len(ttls) > 1 and all(3_500_000 < t <= 3_600_000 for t in ttls), ttls
    s.clear_redis()


def test_a_node_that_answers_moved_hands_its_calls_to_the_cluster_client(redis_cluster):
    """A map that went stale (a resharding, a failover): every node the client picks answers MOVED.
    Each node's pipeline of a multi-segment call then goes through RedisCluster, which follows the
    redirect: the call succeeds, never hands the redirect to the user as the call's error."""
    s = spread_store(redis_cluster)
    client = s._engine.cluster
    cache = client.nodes_manager.slots_cache
    primaries = sorted({nodes[0].name for nodes in cache.values()})
    by_name = {nodes[0].name: nodes[0] for nodes in cache.values()}
    wrong = {name: by_name[primaries[(i + 1) % len(primaries)]] for i, name in enumerate(primaries)}
    for slot, nodes in cache.items():
        cache[slot] = [wrong[nodes[0].name], *nodes[1:]]  # every slot served, as the client thinks, by another node
    s[torch.arange(30)] = lazy_stack([stamped(100 + i) for i in range(30)])  # segments on every node: call_many
    assert [int(v) for v in s[torch.tensor([29, 3, 17])]["stamp"]] == [129, 103, 117]
    assert all(consistent(s[i].to_tensordict()) for i in range(30))
    s.clear_redis()
