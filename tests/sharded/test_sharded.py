"""Sharded rings: one replay buffer over every primary of a Redis Cluster (``tdstore.ShardedRing``).

A sharded ring is K one-node rings on distinct primaries plus a layout key (``tdstore._shards.ring``).
These tests run on a real cluster (the session's three primaries, or one of their own for a
buffer larger than one node and for a node that goes away): placement, the global slot
numbering, exact uniform and prioritized draws over unevenly filled shards (chi-square, seeded:
deterministic), pops that hand each item out once across shards, processes sharing the buffer.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import random
import time

import pytest
import torch
from helpers import chi2_critical, chi_square, mp_context, round_trips_per_node
from tensordict import TensorDict

import tdstore
from tdstore import LazyStackedTensorDictStore, ShardedRing, ShardedRingIdError, ShardUnavailableError, TensorDictStore
from tdstore._ring.policy_calls import PrioritizedSample
from tdstore._shards.layout import WrittenSlots
from tdstore._shards.shard_writes import place
from tdstore.cluster_server import EmbeddedCluster

PREFIX = "sharded"


def rows(tags: torch.Tensor, width: int = 4) -> TensorDict:
    """Rows whose every leaf is a function of their tag (a torn or misplaced row shows)."""
    n = tags.numel()
    return TensorDict(tag=tags, obs=tags.double().unsqueeze(-1).expand(n, width).clone(), neg=-tags, batch_size=[n])


def whole(td: TensorDict) -> bool:
    return torch.equal(td["obs"], td["tag"].double().unsqueeze(-1).expand_as(td["obs"])) and torch.equal(td["neg"], -td["tag"])


def ring(cluster: EmbeddedCluster, count: int = 30, **kw) -> ShardedRing:
    s = ShardedRing(count=count, url=cluster.url, prefix=PREFIX, **kw)
    assert isinstance(s, ShardedRing)
    return s


def keys_per_node(cluster: EmbeddedCluster, td_id: str) -> list[list[bytes]]:
    out = []
    for i in range(len(cluster.ports)):
        node = cluster.node_client(i)
        out.append(sorted(node.keys(f"{PREFIX}:{{{td_id}*")))
        node.close()
    return out


def fill(s: ShardedRing, fills: list[int]) -> None:
    """Give shard k ``fills[k]`` items (tags: the global slot), writing each shard directly."""
    for k, n in enumerate(fills):
        if n:
            off = s.shard_offsets[k]
            s.shards[k].extend(rows(torch.arange(off, off + n)))


def test_shards_on_distinct_primaries_and_one_numbering(redis_cluster):
    s = ring(redis_cluster, count=31)
    assert len(s) == s.capacity == 31 and s.shard_counts == (11, 10, 10) and s.shard_offsets == [0, 11, 21]
    assert len(set(s.shard_nodes())) == 3
    w = s.extend(rows(torch.arange(100, 130)))  # larger than a shard: cut, one piece per shard, sent at once
    assert sorted(w.indices.tolist()) == list(range(30)) or len(set(w.indices.tolist())) == 30
    assert (w.generations == 1).all() and len(s.written) == 30 and s.write_count == 30
    assert all(len(k) > 0 for k in keys_per_node(redis_cluster, s.td_id))  # keys on every primary
    # every row is where the ring said it wrote it, read by global slot
    got = s[w.indices]
    assert torch.equal(got["tag"], torch.arange(100, 130)) and whole(got)
    assert int(s[int(w.indices[7])]["tag"]) == 107
    assert torch.equal(s["tag"][w.indices], torch.arange(100, 130))
    # writes by global slot land on their shard
    s[torch.tensor([0, 30])] = rows(torch.tensor([-5, -6]))
    assert s[torch.tensor([30, 0])]["tag"].tolist() == [-6, -5]
    # attach: by the constructor with the id, by from_store, by pickling
    again = ShardedRing(count=31, url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    other = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    copy = pickle.loads(pickle.dumps(s))
    assert again.shard_ids == other.shard_ids == copy.shard_ids == s.shard_ids
    assert copy.write_count == other.write_count == 30
    with pytest.raises(ValueError, match="another layout"):
        ShardedRing(count=32, url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    assert s.clear_redis() > 0 and not any(keys_per_node(redis_cluster, s.td_id))
    with pytest.raises(KeyError):
        ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)


def test_a_class_call_returns_its_class_and_each_opener_its_kind(redis_cluster):
    """``ShardedRing(...)`` is the sharded ring; ``LazyStackedTensorDictStore(spread=True)`` on a cluster (which once
    returned one) refuses, naming it, before anything is written; ``spread="segments"`` (or the older ``spread=True,
    shards=0``) is the lazy class's spread store. A one-node opener given a sharded ring's id names its opener."""
    url = redis_cluster.url
    s = ring(redis_cluster, count=12)
    assert type(s) is ShardedRing and isinstance(s, tdstore.Ring) and not isinstance(s, LazyStackedTensorDictStore)
    for kw in ({"spread": True}, {"shards": 3}, {"sharded": True}):
        with pytest.raises(TypeError, match="tdstore.ShardedRing"):
            LazyStackedTensorDictStore(count=12, url=url, prefix=PREFIX, td_id="never-made", **kw)
    assert not any(keys_per_node(redis_cluster, "never-made"))
    for kw in ({"spread": "segments"}, {"spread": True, "shards": 0}):
        seg = LazyStackedTensorDictStore(count=12, url=url, prefix=PREFIX, **kw)
        assert type(seg) is LazyStackedTensorDictStore and seg._engine.header.spread
        seg.clear_redis()
    with pytest.raises(TypeError, match="no spread="):
        ShardedRing(count=12, url=url, prefix=PREFIX, spread=True)
    for opener in (LazyStackedTensorDictStore.from_store, TensorDictStore.from_store):
        with pytest.raises(ShardedRingIdError, match=r"ShardedRing\.from_store"):
            opener(url=url, prefix=PREFIX, td_id=s.td_id)
    opened = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=s.td_id)
    assert type(opened) is ShardedRing and opened.shard_ids == s.shard_ids
    plain = LazyStackedTensorDictStore(count=4, url=url, prefix=PREFIX)
    with pytest.raises(KeyError, match="No sharded ring"):
        ShardedRing.from_store(url=url, prefix=PREFIX, td_id=plain.td_id)
    plain.clear_redis()
    s.clear_redis()


def test_a_ring_holds_count_rows_before_one_is_overwritten_whatever_the_extend_sizes(redis_cluster):
    """Issue 39: ``count=300`` over 3 shards, ten extends of 30 then ``pop(16)`` until empty gave ``QueueOverrunError``
    (extends went whole to one shard in turn: shard 0 took 120 rows and wrapped while the ring held 270). Now an
    extend goes whole to a shard whose lap has room, else is cut over the shards (one part each, each atomic on its
    shard): 300 rows of any extend sizes fill the 300 slots, no generation 2 before then; the pops hand every row
    out once, in write order within each shard. Then a second lap overwrites each shard's oldest rows evenly."""
    s = ring(redis_cluster, count=300, shards=3)
    sizes = [30] * 10 if s.shard_counts == (100, 100, 100) else []
    assert sizes
    written: list[torch.Tensor] = []
    tag = 0
    for n in sizes:
        w = s.extend(rows(torch.arange(tag, tag + n)))
        assert (w.generations == 1).all() and torch.equal(s[w.indices]["tag"], torch.arange(tag, tag + n))
        written.append(w.indices)
        tag += n
    assert sorted(torch.cat(written).tolist()) == list(range(300))  # every slot once: nothing overwritten
    assert [st.written for st in s.shard_states()] == [100, 100, 100]
    got, order = [], {k: [] for k in range(3)}
    while True:
        try:
            p = s.pop(16, timeout=0)
        except TimeoutError:
            break
        assert p.indices.numel() <= 16 and whole(p.td)
        got += p.td["tag"].tolist()
        for i, t in zip(p.indices.tolist(), p.td["tag"].tolist()):
            order[int(s._locate(torch.tensor([i]))[0])].append(t)
    assert sorted(got) == list(range(300))  # each exactly once
    assert all(tags == sorted(tags) for tags in order.values())  # write order within a shard
    # odd sizes, the next laps: the shards stay within one lap of each other
    for i, n in enumerate([7, 150, 1, 99, 43, 300, 2]):
        s.extend(rows(torch.arange(1000 + 1000 * i, 1000 + 1000 * i + n)))
        assert lap_spread(s) <= 1, s.shard_states()
    assert not s._shared
    # a second handle: each, once it has seen the other's rows, reads the counts before its extends
    other = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    for i in range(40):
        (s if i % 2 else other).extend(rows(torch.arange(20_000 + 40 * i, 20_000 + 40 * i + 40)))
        assert lap_spread(s) <= 1, s.shard_states()
    assert s._shared and other._shared
    s.clear_redis()


def lap_spread(s: ShardedRing) -> int:
    """How many laps apart the most and the least written shards are (by their last ring write)."""
    laps = [(x.write_count - 1) // c for x, c in zip(s.shard_states(), s.shard_counts)]
    return max(laps) - min(laps)


def test_a_cut_extend_places_each_part_by_the_laps():
    """``place``: whole to the first shard in turn whose lap has room; else each shard takes what its lap holds,
    then the next lap (a shard at most its count of one call); a shard whose node did not answer gets none."""
    assert place(30, [0, 0, 0], [100, 100, 100], 1) == [(1, [(0, 30)])]
    assert place(30, [90, 90, 90], [100, 100, 100], 1) == [(1, [(0, 10)]), (2, [(10, 20)]), (0, [(20, 30)])]
    assert place(30, [90, 100, 100], [100, 100, 100], 0) == [(0, [(0, 30)])]  # its lap's 10, then the next lap's 20
    assert place(30, [90, 100, 100], [100, 100, 100], 1) == [(0, [(0, 10)]), (1, [(10, 30)])]
    assert place(250, [90, 95, 100], [100, 100, 100], 0) == [(0, [(0, 10), (15, 105)]), (1, [(10, 15), (105, 200)]), (2, [(200, 250)])]
    assert place(5, [None, 3, None], [100, 100, 100], 0) == [(1, [(0, 5)])]
    assert place(100, [0, 0, 0], [800] * 3, 2, part_rows=40) == [(2, [(0, 40)]), (0, [(40, 80)]), (1, [(80, 100)])]
    # a lap with too little room for parts of 40: larger parts, still no shard into its next lap before the others
    assert place(100, [0, 0, 790], [800] * 3, 2, part_rows=40) == [(2, [(0, 10)]), (0, [(10, 50), (90, 100)]), (1, [(50, 90)])]
    rng = random.Random(39)
    for _ in range(300):  # random shard counts and extend sizes: nothing overwritten before count, laps a lap apart
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        rw, start, total = [0] * len(counts), rng.randrange(len(counts)), 0
        for _ in range(20):
            n = rng.randint(1, sum(counts))
            plan = place(n, rw, counts, start)
            assert sorted(i for _, spans in plan for lo, hi in spans for i in range(lo, hi)) == list(range(n))
            for k, spans in plan:
                rw[k] += sum(hi - lo for lo, hi in spans)
            total += n
            assert total > sum(counts) or all(r <= c for r, c in zip(rw, counts))
            laps = [(r - 1) // c for r, c in zip(rw, counts) if r]
            assert not laps or max(laps) - min(laps) <= 1
            start = (plan[-1][0] + 1) % len(counts)


def test_150_mib_fit_on_three_64_mb_nodes_with_default_segments():
    """Issue 39's second case: 2,400 rows of 64 KiB (150 MiB) on three 64 MB ``noeviction`` primaries, default
    segments, extends of 100 rows: every extend fits (it raised MemoryError at 2,100 rows). Two causes, in
    numbers: a 4 MiB segment blob (64 rows) took 5 MiB of the server (its allocator's size class), so 800 rows
    a node needed 13 x 5 MiB = 68.2 MB > 67.1 MB; segments are now a few bytes short of 4 MiB (63 rows: 13 x
    4 MiB = 54.5 MB). And the server holds a call's arguments twice while it runs (the argument, and a query
    buffer of its size made ready for the next one): a 6.5 MB extend needed 14.7 MB free on a node holding
    52.6 MB; an extend is now cut over the shards in parts of at most a segment when their laps have room.
    A write whose data would not fit (39 MB more on nodes with about 10 MB free each) is still refused, nothing written."""
    args = ("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")
    with EmbeddedCluster(extra_args=args) as cluster:
        s = ShardedRing(count=2400, url=cluster.url, prefix="mem")
        assert s.shard_counts == (800, 800, 800)
        for lo in range(0, 2400, 100):
            w = s.extend(TensorDict(tag=torch.arange(lo, lo + 100), obs=torch.zeros(100, 1 << 14), batch_size=[100]))
            assert (w.generations == 1).all()
        assert [st.written for st in s.shard_states()] == [800, 800, 800]
        assert sorted(s["tag"].tolist()) == list(range(2400))
        other = ShardedRing(count=600, url=cluster.url, prefix="mem")  # 39 MB more, 13 MB a node: no node has that free
        with pytest.raises(MemoryError):
            other.extend(TensorDict(tag=torch.arange(600), obs=torch.zeros(600, 1 << 14), batch_size=[600]))
        assert other.write_count == 0 and s.write_count == 2400
        s.close()


def test_extends_fill_the_shards_evenly(redis_cluster):
    s = ring(redis_cluster, count=300, shards=3)
    for i in range(30):  # batches of 5 taken in turn: each shard gets 10 of them
        s.extend(rows(torch.arange(5 * i, 5 * i + 5)))
    assert [st.written for st in s.shard_states()] == [50, 50, 50]
    assert len(s.written) == 150 and set(s.written) == set(range(0, 50)) | set(range(100, 150)) | set(range(200, 250))
    tags = s[list(s.written)]["tag"]
    assert sorted(tags.tolist()) == list(range(150)) and whole(s[list(s.written)])
    s.clear_redis()


def test_more_shards_than_primaries(redis_cluster):
    s = ring(redis_cluster, count=12, shards=6)
    assert len(s.shards) == 6 and len(set(s.shard_nodes())) == 3
    w = s.extend(rows(torch.arange(12)))
    assert sorted(w.indices.tolist()) == list(range(12))
    assert whole(s[torch.arange(12)])
    s.clear_redis()


def test_uniform_draws_are_exact_over_unevenly_filled_shards(redis_cluster):
    s = ring(redis_cluster, count=60)  # 20 slots per shard
    fill(s, [20, 3, 11])  # one full shard, two partly filled
    slots = torch.tensor(list(s.written))
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(60, dtype=torch.float64)
    for _ in range(20):
        got = s.sample(1000, gen)
        assert torch.equal(got.td["tag"], got.indices) and whole(got.td)
        counts += torch.bincount(got.indices, minlength=60).double()
    expected = torch.zeros(60, dtype=torch.float64)
    expected[slots] = 1 / len(slots)
    assert chi_square(counts, expected) < chi2_critical(len(slots) - 1)
    # a seeded generator draws the same batch again
    a, b = s.sample(64, torch.Generator().manual_seed(5)), s.sample(64, torch.Generator().manual_seed(5))
    assert torch.equal(a.indices, b.indices)
    s.clear_redis()


def test_prioritized_draws_are_exact_over_unevenly_filled_shards(redis_cluster):
    s = ring(redis_cluster, count=60)
    s.enable_priorities(alpha=0.7)
    fill(s, [5, 20, 12])
    slots = torch.tensor(list(s.written))
    prio = (slots % 7).double() + (slots % 3 == 0).double() * 4  # some zeros: never drawn
    assert s.update_priority(slots, prio).all()
    weight = torch.zeros(60, dtype=torch.float64)
    weight[slots] = prio**0.7
    p = weight / weight.sum()
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(60, dtype=torch.float64)
    for _ in range(20):
        got = s.sample(1000, gen, beta=0.5)
        counts += torch.bincount(got.indices, minlength=60).double()
    assert chi_square(counts, p) < chi2_critical(int((p > 0).sum()) - 1)
    # each row's probability is the one-node ring's, and the weights divide by the smallest over every shard
    assert torch.allclose(got.probabilities, p[got.indices], rtol=1e-9)
    low = p[p > 0].min()
    assert torch.allclose(got.weights, ((p[got.indices] / low) ** -0.5).float())
    # a uniform draw of a ring with priorities, on asking
    assert set(s.sample(500, gen, prioritized=False).indices.tolist()) <= set(slots.tolist())
    s.clear_redis()


def test_prioritized_draws_stay_exact_when_the_cached_masses_are_stale(redis_cluster):
    """A sample splits on the masses the previous one saw; here every sample finds them changed by writes
    it did not see (another handle's), both ways: a shard the split gave no share now has mass (a second
    round trip draws the rows), and a shard lost its mass (its candidates are rejected)."""
    s = ring(redis_cluster, count=60)
    s.enable_priorities(alpha=1.0)
    fill(s, [20, 20, 20])
    slots = torch.arange(60)
    configs = [((slots % 5 + 1.0) * (slots >= 20)).double(), ((slots % 4 + 1.0) * (1 + 9 * (slots >= 40))).double()]
    gen = torch.Generator().manual_seed(3)
    counts = [torch.zeros(60, dtype=torch.float64) for _ in configs]
    for i in range(40):
        prio = configs[i % 2]
        for k in range(3):  # straight on the shards: the sharded handle's cached masses go stale
            s.shards[k].update_priority(torch.arange(20), prio[20 * k : 20 * k + 20])
        got = s.sample(500, gen)
        assert got.indices.numel() == 500 and torch.equal(got.td["tag"], got.indices) and whole(got.td)
        p = prio / prio.sum()
        assert torch.allclose(got.probabilities, p[got.indices], rtol=1e-9)
        counts[i % 2] += torch.bincount(got.indices, minlength=60).double()
    for prio, c in zip(configs, counts):
        p = prio / prio.sum()
        assert chi_square(c, p) < chi2_critical(int((p > 0).sum()) - 1)
    s.clear_redis()


def test_a_prioritized_sample_on_unchanged_masses_reads_none(redis_cluster, monkeypatch):
    """The masses come back with each shard's sample: while they do not change, no sample reads them (one round trip)."""
    s = ring(redis_cluster, count=30)
    s.enable_priorities(alpha=0.6)
    fill(s, [10, 10, 10])
    gen = torch.Generator().manual_seed(4)
    s.sample(64, gen)  # the first reads them
    reads = []
    real = s._mass_of
    monkeypatch.setattr(s, "_mass_of", lambda k: reads.append(k) or real(k))
    for _ in range(5):
        got = s.sample(64, gen)
        assert got.indices.numel() == 64 and torch.equal(got.td["tag"], got.indices)
    assert reads == []
    s.clear_redis()


def test_update_priority_and_update_if_check_generations_across_shards(redis_cluster):
    s = ring(redis_cluster, count=9)
    s.enable_priorities(alpha=1.0)
    w = s.extend(rows(torch.arange(9)))
    got = s.sample(32, torch.Generator().manual_seed(0))
    # a later lap overwrites one shard: the stale rows of that shard are skipped, the others applied
    k = int(s._locate(got.indices[:1])[0])
    lap = s.shards[k].extend(rows(torch.arange(100, 100 + s.shard_counts[k])))
    stale = s._locate(got.indices) == k
    assert torch.equal(s.update_priority(got.indices, 2.0, generation=got.generations), ~stale)
    applied = s.update_if(got.indices, got.generations, rows(-got.td["tag"] - 1000))
    assert torch.equal(applied, ~stale)
    assert len(lap.indices) == s.shard_counts[k] and len(w.indices) == 9
    s.clear_redis()


def test_pop_hands_out_every_item_once_across_shards(redis_cluster):
    s = ring(redis_cluster, count=30)
    for i in range(6):
        s.extend(rows(torch.arange(4 * i, 4 * i + 4)))
    seen = []
    while True:
        try:
            p = s.pop(3, timeout=0)
        except TimeoutError:
            break
        assert whole(p.td) and torch.equal(s[p.indices]["tag"], p.td["tag"])
        seen += p.td["tag"].tolist()
    assert sorted(seen) == list(range(24))
    # leased: an item not acked comes back; an acked one does not
    s.extend(rows(torch.tensor([50, 51])))
    first = s.pop(2, lease=60)
    with s.pop(2, lease=60, timeout=0) if len(first.indices) < 2 else first as got:
        assert set(got.td["tag"].tolist()) <= {50, 51}
    if got is not first:
        assert s.ack(first) == len(first.indices)
    with pytest.raises(TimeoutError):
        s.pop(1, timeout=0)
    with pytest.raises(ValueError, match="ShardReceipt"):
        s.ack("nope")
    s.clear_redis()


def test_rate_limiter_and_queue_hold_on_every_shard(redis_cluster):
    s = ring(redis_cluster, count=30)
    s.set_rate_limit(min_size=9)
    assert [sh.sampling_policy.limit.min_size for sh in s.shards] == [3, 3, 3]
    with pytest.raises(TimeoutError):
        s.sample(4, timeout=0.05)  # nothing written: no item will come
    for i in range(3):
        s.extend(rows(torch.arange(3 * i, 3 * i + 3)))
    assert len(s.sample(16).indices) == 16
    s.clear_rate_limit()
    s.set_rate_limit(min_size=3, samples_per_insert=1.0, error_buffer=6.0)
    assert [sh.sampling_policy.limit is not None for sh in s.shards] == [True] * 3
    s.set_queue(True)
    assert all(sh.sampling_policy.queue for sh in s.shards)
    s.clear_redis()


def test_an_extend_held_by_a_limiter_another_handle_cleared_goes_on(redis_cluster):
    """A handle that cached a rate limiter must see it cleared by another handle: the demo's learner
    clears it at the end of a run, and an actor polling with the stale policy used to wait forever."""
    s = ring(redis_cluster, count=30)
    s.set_rate_limit(min_size=3, samples_per_insert=1.0, error_buffer=3.0)
    for i in range(3):
        s.extend(rows(torch.arange(3 * i, 3 * i + 3)), timeout=30)  # a shard each, never sampled: every limiter holds
    actor = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    assert actor.shards[0].sampling_policy.limit is not None  # the actor caches the limiter
    with pytest.raises(TimeoutError):
        actor.extend(rows(torch.arange(3)), timeout=0.05)  # held, as it should be
    s.clear_rate_limit()
    got = actor.extend(rows(torch.arange(100, 103)), timeout=30)  # the stale policy held it until the timeout
    assert got.indices.numel() == 3
    assert all(sh.sampling_policy is None or sh.sampling_policy.limit is None for sh in actor.shards)
    s.clear_redis()


def test_pop_and_queue_mode_count_rows_written_by_index(redis_cluster):
    """A shard filled by index (``s[i] = ...``: its raw ``rw`` stays 0) is a full ring, as the scripts and the one-node
    ring count it: the sharded pop hands its rows out, and in queue mode an extend goes to the shard a pop made room
    on. The counters' read used to take the raw 0: pop saw nothing unread and an extend went to a full shard."""
    s = ring(redis_cluster, count=6)
    s[torch.arange(6)] = rows(torch.arange(6))
    s.set_queue(True)
    assert sorted(s.shards[1].pop(2, timeout=0).td["tag"].tolist()) == [2, 3]  # room on shard 1, none elsewhere
    s._next = 0  # the shard this handle would take next (and the least written, by the raw counter) is full
    w = s.extend(rows(torch.tensor([100])), timeout=0)
    assert s._locate(w.indices).tolist() == [1] and s[w.indices]["tag"].tolist() == [100]
    seen = []
    while True:
        try:
            p = s.pop(2, timeout=0)
        except TimeoutError:
            break
        assert whole(p.td) and torch.equal(s[p.indices]["tag"], p.td["tag"])
        seen += p.td["tag"].tolist()
    assert sorted(seen) == [0, 1, 4, 5, 100]
    s.clear_redis()


def test_a_handle_samples_by_the_priorities_another_handle_enabled(redis_cluster):
    """A handle opened before another enabled priorities samples by them (``prioritized=None``: the ring's policy
    decides), as a one-node ring adopts a policy changed elsewhere: the read of the shards' sizes carries their header
    version. With every shard full (no size is read), the shards' own samples tell, and the rows are drawn again
    by the masses. Such a handle used to split the rows by the shards' sizes and return a plain Sample."""
    a = ring(redis_cluster, count=30)
    b = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=a.td_id)
    b.enable_priorities(alpha=1.0)
    off = b.shard_offsets
    b.shards[1].extend(rows(torch.arange(off[1], off[1] + 10)), priority=1.0)
    b.shards[2].extend(rows(torch.arange(off[2], off[2] + 10)), priority=100.0)  # shard 0 empty
    prio = torch.zeros(30, dtype=torch.float64)
    prio[off[1] : off[1] + 10], prio[off[2] : off[2] + 10] = 1.0, 100.0
    for i in range(2):
        got = a.sample(2000, torch.Generator().manual_seed(i))
        assert isinstance(got, PrioritizedSample) and torch.equal(got.td["tag"], got.indices) and whole(got.td)
        assert torch.allclose(got.probabilities, (prio / prio.sum())[got.indices], rtol=1e-9)
        assert float((got.indices >= off[2]).double().mean()) > 0.97  # 100/101 of the mass; by size: 1/2
    a.clear_redis()
    # every shard full: a handle that saw them full reads no size before it draws
    a = ring(redis_cluster, count=6)
    fill(a, [2, 2, 2])
    c = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=a.td_id)
    assert not isinstance(c.sample(8, torch.Generator().manual_seed(0)), PrioritizedSample) and all(c._full)
    a.enable_priorities(alpha=1.0)
    prio = torch.tensor([1.0, 1.0, 1.0, 1.0, 100.0, 100.0], dtype=torch.float64)
    a.update_priority(torch.arange(6), prio)
    got = c.sample(2000, torch.Generator().manual_seed(1))
    assert isinstance(got, PrioritizedSample) and torch.equal(got.td["tag"], got.indices)
    assert torch.allclose(got.probabilities, (prio / prio.sum())[got.indices], rtol=1e-9)
    assert float((got.indices >= 4).double().mean()) > 0.95  # 200/204 of the mass; by size: 1/3
    a.clear_redis()


def test_an_extend_that_meets_a_queue_set_elsewhere_then_waits_on_every_shard(redis_cluster):
    """A handle that did not know of queue mode learns it from its first extend's shard (which adopts the policy):
    its next extend chooses among the shards with room, not the next in turn. It used to judge by shard 0's cached
    header only, and sent the next extend to a full shard."""
    s = ring(redis_cluster, count=6)
    actor = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    s.set_queue(True)
    fill(s, [0, 0, 2])  # shard 2's queue is full
    actor._next = 1
    first = actor.extend(rows(torch.tensor([100])), timeout=0)  # to shard 1, in turn: it adopts the queue mode
    assert actor._locate(first.indices).tolist() == [1] and actor.shards[1].sampling_policy.queue
    second = actor.extend(rows(torch.tensor([101])), timeout=0)  # shard 2 is next in turn, and full
    assert actor._locate(second.indices).tolist() == [0]
    s.clear_redis()


def test_a_waiting_extend_keeps_one_deadline_for_the_whole_call(redis_cluster, monkeypatch):
    """``extend(timeout=T)`` in queue mode: the wait for a shard that admits it and that shard's own wait share one
    deadline. Here the counters' read ends at T and another writer takes the room it found: the shard is sent what
    is left (nothing) and refuses at once. It used to be sent T again (2T in all)."""
    big = 3.0
    s = ring(redis_cluster, count=6)
    other = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=s.td_id)
    s.set_queue(True)
    fill(s, [2, 2, 2])
    other.shards[0].pop(1, timeout=0)  # room for one row on shard 0
    real_heads, real_one, sent = s._heads, s._extend_one, []

    def slow_heads(leases: bool = False):
        got = real_heads(leases)
        time.sleep(big)  # the read ends when the call's time is up
        return got

    def racing(k, piece, priority, timeout):
        sent.append(timeout)
        other.shards[k].extend(rows(torch.tensor([99])), timeout=0)  # another writer takes the room first
        return real_one(k, piece, priority, timeout)

    monkeypatch.setattr(s, "_heads", slow_heads)
    monkeypatch.setattr(s, "_extend_one", racing)
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        s.extend(rows(torch.tensor([7])), timeout=big)
    took = time.monotonic() - t
    assert sent == [0.0] and took < big + 2.5, (sent, took)  # it took at least 2 * big
    s.clear_redis()


def test_written_slots_refuse_an_index_out_of_range():
    w = WrittenSlots([0, 10], [3, 2])  # slots 0, 1, 2, 10, 11
    assert list(w) == [0, 1, 2, 10, 11] and [w[i] for i in range(-5, 5)] == [0, 1, 2, 10, 11] * 2
    assert w[1:-1] == [1, 2, 10]
    for i in (5, 6, -6, -8):
        with pytest.raises(IndexError):
            w[i]


# -- processes --------------------------------------------------------------------------------

# per-shard limiters let the shards fill unevenly (each admits as the learners draw from it, and draws
# follow the shards' masses), so the ring has room to spare: no shard wraps however the fills drift
ACTORS, LEARNERS, ROUNDS, CHUNK, CAP = 4, 2, 12, 5, 480
SPI, MIN_SIZE, BUFFER = 2.0, 12, 60.0
BATCH = 8


def priority_of(tag: torch.Tensor) -> torch.Tensor:
    return torch.where(tag % 7 == 0, torch.zeros_like(tag, dtype=torch.float64), 1.0 + (tag % 5).double())


def _actor(url: str, td_id: str, a: int, out: mp.Queue) -> None:
    store = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=td_id)
    for r in range(ROUNDS):
        tags = torch.arange(CHUNK) + 1000 * a + CHUNK * r + 1
        store.extend(rows(tags), priority=priority_of(tags), timeout=60)
    out.put(("actor", a, 0))


def _learner(url: str, td_id: str, k: int, samples: int, out: mp.Queue) -> None:
    store = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=td_id)
    gen = torch.Generator().manual_seed(k)
    bad = 0
    for _ in range(samples):
        s = store.sample(BATCH, gen, timeout=60)
        bad += int(not whole(s.td)) + int(bool((priority_of(s.td["tag"]) == 0).any()))
        store.update_priority(s.indices, priority_of(s.td["tag"]), generation=s.generations)
    out.put(("learner", k, bad))


def test_four_actors_two_learners_share_a_sharded_prioritized_rate_limited_buffer(redis_cluster):
    store = ring(redis_cluster, count=CAP)
    store.enable_priorities(alpha=0.8)
    store.set_rate_limit(min_size=MIN_SIZE, samples_per_insert=SPI, error_buffer=BUFFER)
    inserts = ACTORS * ROUNDS * CHUNK
    # the learners take what the ratio allows once all is inserted, less the limiter's offset: the actors can
    # finish (samples within the buffers of inserts * SPI), and so can the learners (each shard's share within its buffer)
    per_learner = int(inserts * SPI - SPI * MIN_SIZE) // (LEARNERS * BATCH)
    ctx = mp_context()  # forkserver: not fork (this process may run shard threads)
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(redis_cluster.url, store.td_id, a, out)) for a in range(ACTORS)]
    procs += [ctx.Process(target=_learner, args=(redis_cluster.url, store.td_id, k, per_learner, out)) for k in range(LEARNERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [r[2] for r in results] == [0] * len(procs)  # every row whole, none of priority 0
    assert store.write_count == inserts and len(store.written) == inserts
    tags = store[list(store.written)]["tag"]
    assert sorted(tags.tolist()) == sorted(1000 * a + CHUNK * r + i + 1 for a in range(ACTORS) for r in range(ROUNDS) for i in range(CHUNK))
    # under the limiter each actor writes to the least written shard that admits it: all are used
    assert sum(st.written for st in store.shard_states()) == inserts and all(st.written > inserts // 10 for st in store.shard_states())
    store.clear_redis()


def _popper(url: str, td_id: str, out: mp.Queue) -> None:
    store = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=td_id)
    got = []
    while True:
        p = store.pop(2, timeout=60)
        tags = p.td["tag"].tolist()
        got += [t for t in tags if t >= 0]
        if any(t < 0 for t in tags):
            break
    out.put(got)


def _queue_writer(url: str, td_id: str, w: int) -> None:
    store = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=td_id)
    for start in range(0, 30, 3):
        store.extend(rows(torch.arange(start, start + 3) + 1000 * (w + 1)), timeout=60)


def test_writers_and_readers_of_a_sharded_queue_get_every_item_once(redis_cluster):
    store = ring(redis_cluster, count=24)
    store.set_queue(True)
    ctx = mp_context()  # forkserver: not fork (this process may run shard threads)
    out: mp.Queue = ctx.Queue()
    readers = [ctx.Process(target=_popper, args=(redis_cluster.url, store.td_id, out)) for _ in range(2)]
    writers = [ctx.Process(target=_queue_writer, args=(redis_cluster.url, store.td_id, w)) for w in range(3)]
    for p in readers + writers:
        p.start()
    for p in writers:
        p.join(timeout=120)
        assert p.exitcode == 0
    for k in range(3):  # one sentinel per shard: every reader meets one (a reader stops at its first)
        store.shards[k].extend(rows(torch.full((1,), -1)), timeout=60)
    got = [out.get(timeout=120) for _ in readers]
    for p in readers:
        p.join(timeout=60)
    left = []
    while True:
        try:
            left += [t for t in store.pop(8, timeout=0).td["tag"].tolist() if t >= 0]
        except TimeoutError:
            break
    tags = [t for part in got for t in part] + left
    assert len(tags) == len(set(tags)) == 90 and set(tags) == {1000 * (w + 1) + i for w in range(3) for i in range(30)}
    store.clear_redis()


# -- a cluster of its own ---------------------------------------------------------------------

#: Rows of 256 KiB less 64 bytes: a segment of four is just under 1 MiB, one jemalloc size class (a blob of
#: 1 MiB plus its header would take the 1.25 MiB class: a quarter of the node's memory lost to rounding).
ROW_FLOATS = 64 * 1024 - 16


def _big_writer(url: str, td_id: str, w: int, batches: int, per: int) -> None:
    store = ShardedRing.from_store(url=url, prefix=PREFIX, td_id=td_id)
    for b in range(batches):
        tags = torch.arange(per) + (w * batches + b) * per
        store.extend(TensorDict(tag=tags, obs=tags.float().unsqueeze(-1) + torch.arange(ROW_FLOATS).float(), batch_size=[per]))


@pytest.mark.slow
def test_a_buffer_larger_than_one_node(tmp_path):
    """Three primaries of 64 MB (noeviction) hold a 150 MB buffer filled by three processes: every row exact."""
    with EmbeddedCluster(extra_args=("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")) as cluster:
        count, per, writers = 576, 4, 3  # 576 rows of ~256 KiB: 151 MB, 50 MB per shard, in segments of four rows
        store = ShardedRing(count=count, url=cluster.url, prefix=PREFIX, segment_bytes=1 << 20)
        batches = count // (per * writers)
        ctx = mp_context()  # forkserver: not fork (this process may run shard threads)
        procs = [ctx.Process(target=_big_writer, args=(cluster.url, store.td_id, w, batches, per)) for w in range(writers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            assert p.exitcode == 0
        assert len(store.written) == count and store.write_count == count
        seen = []
        for start in range(0, count, 48):
            got = store[torch.arange(start, start + 48)]
            assert torch.equal(got["obs"], got["tag"].float().unsqueeze(-1) + torch.arange(ROW_FLOATS).float())
            seen += got["tag"].tolist()
        assert sorted(seen) == list(range(count))
        used = [cluster.node_client(i).info("memory")["used_memory"] for i in range(3)]
        assert sum(used) > 150_000_000 and all(u < 64 << 20 for u in used)
        assert all(abs(u - sum(used) / 3) < 0.25 * sum(used) / 3 for u in used)  # about a third each
        store.clear_redis()


def test_a_node_down_names_its_shard_and_the_others_serve():
    with EmbeddedCluster() as cluster:
        s = ShardedRing(count=30, url=cluster.url, prefix=PREFIX)
        s.extend(rows(torch.arange(30)))
        before = s[torch.arange(30)]["tag"]
        nodes = s.shard_nodes()
        layout_node = s._client.get_node_from_key(s._keys.shards).name
        down = next(k for k in range(3) if nodes[k] != layout_node)  # the layout key stays up
        port = int(nodes[down].rsplit(":", 1)[1])
        cluster.stop_node(cluster.ports.index(port))
        with pytest.raises(ShardUnavailableError, match=f"shard {down} .*{nodes[down]}") as err:
            s[s.shard_offsets[down]]["tag"].item()
        assert err.value.shard == down and isinstance(err.value, ConnectionError)
        up = (down + 1) % 3
        assert int(s[s.shard_offsets[up]]["tag"]) == before[s.shard_offsets[up]]  # another shard serves meanwhile
        s.shards[up].extend(rows(torch.tensor([77])))
        cluster.start_node(cluster.ports.index(port))
        # its node is back (empty: these nodes keep nothing on disk): the shard is made again by attaching
        again = ShardedRing(count=30, url=cluster.url, prefix=PREFIX, td_id=s.td_id)
        assert again.shard_states()[down].written == 0 and again.shard_states()[up].written == 10
        s.close()


# -- torchrl ----------------------------------------------------------------------------------


def _rl_attach(url: str, td_id: str, out: mp.Queue) -> None:
    from tdstore.torchrl import attach

    rb = attach(td_id, url=url, prefix=PREFIX, batch_size=16, sampler="prioritized")
    rb.extend(
        TensorDict(
            tag=torch.arange(100, 110), obs=torch.arange(100, 110).double().unsqueeze(-1), neg=-torch.arange(100, 110), batch_size=[10]
        )
    )
    s = rb.sample()
    out.put((len(rb), bool(whole(s.exclude("index", "priority_weight"))), s["priority_weight"].shape[0]))


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_torchrl_replay_buffer_over_shards_from_two_processes(redis_cluster, sampler):
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(60, url=redis_cluster.url, prefix=PREFIX, sharded=True, batch_size=32, sampler=sampler)
    rb.extend(rows(torch.arange(30), width=1))
    ring = rb.storage._store
    assert isinstance(ring, ShardedRing) and len(rb) == 30
    s = rb.sample()
    assert whole(s.exclude(*[k for k in ("index", "priority_weight") if k in s.keys()]))
    assert torch.equal(ring[s["index"]]["tag"], s["tag"])
    if sampler == "prioritized":
        rb.update_priority(s["index"], torch.rand(32) + 0.1)
        ctx = mp_context()  # forkserver: not fork (this process may run shard threads)
        out: mp.Queue = ctx.Queue()
        p = ctx.Process(target=_rl_attach, args=(redis_cluster.url, rb.storage.td_id, out))
        p.start()
        n, ok, b = out.get(timeout=120)
        p.join(timeout=60)
        assert p.exitcode == 0 and ok and b == 16 and ring.write_count == 40 and n == len(rb)
    ring.clear_redis()


def test_torchrl_samplers_draw_written_slots_of_a_sharded_ring_not_full(redis_cluster):
    """Shards fill in turn, so before every shard is full the written slots are not ``range(len(rb))``:
    without replacement every written row comes once a pass (rows written meanwhile join it),
    torchrl's own ``RandomSampler`` draws written rows only, and its ``SamplerWithoutReplacement``
    raises rather than read slots not written (``replay_buffer`` gives it the subclass that draws them)."""
    from torchrl.data import RandomSampler, SamplerWithoutReplacement, TensorDictReplayBuffer

    from tdstore.torchrl import StoreSamplerWithoutReplacement, replay_buffer

    rb = replay_buffer(60, url=redis_cluster.url, prefix=PREFIX, spread=True, batch_size=6, sampler="without_replacement")
    for lo, hi in ((0, 7), (7, 12), (12, 15)):  # three batches: one per shard, uneven fills
        rb.extend(rows(torch.arange(lo, hi), width=1))
    ring = rb.storage._store
    assert isinstance(ring, ShardedRing) and len(rb) == 15 and sorted(ring.written) != list(range(15))
    seen = []
    for _ in range(2):
        s = rb.sample()
        assert torch.equal(ring[s["index"]]["tag"], s["tag"]) and whole(s.exclude("index"))
        seen += s["tag"].tolist()
    rb.extend(rows(torch.arange(15, 18), width=1))  # joins the pass
    while len(seen) < 18:
        s = rb.sample()
        assert torch.equal(ring[s["index"]]["tag"], s["tag"])
        seen += s["tag"].tolist()
    assert sorted(seen) == list(range(18))  # each written row once in the pass
    own = TensorDictReplayBuffer(storage=rb.storage, sampler=RandomSampler(), batch_size=64)
    s = own.sample()
    assert set(s["index"].tolist()) <= set(ring.written) and whole(s.exclude("index"))
    # torchrl's SamplerWithoutReplacement draws range(len): slots not written raise, never rows of zeros
    blind = TensorDictReplayBuffer(storage=rb.storage, sampler=SamplerWithoutReplacement(), batch_size=18)
    with pytest.raises(IndexError, match="not written yet.*StoreSamplerWithoutReplacement"):
        blind.sample()
    # given to replay_buffer, it is made the subclass that draws the written slots (the same object)
    mine = SamplerWithoutReplacement()
    again = replay_buffer(url=redis_cluster.url, prefix=PREFIX, sharded=True, td_id=rb.storage.td_id, batch_size=6, sampler=mine)
    assert again.sampler is mine and isinstance(mine, StoreSamplerWithoutReplacement)
    assert sorted(t for _ in range(3) for t in again.sample()["tag"].tolist()) == list(range(18))
    with pytest.raises(IndexError, match="not full"):  # torchrl's SliceSampler reads a whole key: not until full
        rb.storage.get("tag")
    # slices and positions from the end are along the written slots, as a LazyTensorStorage's
    assert sorted(rb.storage[:]["tag"].tolist()) == list(range(18))
    last = max(ring.written)
    assert rb.storage[torch.tensor([-1])]["tag"].tolist() == ring[torch.tensor([last])]["tag"].tolist()
    ring.clear_redis()
    with pytest.raises(ValueError, match="min_replicas=1 is for a sharded ring"):
        replay_buffer(10, url=redis_cluster.url, prefix=PREFIX, min_replicas=1).extend(rows(torch.arange(2), width=1))


def test_torchrl_reads_of_a_sharded_ring_ask_each_shard_its_size_until_it_is_full(redis_cluster):
    """Until every shard is full, a read through torchrl's storage first asks each shard not full how many rows
    it holds (one HMGET per shard, all at once), then reads the rows (one transaction per shard read); a shard
    seen full is not asked again, so a full ring's read leaves the shards it does not read alone."""
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(60, url=redis_cluster.url, prefix=PREFIX, spread=True, batch_size=6)
    for lo, hi in ((0, 7), (7, 12), (12, 15)):  # every shard holds rows, none is full
        rb.extend(rows(torch.arange(lo, hi), width=1))
    rb.storage[torch.tensor([0])]  # the read scripts are on every node
    nodes = round_trips_per_node(redis_cluster, lambda: rb.storage[torch.tensor([0, 1])])
    assert sorted(nodes) == [["hmget"], ["hmget"], ["hmget", "transaction"]], nodes
    nodes = round_trips_per_node(redis_cluster, lambda: rb.storage[:])
    assert nodes == [["hmget", "transaction"]] * 3, nodes
    rb.extend(rows(torch.arange(15, 75), width=1))  # every shard full (one may wrap first: shards fill in turn)
    rb.storage[torch.tensor([0])]  # this handle sees them full
    nodes = round_trips_per_node(redis_cluster, lambda: rb.storage[torch.tensor([0, 1])])
    assert sorted(nodes) == [[], [], ["transaction"]], nodes
    assert len(rb) == 60
    rb.storage._store.clear_redis()


def test_ls_and_info_show_a_sharded_ring_with_its_shards(redis_cluster):
    import subprocess
    import sys

    s = ring(redis_cluster, count=30)
    s.extend(rows(torch.arange(14)))
    run = [sys.executable, "-m", "tdstore"]
    ls = subprocess.run([*run, "ls", "--prefix", PREFIX, "--url", redis_cluster.url], capture_output=True, text=True, check=True)
    line = next(x for x in ls.stdout.splitlines() if x.startswith(s.td_id + " "))
    assert "sharded/3" in line and "14/30" in line
    assert sum(f"{s.td_id} ~shard" in x for x in ls.stdout.splitlines()) == 3
    info = subprocess.run(
        [*run, "info", s.td_id, "--prefix", PREFIX, "--url", redis_cluster.url], capture_output=True, text=True, check=True
    )
    assert "sharded ring" in info.stdout and "written 14/30" in info.stdout
    for k, node in enumerate(s.shard_nodes()):
        assert f"shard {k}: {s.shard_ids[k]} on {node}" in info.stdout
    s.clear_redis()


def test_the_demo_refuses_sharded_without_a_cluster_or_replay(capsys):
    from tdstore.cli import main

    for argv, message in (
        (["demo", "--sharded", "--replay"], "--sharded makes a sharded ring over a Redis Cluster"),
        (["demo", "--sharded", "--cluster"], "--sharded runs the replay demo on a sharded ring"),
    ):
        assert main([*argv, "--no-progress"]) == 2, argv
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_demo_replay_on_a_sharded_ring(redis_cluster):
    """``tdstore demo --cluster --sharded --replay``: actors and a learner on a sharded, prioritized, rate-limited buffer."""
    import io

    from tdstore.demo import run_demo

    out = io.StringIO()
    got = run_demo(
        url=redis_cluster.url,
        actors=2,
        count=48,
        seconds=1.0,
        batch=16,
        prefix="demo-sharded",
        progress=False,
        out=out,
        sharded=True,
        replay=True,
    )
    assert got["ok"] and got["torn"] == 0 and got["verified"] == 48 and got["lost_writes"] == 0
    assert "sharded over 3 primaries" in got["server"]


def test_max_times_sampled_retires_slots_on_every_shard(redis_cluster):
    s = ring(redis_cluster, count=12)
    s.enable_priorities(alpha=1.0, max_times_sampled=1)
    fill(s, [4, 4, 4])
    seen: list[int] = []
    gen = torch.Generator().manual_seed(3)
    while len(seen) < 12:
        got = s.sample(1, gen)
        seen += got.indices.tolist()
    assert sorted(seen) == list(range(12))  # each slot drawn once, then retired, whichever shard holds it
    with pytest.raises((ValueError, TimeoutError)):
        s.sample(1, gen)
    s.clear_redis()


@pytest.mark.slow
def test_a_primary_failing_over_mid_run_loses_nothing_and_the_others_serve():
    """3 primaries + 3 replicas: shard ``down``'s primary hands over to its replica (CLUSTER FAILOVER,
    in a thread) while this thread writes and reads. Each call succeeds or raises
    ShardUnavailableError naming shard ``down``; once the new primary serves, every call goes on
    and every row acknowledged is read back exactly."""
    import threading

    with EmbeddedCluster(replicas=1) as cluster:
        s = ShardedRing(count=30000, url=cluster.url, prefix=PREFIX)
        down = 1
        port = int(s.shard_nodes()[down].rsplit(":", 1)[1])
        acked: dict[int, tuple[int, int]] = {}  # global slot -> (tag, generation) of its last acknowledged write
        tag = 0

        def step() -> list[int]:
            """One extend (the shards in turn) and one read of an acknowledged slot of every shard: the shards that failed."""
            nonlocal tag
            failed = []
            try:
                w = s.extend(rows(torch.arange(tag, tag + 4)))
                for slot, t, g in zip(w.indices.tolist(), range(tag, tag + 4), w.generations.tolist()):
                    acked[slot] = (t, g)
            except ShardUnavailableError as err:
                assert err.shard == down and f"shard {down} " in str(err), err
                failed.append(err.shard)
            tag += 4
            for k, off in enumerate(s.shard_offsets):
                if off in acked:
                    try:
                        got = s[off]
                        assert int(got["tag"]) == acked[off][0] and whole(got.unsqueeze(0))
                    except ShardUnavailableError as err:
                        assert err.shard == down == k, err
                        failed.append(k)
            return failed

        for _ in range(30):
            assert step() == []
        failing = threading.Thread(target=lambda: cluster.failover(cluster.ports.index(port)))
        failing.start()
        calls = 0
        while failing.is_alive() and tag < 29000:  # mid-run: calls go on while the shard fails over
            step()
            calls += 1
        failing.join()
        assert s.shard_nodes()[down] != f"127.0.0.1:{port}"  # a new primary holds the shard
        for _ in range(30):  # then every call goes on, on every shard
            assert step() == []
        slots = torch.tensor(sorted(acked))
        got = s[slots]
        assert whole(got) and got["tag"].tolist() == [acked[i][0] for i in slots.tolist()]
        states = s.shard_states()
        assert len(acked) <= sum(st.written for st in states) <= tag  # a call that raised may still have been written
        s.close()


def test_min_replicas_refuses_a_write_no_replica_acknowledges(redis_cluster):
    s = ring(redis_cluster, count=30, min_replicas=1)  # the session's cluster has no replicas
    with pytest.raises(ShardUnavailableError, match="0 of min_replicas=1 replicas acknowledged"):
        s.extend(rows(torch.arange(3)))
    with pytest.raises(ValueError, match="min_replicas"):
        ring(redis_cluster, count=30, min_replicas=-1)
    assert pickle.loads(pickle.dumps(s))._min_replicas == 1
    # pops and acks change a shard's state too: they wait for the replicas as writes do
    leased = ring(redis_cluster, count=30)
    leased.extend(rows(torch.arange(4)))
    strict = ShardedRing.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=leased.td_id, min_replicas=1)
    assert isinstance(strict, ShardedRing) and strict._min_replicas == 1
    with pytest.raises(ShardUnavailableError, match="0 of min_replicas=1 replicas acknowledged"):
        strict.pop(1, timeout=5)
    got = leased.pop(1, lease=60.0, timeout=5)
    with pytest.raises(ShardUnavailableError, match="0 of min_replicas=1 replicas"):  # acknowledged, or (a shard found short) connected
        strict.ack(got)
    plain = LazyStackedTensorDictStore(count=4, url=redis_cluster.url, prefix=PREFIX)
    with pytest.raises(ValueError, match="not a sharded ring"):
        LazyStackedTensorDictStore.from_store(url=redis_cluster.url, prefix=PREFIX, td_id=plain.td_id, min_replicas=1)
    strict.close()
    leased.clear_redis()
    plain.clear_redis()
    s.clear_redis()
    assert not any(keys_per_node(redis_cluster, s.td_id))


@pytest.mark.slow
def test_a_killed_primary_loses_nothing_acknowledged_with_min_replicas():
    """min_replicas=1: a write returns once a replica has it. Shard ``down``'s primary is killed (in a
    thread, which waits until the cluster promotes its replica) while this thread writes: calls on
    that shard raise ShardUnavailableError naming it (unreachable, then no replica to acknowledge
    until the killed node comes back as the new primary's replica); the other shards serve
    meanwhile; then every call goes on and every row acknowledged is read back exactly."""
    import threading

    with EmbeddedCluster(replicas=1) as cluster:
        s = ShardedRing(count=30000, url=cluster.url, prefix=PREFIX, min_replicas=1)
        layout_node = s._client.get_node_from_key(s._keys.shards).name
        down = next(k for k, node in enumerate(s.shard_nodes()) if node != layout_node)
        old = s.shard_nodes()[down]
        acked: dict[int, int] = {}
        tag = 0

        def extend() -> int | None:
            """An extend of 3 rows: its shard, or None if it raised (naming shard ``down``)."""
            nonlocal tag
            tag += 3
            try:
                w = s.extend(rows(torch.arange(tag, tag + 3)))
            except ShardUnavailableError as err:
                assert err.shard == down and f"shard {down} " in str(err), err
                return None
            acked.update(zip(w.indices.tolist(), range(tag, tag + 3)))
            return int(s._locate(w.indices[:1])[0])

        for _ in range(30):
            assert extend() is not None
        i = cluster.ports.index(int(old.rsplit(":", 1)[1]))
        killing = threading.Thread(target=cluster.kill_primary, args=(i,))
        killing.start()
        while killing.is_alive() and tag < 25000:
            extend()
        killing.join()
        # the replica is the primary now, with no replica of its own: its shard refuses, the others serve
        after = [extend() for _ in range(6)]
        assert after.count(None) == 2 and set(after) - {None} == {0, 1, 2} - {down}
        cluster.start_node(i)  # back (empty) as the new primary's replica
        # its shard acknowledges again once the replica's link is up; a loaded machine may need a few
        # refused calls first (a bound on a hang, not a speed requirement)
        until = time.monotonic() + 60
        while extend() is None:
            assert time.monotonic() < until, f"shard {down} never acknowledged again after its node came back"
        assert all(extend() is not None for _ in range(30))  # then every call goes on
        assert s.shard_nodes()[down] != old
        slots = torch.tensor(sorted(acked))
        got = s[slots]
        assert whole(got) and got["tag"].tolist() == [acked[i] for i in slots.tolist()]
        s.close()


def test_torchrl_in_place_writes_revision_write_count_and_empty_on_a_sharded_ring(redis_cluster):
    """What torchrl's storage keeps beside the rows works on a sharded ring as on one node: in-place
    writes (``rb[i] = td``, ``storage[:]``'s ``set_`` and ``update_``) move the mutation revision, ``write_count`` and
    ``empty()`` keep torchrl's counters in every shard's header, and ``empty()`` keeps the shards'
    priorities. Each of these raised AttributeError before (the sharded engine had no ``command``)."""
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(30, url=redis_cluster.url, prefix=PREFIX, sharded=True, batch_size=4, sampler="prioritized", alpha=0.7)
    rb.extend(rows(torch.arange(12), width=1))
    ring = rb.storage._store
    written = sorted(ring.written)
    assert len(written) == 12 and rb.write_count == 12
    revisions = [rb.storage._mutation_revision]
    rb[written[-1]] = rows(torch.tensor([99]), width=1)[0]
    revisions.append(rb.storage._mutation_revision)
    both = torch.tensor([written[0], written[-1]])
    rb[both] = rows(torch.tensor([7, 8]), width=1)  # two shards
    revisions.append(rb.storage._mutation_revision)
    assert rb[both]["tag"].tolist() == [7, 8]

    def in_place_counts() -> list[int]:  # each shard's count of torchrl's in-place writes ('tr')
        return [int(e.command("HGET", e.keys.meta, "tr") or 0) for e in (shard._engine for shard in rb.storage._store.shards)]

    counts = in_place_counts()
    rb.storage[:].set_("tag", torch.arange(100, 112))  # every shard written, two of them from worker threads
    assert [b - a for a, b in zip(counts, in_place_counts())] == [1 if s.ring_state().written else 0 for s in ring.shards]
    revisions.append(rb.storage._mutation_revision)
    assert sorted(rb[:]["tag"].tolist()) == list(range(100, 112))
    rb.storage[:].update_({"tag": torch.arange(200, 212)})
    revisions.append(rb.storage._mutation_revision)
    assert sorted(rb[:]["tag"].tolist()) == list(range(200, 212))
    assert len(set(revisions)) == len(revisions), revisions  # every in-place write moved it
    policies = [s.sampling_policy for s in ring.shards]
    rb.empty(empty_write_count=False)
    assert len(rb) == 0 and rb.write_count == 12
    assert [s.sampling_policy for s in rb.storage._store.shards] == policies
    idx = rb.extend(rows(torch.arange(5), width=1))
    assert rb.write_count == 17 and len(rb) == 5
    assert set(rb.sample()["index"].tolist()) <= set(idx.tolist())
    rb.storage._store.clear_redis()
