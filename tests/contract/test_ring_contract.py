"""The ring's contract (``tdstore.Ring``), one test per property, run on every kind of ring.

Kinds: a lazy store and a dense store, each on redis-server and on fakeredis, and a sharded ring
(``ShardedRing``) on the session's three-primary cluster. The properties are the ones the Protocol's
docstrings state: capacity, FIFO and leased pops exactly once, generations and the ring's counters,
priorities (chi-square), the rate limiter, waits and deadlines, resent calls, and ``MemoryError`` only
when the data would not fit. Where a kind breaks a property today the test is marked
``xfail(strict=True)`` on that kind, naming the issue: it passes now and turns red when fixed, so the
mark goes. No test races the machine: refusals are checked with ``timeout=0``, a lease is known to
have run out by reading the server's clock, and wall-clock bounds only catch a hang.
"""

from __future__ import annotations

import bisect
import inspect
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import torch
from helpers import chi_square
from tensordict import TensorDict

import tdstore
import tdstore._ring.extend
from tdstore import LazyStackedTensorDictStore, LeaseLostError, ShardedRing, TensorDictStore
from tdstore._ring.leases import LeasedSample
from tdstore._ring.policy_calls import PrioritizedSample
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer

pytestmark = [pytest.mark.ring, pytest.mark.usefixtures("replies_are_never_cut_short")]

KINDS = ["lazy-redis", "lazy-fakeredis", "dense-redis", "dense-fakeredis", "sharded"]
LONG = 600.0  # seconds: a lease that never runs out during a test
SHORT = 0.2  # seconds: a lease the test waits out, on the server's clock
HANG = 30.0  # seconds: a call slower than this hangs (the only wall-clock bound here)


def rows(tags: torch.Tensor) -> TensorDict:
    """Small rows named by their tag in every leaf (a torn or misplaced row shows)."""
    n = tags.numel()
    return TensorDict(tag=tags.clone(), obs=tags.float().unsqueeze(-1).expand(n, 2).clone(), batch_size=[n])


class Kind:
    """How a test makes rings of one kind, reads a server clock, and tells a ring's order partitions."""

    def __init__(self, name: str, store_kwargs: Callable[[], dict[str, Any]], clock: Any) -> None:
        self.name = name
        self.sharded = name == "sharded"
        self._kwargs = store_kwargs
        self._clock = clock
        self._made: list[Any] = []

    def make(self, count: int) -> Any:
        kw = {"prefix": f"contract-{uuid.uuid4().hex[:8]}", **self._kwargs()}
        if self.name.startswith("dense"):
            ring: Any = TensorDictStore(batch_size=[count], **kw)
        else:
            ring = (ShardedRing if self.sharded else LazyStackedTensorDictStore)(count=count, **kw)
        assert isinstance(ring, ShardedRing) == self.sharded
        self._made.append(ring)
        return ring

    def server_ms(self) -> int:
        t = self._clock.time()
        return int(t[0]) * 1000 + int(t[1]) // 1000

    def partition(self, ring: Any, indices: torch.Tensor) -> list[int]:
        """The order partition of each slot: items come in write order within one (a sharded ring's shard)."""
        if not self.sharded:
            return [0] * indices.numel()
        return [bisect.bisect_right(ring.shard_offsets, int(i)) - 1 for i in indices]

    def close(self) -> None:
        for ring in self._made:
            ring.clear_redis()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Iterator[Kind]:
    name = request.param
    if name == "sharded":
        cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
        k = Kind(name, lambda: {"url": cluster.url}, cluster.node_client(0))
    elif name.endswith("-redis"):
        srv: EmbeddedServer = request.getfixturevalue("redis_server")
        k = Kind(name, lambda: {"url": srv.url}, srv.client())
    else:
        server = fakeredis.FakeServer()
        k = Kind(name, lambda: {"client": fakeredis.FakeRedis(server=server)}, fakeredis.FakeRedis(server=server))
    yield k
    k.close()


def drain(kind: Kind, ring: Any, n: int, batch: int, **kw: Any) -> list[Any]:
    """Pops of up to ``batch`` until ``n`` items came (never more; each pop in write order within its partitions)."""
    got: list[Any] = []
    have = 0
    end = time.monotonic() + HANG
    while have < n:
        assert time.monotonic() < end, f"only {have} of {n} items came"
        out = ring.pop(min(batch, n - have), timeout=5, **kw)
        check_order(kind, ring, out)
        got.append(out)
        have += out.indices.numel()
    assert have == n
    return got


def tags_of(pops: list[Any]) -> list[int]:
    return [t for p in pops for t in p.td["tag"].tolist()]


def check_order(kind: Kind, ring: Any, *pops: Any) -> None:
    """Within each partition, the popped items' tags (write order here) increase."""
    last: dict[int, int] = {}
    for p in pops:
        assert torch.equal(p.td["obs"][:, 0], p.td["tag"].float())  # whole rows
        for part, tag in zip(kind.partition(ring, p.indices), p.td["tag"].tolist()):
            assert tag > last.get(part, -1), f"item {tag} came after {last[part]} in partition {part}"
            last[part] = tag


def nothing_left(ring: Any) -> None:
    """``pop(timeout=0)`` on a ring with nothing unread raises TimeoutError at once (a hang is bounded)."""
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        ring.pop(1, timeout=0)
    assert time.monotonic() - start < HANG


# -- the interface ------------------------------------------------------------------------------


def test_every_kind_is_a_ring(kind):
    ring = kind.make(8)
    assert isinstance(ring, tdstore.Ring)
    assert ring.capacity == 8


def test_isinstance_runs_no_property_and_sends_nothing():
    """``written`` of a dense store without rows raises TypeError: the check never runs it (nor any round trip)."""
    server = fakeredis.FakeServer()
    batchless = TensorDictStore(batch_size=[], client=fakeredis.FakeRedis(server=server))
    with pytest.raises(TypeError, match="no rows"):
        batchless.written  # noqa: B018
    assert isinstance(batchless, tdstore.Ring)
    assert not isinstance(object(), tdstore.Ring) and not isinstance(TensorDict(), tdstore.Ring)


# -- capacity, pops ---------------------------------------------------------------------------


def test_a_ring_of_count_holds_count_items_whatever_the_extend_sizes(kind):
    """Issue 39's case: ten extends of 30 into a ring of 300, then pops of 16 until it is empty: every row once
    (a sharded ring cuts an extend over its shards when one shard's lap cannot take it whole)."""
    ring = kind.make(300)
    for i in range(10):
        ring.extend(rows(torch.arange(30 * i, 30 * i + 30)))
    assert ring.write_count == 300 and len(ring.written) == 300
    assert sorted(tags_of(drain(kind, ring, 300, 16))) == list(range(300))  # each exactly once
    nothing_left(ring)


def test_fifo_pops_hand_out_each_item_once_when_full(kind):
    ring = kind.make(24)
    for lap in range(2):  # the second lap writes every slot again: generation 2
        ring.extend(rows(torch.arange(100 * lap, 100 * lap + 24)))  # filled to capacity by one call
        got = drain(kind, ring, 24, 5)
        assert sorted(tags_of(got)) == list(range(100 * lap, 100 * lap + 24))
        assert all((p.generations == lap + 1).all() for p in got)
        nothing_left(ring)


def test_leased_pops_hand_out_each_item_once_and_a_lapsed_lease_once_more(kind):
    ring = kind.make(24)
    ring.extend(rows(torch.arange(100, 124)))  # filled to capacity by one call
    kept = ring.pop(6, lease=LONG)
    assert isinstance(kept, LeasedSample) and (kept.generations == 1).all() and not kept.redelivered.any()
    rest = drain(kind, ring, 18 - kept.indices.numel(), 7, lease=LONG)
    lapsing = drain(kind, ring, 6, 6, lease=SHORT)  # the last 6
    end = time.monotonic() + HANG
    while kind.server_ms() <= max(p.deadline_ms for p in lapsing):  # the server's clock past the leases: no timer raced
        assert time.monotonic() < end
        time.sleep(0.02)
    again = drain(kind, ring, 6, 10, lease=LONG)
    assert sorted(tags_of(again)) == sorted(tags_of(lapsing))  # redelivered once, flagged
    assert all(bool(p.redelivered.all()) and p.deliveries.tolist() == [2] * p.indices.numel() for p in again)
    nothing_left(ring)  # the rest are leased (for minutes): to nobody else
    settled = sum(ring.ack(p) for p in [kept, *rest, *again])
    assert settled == 24 and ring.ack(kept) == kept.indices.numel()  # twice: the same answer
    for p in lapsing:
        with pytest.raises(LeaseLostError) as err:  # its items went to another pop
            ring.ack(p)
        assert sorted(err.value.not_held) == sorted(p.write_numbers.tolist())
    assert sorted(tags_of([kept, *rest, *again])) == list(range(100, 124))
    nothing_left(ring)  # acknowledged: never handed out again


# -- generations and the ring's counters --------------------------------------------------------


def test_generations_write_count_and_cursor_move_as_documented(kind):
    cap = 12
    ring = kind.make(cap)
    assert (ring.write_count, len(ring.written)) == (0, 0)
    assert ring.cursor == (-1 if kind.sharded else 0)
    times: Counter[int] = Counter()  # slot -> how often written: its generation
    holds: dict[int, int] = {}  # slot -> tag
    total = 0
    for n in (3, 4, 1, 4, 3, 2, 4):  # 21 rows: the ring laps
        w = ring.extend(rows(torch.arange(total, total + n)))
        if not kind.sharded:
            assert w.indices.tolist() == [(total + i) % cap for i in range(n)]  # at the cursor, wrapping
        for slot, gen, tag in zip(w.indices.tolist(), w.generations.tolist(), range(total, total + n)):
            times[slot] += 1
            holds[slot] = tag
            assert gen == times[slot]
        total += n
        state = ring.ring_state()
        assert ring.write_count == state.write_count == total
        assert len(ring.written) == state.written == len(times) and set(ring.written) == set(times)
        assert ring.cursor == state.cursor == (-1 if kind.sharded else total % cap)
    assert ring.wait_for(write_count=total, timeout=0).write_count == total
    s = ring.sample(64, torch.Generator().manual_seed(0))
    for slot, gen, tag in zip(s.indices.tolist(), s.generations.tolist(), s.td["tag"].tolist()):
        assert gen == times[slot] and tag == holds[slot]
    # a learner writes back where the slot still holds what it sampled; rows an actor rewrote since are skipped
    w = ring.extend(rows(torch.arange(500, 504)))
    newer = set(w.indices.tolist())
    applied = ring.update_if(s.indices, s.generations, rows(-1 - s.indices))
    assert applied.tolist() == [i not in newer for i in s.indices.tolist()]


# -- priorities ----------------------------------------------------------------------------------


def chi2_bound(df: int, z: float = 3.719016) -> float:
    """The chi-square value with ``df`` degrees of freedom exceeded with probability 1e-4 (Wilson-Hilferty;
    ``z``: the standard normal's 1 - 1e-4 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sample_frequencies_follow_priority_to_the_alpha(kind):
    cap, alpha = 12, 0.7
    ring = kind.make(cap)
    ring.enable_priorities(alpha=alpha)
    w = ring.extend(rows(torch.arange(cap)), priority=torch.arange(1, cap + 1, dtype=torch.float64))
    prio = torch.zeros(cap, dtype=torch.float64)
    prio[w.indices] = torch.arange(1, cap + 1, dtype=torch.float64)
    changed = torch.tensor([0, 5, 11])
    assert ring.update_priority(changed, torch.tensor([0.0, 40.0, 0.5])).all()
    prio[changed] = torch.tensor([0.0, 40.0, 0.5], dtype=torch.float64)
    expected = prio**alpha / (prio**alpha).sum()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(cap, dtype=torch.float64)
    for _ in range(10):
        s = ring.sample(1000, gen)
        assert isinstance(s, PrioritizedSample)
        assert torch.allclose(s.probabilities.double(), expected[s.indices], rtol=1e-4)
        counts += torch.bincount(s.indices, minlength=cap).double()
    assert counts[changed[0]] == 0  # priority 0: never drawn
    assert chi_square(counts, expected) < chi2_bound(int((expected > 0).sum()) - 1)


# -- the rate limiter ----------------------------------------------------------------------------


def calls_before_refusal(call: Callable[[int], Any], most: int) -> int:
    """How many of ``call(0)``, ``call(1)``, ... went through before the first refused with TimeoutError."""
    for i in range(most):
        try:
            call(i)
        except TimeoutError:
            return i
    pytest.fail(f"{most} calls went through: nothing held them")


def test_the_rate_limiter_holds_writers_and_readers(kind):
    ring = kind.make(30)
    ring.set_rate_limit(min_size=30)
    ring.append(rows(torch.tensor([0]))[0])
    with pytest.raises(TimeoutError):  # fewer than min_size items (a shard: fewer than its share)
        ring.sample(1, timeout=0)
    ring.extend(rows(torch.arange(1, 30)))
    assert ring.sample(4, timeout=0).indices.numel() == 4
    ring.clear_rate_limit()
    ring.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=3.0)  # inserts counted from now
    admitted = calls_before_refusal(lambda i: ring.append(rows(torch.tensor([100 + i]))[0], timeout=0), 30)
    assert 1 <= admitted <= 12, admitted  # writers ran ahead of the samples: held within the buffer (+ a batch per shard)
    before = ring.write_count
    with pytest.raises(TimeoutError):
        ring.append(rows(torch.tensor([999]))[0], timeout=0)
    assert ring.write_count == before  # a refused call wrote nothing
    sampled = calls_before_refusal(lambda i: ring.sample(1, timeout=0), 200)
    assert 1 <= sampled <= admitted + 12, (sampled, admitted)  # readers ran ahead of the inserts: held
    ring.append(rows(torch.tensor([1000]))[0], timeout=0)  # the samples made room for a writer
    ring.clear_rate_limit()
    ring.extend(rows(torch.arange(2000, 2010)), timeout=0)
    for _ in range(20):
        ring.sample(5, timeout=0)


# -- waits and deadlines --------------------------------------------------------------------------


def test_waits_end_at_their_deadline_with_timeout_error(kind):
    ring = kind.make(8)
    nothing_left(ring)  # pop(timeout=0) on an empty ring: at once
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        ring.pop(2, timeout=0.2)
    with pytest.raises(TimeoutError):
        ring.sample(1, timeout=0)  # an empty ring has nothing to draw: it waits, up to the deadline
    with pytest.raises(ValueError):
        ring.sample(1)  # without a deadline or min_size: no waiting, ValueError
    with pytest.raises(TimeoutError):
        ring.wait_for(written=1, timeout=0.1)
    assert time.monotonic() - start < HANG
    ring.append(rows(torch.tensor([7]))[0])
    assert ring.wait_for(written=1, timeout=0).written == 1
    with pytest.raises(TimeoutError):
        ring.wait_for(write_count=2, timeout=0)
    assert ring.pop(1, timeout=0).td["tag"].tolist() == [7]


# -- resent calls ---------------------------------------------------------------------------------


def test_a_resent_call_takes_effect_once(kind, monkeypatch):
    """The same extend sent twice under one request id writes once and answers alike; the same pop
    sent twice gets the same items. Through ``request_id=`` where the store takes it; else through the
    path a lost reply's resend takes (one id per call, sent again with each attempt)."""
    ring = kind.make(8)
    rid, pop_rid = uuid.uuid4().hex, uuid.uuid4().hex  # ids as the store makes them: 128 random bits, hex
    if "request_id" in inspect.signature(ring.extend).parameters:
        first = ring.extend(rows(torch.arange(3)), request_id=rid)
        again = ring.extend(rows(torch.arange(3)), request_id=rid)
    else:
        monkeypatch.setattr(tdstore._ring.extend, "request_id", lambda: rid)
        if kind.sharded:
            ring._next = 0  # a resend goes where its call went: the same shard
        first = ring.extend(rows(torch.arange(3)))
        if kind.sharded:  # as before the first call: its shard and the counts it was placed by
            ring._next, ring._rw = 0, [0] * len(ring.shards)
        again = ring.extend(rows(torch.arange(3)))
        monkeypatch.undo()
    assert torch.equal(first.indices, again.indices) and torch.equal(first.generations, again.generations)
    assert ring.write_count == 3
    # a pop resent under its id: the shard's pop (what ShardedRing sends again), or the store's own
    one = ring.shards[0] if kind.sharded else ring
    took = one.pop_items(2, timeout=0, _request=pop_rid)
    assert one.pop_items(2, timeout=0, _request=pop_rid).td["tag"].tolist() == took.td["tag"].tolist()
    assert ring.ring_state().write_count == 3 and len(tags_of(drain(kind, ring, 1, 5))) == 1
    nothing_left(ring)


# -- MemoryError only when the data would not fit ------------------------------------------------------

ROW_FLOATS = 16 * 1024 - 4  # rows of ~64 KiB
ROW_BYTES = ROW_FLOATS * 4 + 8
SLACK = 3 << 19  # 1.5 MiB: what a write may allocate beyond its bytes (a string's growth, key overhead)


def big_rows(lo: int, n: int) -> TensorDict:
    t = torch.arange(lo, lo + n)
    return TensorDict(tag=t, obs=t.float().unsqueeze(-1).expand(n, ROW_FLOATS).clone(), batch_size=[n])


@pytest.mark.parametrize("name", ["lazy", "dense", "sharded"])
def test_memory_error_only_when_the_data_would_not_fit(name):
    """On one ``noeviction`` server of 16 MB, a ring of 250 rows of 64 KiB is filled with extends each
    of which fits by ``INFO memory`` (used + what it allocates + 1.5 MiB <= maxmemory, where a write
    that starts a 4 MiB segment allocates all of it): none may raise MemoryError. (A sharded ring
    here: one shard, on a cluster of one node.)"""
    args = ("--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
    with EmbeddedCluster(nodes=1, extra_args=args) if name == "sharded" else EmbeddedServer(extra_args=args) as srv:
        client = srv.node_client(0) if name == "sharded" else srv.client()
        count = 250
        if name == "dense":
            ring: Any = TensorDictStore(batch_size=[count], url=srv.url)
        else:
            ring = (ShardedRing if name == "sharded" else LazyStackedTensorDictStore)(count=count, url=srv.url)
        written = 0
        while written < count:
            info = client.info("memory")
            free = info["maxmemory"] - info["used_memory"]
            n = min(64, (free - SLACK) // ROW_BYTES, count - written)
            seg = 64  # rows per 4 MiB segment: a write that starts a segment allocates all of it
            new_segments = -(-(written + n) // seg) - (-(-written // seg))
            if n >= 1 and new_segments * (4 << 20) + SLACK > free:
                n = seg * -(-written // seg) - written  # only the rows the allocated segments hold
            if n < 1:
                break
            ring.extend(big_rows(written, n))  # it fits: no MemoryError
            written += n
        assert written > count // 2 and ring.write_count == written
        ring.clear_redis()


# -- stats ----------------------------------------------------------------------------------------


def test_stats_count_what_the_calls_did(kind):
    ring = kind.make(16)
    assert ring.stats()["distinct_sampled"] is None  # off by default (its cost)
    ring.track_distinct()
    first = ring.stats()
    assert first["capacity"] == 16 and first["written"] == first["inserted"] == first["sampled"] == first["popped"] == 0
    ring.extend(rows(torch.arange(6)))
    ring.extend(rows(torch.arange(6, 9)))
    drawn = [ring.sample(5), ring.sample(4)]  # not full yet: read.lua draws, and counts the rows' ages
    popped = drain(kind, ring, 4, 4)
    st = ring.stats()
    assert st["inserted"] == st["write_count"] == st["written"] == 9
    assert st["sampled"] == 9 and st["popped"] == 4 and st["unread"] == 5
    # every row sampled at least once, counted once (a sharded ring's rows are its shards' rows); none overwritten
    assert st["distinct_sampled"] == st["sampled_resident"] == len({int(i) for got in drawn for i in got.indices})
    assert st["overwritten_unsampled"] == 0
    if not kind.sharded:  # one ring: the age of the row in slot s is rw - 1 - s ring writes (a full shard's
        assert st["age_rows"] == 9  # uniform sample is read as a transaction, its ages not counted)
        ages = [8 - int(i) for got in drawn for i in got.indices]
        assert st["age_sum"] == sum(ages) and st["age_max"] == max(ages) and st["age_mean"] == sum(ages) / 9
    assert sum(p.indices.numel() for p in popped) == 4
    if not kind.sharded:  # one ring's lease table and clock (the sharded lease counts: test_sharded_faults)
        kept = ring.pop(2, lease=LONG)
        lapsing = ring.pop(2, lease=SHORT)
        end = time.monotonic() + HANG
        while kind.server_ms() <= lapsing.deadline_ms:  # the server's clock past the lease: no timer raced
            assert time.monotonic() < end
            time.sleep(0.02)
        again = ring.pop(2, lease=LONG)
        assert ring.ack(kept) + ring.ack(again) == 4
        st = ring.stats()
        assert (st["popped"], st["acknowledged"], st["expired"], st["redelivered"], st["leased"]) == (10, 4, 2, 2, 0)
    ring.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=3.0)
    admitted = calls_before_refusal(lambda i: ring.append(rows(torch.tensor([100 + i]))[0], timeout=0), 30)
    held = ring.stats()
    assert held["inserted"] == 9 + admitted and held["limiter"]["samples_per_insert"] == 1.0
    sampled = calls_before_refusal(lambda i: ring.sample(1, timeout=0), 200)
    after = ring.stats()
    assert after["sampled"] == 9 + sampled
    # a WAIT reply is counted; a sharded ring picks a shard with room from the shards' counters, and may refuse
    # with no shard asked
    assert kind.sharded or (held["held_writes"] >= 1 and after["held_samples"] >= 1)
    json.dumps(after)  # a plain dict
    if kind.sharded:
        assert len(after["shards"]) == len(ring.shard_offsets) and sum(s["sampled"] for s in after["shards"]) == after["sampled"]


def test_marks_and_sampling_policies_as_documented(kind):
    """``marks``, ``set_marks_base``, ``counting_in_place``, ``sampling_policies`` and ``restore_sampling_policies``:
    what an adapter (``tdstore.torchrl``) keeps of a ring, read and given back through the ring itself."""
    ring = kind.make(12)
    ring.extend(rows(torch.arange(5)))
    assert ring.marks() == (5, 0, 0, 0)
    with ring.counting_in_place():
        ring[torch.tensor([0, 1])] = rows(torch.tensor([50, 51]))
    ring[torch.tensor([2])] = rows(torch.tensor([52]))  # not counted: outside counting_in_place
    ring.set_marks_base(3, 40)
    m = ring.marks()
    assert (m.rw, m.gb, m.wb) == (ring.write_count, 3, 40)  # (5, but on a sharded ring a shard written by index only
    # counts as full: the ring's own rule, ``write_count`` says the same)
    assert m.tr == 1 if not kind.sharded else m.tr >= 1  # (sharded: one per shard the counted write touched)
    ring.enable_priorities(0.5, max_times_sampled=4)
    ring.set_queue(True)
    policies = ring.sampling_policies()
    assert len(policies) == (len(ring.shard_offsets) if kind.sharded else 1)
    other = kind.make(12)
    other.restore_sampling_policies(policies)
    assert other.sampling_policies() == policies
    with pytest.raises(ValueError, match="polic"):
        other.restore_sampling_policies([*policies, *policies])
    assert other.sampling_policies() == policies  # refused before anything was changed


def test_sample_seen_draws_written_slots_and_filled_counts_them(kind):
    """``sample_seen`` (a learner's uniform sample: drawn on the client on one node) draws written slots only, with
    their rows and generations, new rows from a later call on; ``filled`` is ``len(written)``, no round trip once full."""
    ring = kind.make(8)
    with pytest.raises(ValueError):
        ring.sample_seen(4)  # nothing written yet: as sample
    assert ring.filled() == 0
    ring.extend(rows(torch.arange(3)))
    gen = torch.Generator().manual_seed(0)
    for n, more in ((3, 5), (8, 0)):
        got = ring.sample_seen(256, gen)
        written = set(ring.written)
        assert len(written) == ring.filled(fresh=True)
        assert set(got.indices.tolist()) <= written
        assert torch.equal(got.td["tag"].reshape(-1), ring[got.indices]["tag"].reshape(-1))  # the rows of those slots
        if not kind.sharded or n == 3:  # (a sharded ring's shard may wrap before the ring is full: SHARDED_EXTEND)
            assert len(written) == n and got.generations.tolist() == [1] * 256
        if more:
            ring.extend(rows(torch.arange(3, 3 + more)))
    got = ring.sample_seen(256, gen)
    assert len(set(got.indices.tolist())) > 3  # the rows written since the first call are drawn too
    if not kind.sharded:  # (a sharded ring's shards fill at their own pace)
        assert ring.filled() == 8
        ring.extend(rows(torch.arange(8, 16)))
        got = ring.sample_seen(64, gen)
        assert got.generations.tolist() == [2] * 64 and ring.filled() == 8


def test_slices_stay_inside_one_trajectory_or_the_kind_says_why(kind):
    ring = kind.make(40)
    if kind.sharded:
        with pytest.raises(NotImplementedError, match="sharded ring keeps no episode index"):
            ring.set_trajectories(traj_key="episode")
        with pytest.raises(NotImplementedError, match="sharded ring"):
            ring.sample_slices(8, num_slices=2)
        assert ring.trajectories is None
        return
    ring.set_trajectories(traj_key="episode")
    for first in range(0, 60, 6):  # wraps: episodes of 6 rows, the oldest overwritten
        td = rows(torch.arange(first, first + 6))
        td["episode"] = torch.full((6,), first // 6)
        ring.extend(td)
    got = ring.sample_slices(12, num_slices=3, generator=torch.Generator().manual_seed(0))
    episode, tag = got.td["episode"].view(3, 4), got.td["tag"].view(3, 4)
    assert (episode == episode[:, :1]).all() and (tag.diff(dim=1) == 1).all()
    assert got.info["truncated"].view(3, 4)[:, -1].all() and (got.generations > 0).all()
    with pytest.raises(ValueError, match="no trajectory of at least 7 rows"):
        ring.sample_slices(14, num_slices=2)
