"""Leased pops (``pop(n, lease=S)`` and ``ack``): at-least-once delivery with acknowledgement.

Behaviour on redis-server and fakeredis: a lease, its ack, redelivery after the lease runs out
(in write order, flagged, counted), a double ack, an ack after expiry, a resend of a leased pop
with its receipt, leased items overwritten (reported as lost), queue mode keeping leased items,
one round trip each, bad input. Processes on the real server: a reader killed with SIGKILL while
it holds a lease, and four writers with three leased readers (one killed) acknowledging every
item exactly once.

No test races a timer: "not redelivered" uses leases of minutes, and a lease is known to have run
out by reading the server's clock (``TIME``) past the deadline the pop returned, or is made to run
out by moving its deadline to the past by hand.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import fakeredis
import pytest
import redis
import torch
from helpers import load_tool, mp_context, round_trips, top_level_commands
from tensordict import TensorDict

import tdstore._ring.leases
from tdstore import LazyStackedTensorDictStore, LeaseLostError, QueueOverrunError
from tdstore._inspect.audit import audit
from tdstore._inspect.headers import list_stores
from tdstore._ring.leases import LeasedSample

pytestmark = [pytest.mark.ring, pytest.mark.usefixtures("replies_are_never_cut_short")]

LONG = 600.0  # seconds: a lease that never runs out during a test
SHORT = 0.2  # seconds: a lease the test waits out (on the server's clock) before its next call


class Both:
    """A store factory on one engine: the real redis-server or fakeredis."""

    def __init__(self, name: str, make_client, url: str | None) -> None:
        self.name, self.make_client, self.url = name, make_client, url

    def kwargs(self) -> dict:
        return {"url": self.url, "prefix": "lease"} if self.url else {"client": self.make_client(), "prefix": "lease"}

    def store(self, count: int, **kw) -> LazyStackedTensorDictStore:
        return LazyStackedTensorDictStore(count=count, **self.kwargs(), **kw)


@pytest.fixture(params=["redis", "fakeredis"])
def both(request, redis_server) -> Both:
    if request.param == "redis":
        return Both("redis", redis_server.client, redis_server.url)
    server = fakeredis.FakeServer()
    return Both("fakeredis", lambda: fakeredis.FakeRedis(server=server), None)


def items(lo: int, n: int, writer: int = 0) -> list[TensorDict]:
    """Items whose content names them: ``(writer, seq)``, and tokens of a length that varies."""
    return [
        TensorDict(who=torch.tensor([writer, seq]), tokens=torch.arange(1 + seq % 3) + 100 * seq, batch_size=[])
        for seq in range(lo, lo + n)
    ]


def seqs(got) -> list[int]:
    return [int(w[1]) for w in got.td["who"]]


def server_ms(store) -> int:
    t = store._engine.client.time()
    return int(t[0]) * 1000 + int(t[1]) // 1000


def wait_out(store, *leases: LeasedSample) -> None:
    """Until the server's clock is past every lease's deadline (no timer raced: the clock is read)."""
    end = time.monotonic() + 60
    while server_ms(store) <= max(g.deadline_ms for g in leases):
        assert time.monotonic() < end, "the server's clock did not move past the lease"
        time.sleep(0.02)


def header(store) -> dict:
    raw = store._engine.client.hgetall(store._engine.keys.meta)
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_a_leased_pop_returns_its_receipt_and_an_ack_settles_it(both):
    store = both.store(8)
    store.extend(items(0, 5))
    got = store.pop(3, lease=LONG)
    assert isinstance(got, LeasedSample)
    assert seqs(got) == [0, 1, 2] and got.write_numbers.tolist() == [0, 1, 2] and got.indices.tolist() == [0, 1, 2]
    assert got.generations.tolist() == [1, 1, 1] and got.deliveries.tolist() == [1, 1, 1] and not got.redelivered.any()
    assert got.td[1]["tokens"].tolist() == [100, 101]
    assert got.receipt.write_numbers == (0, 1, 2) and got.deadline_ms > server_ms(store)
    assert seqs(store.pop(10, lease=LONG)) == [3, 4]  # leased items go to nobody else
    with pytest.raises(TimeoutError, match="no unread item"):
        store.pop(1, lease=LONG, timeout=0)
    assert store.ack(got) == 3
    assert store.ack(got.receipt) == 3  # twice: the same answer
    assert store.ack(got.receipt.id) == 3
    with pytest.raises(TimeoutError):
        store.pop(1, timeout=0)
    store.clear_redis()


def test_unacknowledged_items_come_back_in_write_order_flagged_and_counted(both):
    store = both.store(16)
    store.extend(items(0, 6))
    a = store.pop(2, lease=LONG)
    b = store.pop(2, lease=LONG)
    kept = store.pop(1, lease=LONG)
    # a's and b's leases run out (their deadlines moved to the past, as time would; no short lease
    # races the pops above), b's first: its items are still handed out after a's, in write order
    both.make_client().zadd(store._engine.keys.lease_keys[1], {b.receipt.id: 0, a.receipt.id: 1})
    again = store.pop(10, lease=SHORT)
    assert seqs(again) == [0, 1, 2, 3, 5]  # the expired ones first, in write order, then the unread one
    assert again.deliveries.tolist() == [2, 2, 2, 2, 1] and again.redelivered.tolist() == [True] * 4 + [False]
    wait_out(store, again)
    third = store.pop(10)  # a plain pop takes them too, before newer items
    assert seqs(third) == [0, 1, 2, 3, 5]
    store.extend(items(6, 1))
    last = store.pop(10, lease=LONG)
    assert seqs(last) == [6] and last.deliveries.tolist() == [1]  # item 4 is still leased (kept)
    assert store.ack(kept) == 1 and store.ack(last) == 1
    store.clear_redis()


def test_leases_on_every_backend(backend):
    """Redis, fakeredis and a cluster (the lease keys share the store's hash tag)."""
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.extend(items(0, 4))
    a = store.pop(2, lease=SHORT)
    wait_out(store, a)
    with store.pop(3, lease=LONG) as b:
        assert seqs(b) == [0, 1, 2] and b.deliveries.tolist() == [2, 2, 1]
    assert seqs(store.pop(5)) == [3]
    store.clear_redis()
    assert not [k for k in backend.keys() if store.td_id.encode() in k]


def test_an_ack_after_the_lease_ran_out(both):
    store = both.store(8)
    store.extend(items(0, 4))
    a = store.pop(3, lease=SHORT)
    wait_out(store, a)
    b = store.pop(1, lease=LONG)  # takes item 0 of the expired lease
    assert seqs(b) == [0] and b.deliveries.tolist() == [2]
    with pytest.raises(LeaseLostError, match="1 of its items") as err:
        store.ack(a)  # 1 and 2 were still free: settled; 0 is b's
    assert err.value.not_held == [0] and err.value.settled == 2
    with pytest.raises(LeaseLostError) as again:
        store.ack(a)  # the same answer twice
    assert again.value.not_held == [0] and again.value.settled == 2
    assert seqs(store.pop(10, lease=LONG)) == [3]  # 1 and 2 are settled: never handed out again
    assert store.ack(b) == 1
    store.extend(items(4, 1))
    c = store.pop(1, lease=SHORT)
    wait_out(store, c)
    assert store.ack(c) == 1  # expired, but nobody took it meanwhile: settled
    with pytest.raises(TimeoutError):
        store.pop(1, lease=LONG, timeout=0)
    store.clear_redis()


def test_with_block_acks_on_a_clean_exit_only(both):
    store = both.store(8)
    store.extend(items(0, 2))
    with store.pop(1, lease=LONG) as got:  # acknowledged while it holds the item
        assert seqs(got) == [0]
    with pytest.raises(RuntimeError, match="boom"), store.pop(1, lease=SHORT) as failed:
        raise RuntimeError("boom")
    wait_out(store, failed)
    back = store.pop(5, lease=LONG)
    assert seqs(back) == [1] and back.redelivered.tolist() == [True]  # item 0 was acknowledged
    store.clear_redis()


def test_a_resent_leased_pop_gets_the_same_items_and_takes_no_more(both, monkeypatch):
    store = both.store(8)
    store.extend(items(0, 6))
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "resent-1")
    first = store.pop(2, lease=LONG)
    again = store.pop(2, lease=LONG)  # what a resend after a lost reply sends: the same receipt
    assert seqs(again) == seqs(first) == [0, 1] and again.deliveries.tolist() == [1, 1]
    assert again.deadline_ms == first.deadline_ms
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "resent-2")
    assert seqs(store.pop(10, lease=LONG)) == [2, 3, 4, 5]
    assert store.ack(first) == 2
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "resent-1")
    with pytest.raises(ValueError, match="acknowledged already"):
        store.pop(2, lease=LONG)
    store.clear_redis()


def test_a_reply_cut_by_the_network_is_resent_without_taking_more(redis_server):
    """The proxy cuts the connection right after the server ran the leased pop: redis-py's retry
    sends it again (same receipt), and the reader gets the same items; nothing is skipped."""
    faults = load_tool("faults")
    with faults.CuttingProxy(redis_server.url) as proxy:
        store = LazyStackedTensorDictStore(count=8, url=proxy.url, prefix="lease")
        store.extend(items(0, 6))
        store.pop(1, lease=LONG).ack()  # scripts loaded, leases on
        proxy.arm(faults.Cut("reply", ("EVALSHA",), 0))
        try:
            got = store.pop(2, lease=LONG)
        except redis.ConnectionError:  # a client that does not retry: the caller sends it again itself
            pytest.skip("this redis-py does not resend after a lost reply")
        assert proxy.disarm().landed.is_set()
        assert seqs(got) == [1, 2]
        assert header(store)["rr"] == "3"
        assert seqs(store.pop(10, lease=LONG)) == [3, 4, 5]
        store.clear_redis()


def test_leased_items_overwritten_are_reported_lost_never_other_bytes(both):
    store = both.store(4)
    store.extend(items(0, 4))
    a = store.pop(2, lease=SHORT)
    store.extend(items(4, 2))  # slots 0 and 1 now hold items 4 and 5
    wait_out(store, a)
    with pytest.raises(QueueOverrunError) as err:
        store.pop(4, lease=LONG)
    assert err.value.lost == 2
    assert seqs(store.pop(10, lease=LONG)) == [2, 3, 4, 5]
    store.extend(items(6, 4))
    store.extend(items(10, 1))  # laps an unread item (6) too: reported as before
    with pytest.raises(QueueOverrunError) as lap:
        store.pop(1, lease=LONG)
    assert lap.value.lost == 1
    assert seqs(store.pop(10, lease=LONG)) == [7, 8, 9, 10]
    store.clear_redis()


def test_queue_mode_counts_leased_items_as_unread(both):
    store = both.store(4)
    store.set_queue(True)
    store.extend(items(0, 4))
    got = store.pop(2, lease=LONG)
    with pytest.raises(TimeoutError, match="queue is full"):
        store.extend(items(4, 1), timeout=0)  # items 0 and 1 are leased, not acknowledged
    writer = threading.Thread(target=lambda: store.extend(items(4, 2), timeout=60))
    writer.start()
    store.ack(got)  # the ack frees the slots, and wakes the waiting writer
    writer.join(timeout=60)
    assert not writer.is_alive() and store.write_count == 6
    assert seqs(store.pop(10, lease=LONG)) == [2, 3, 4, 5]
    store.clear_redis()


def test_a_plain_pop_on_a_handle_that_never_saw_a_lease_takes_expired_items(both):
    store = both.store(8)
    store.extend(items(0, 3))
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **both.kwargs())
    assert not other._engine.header.leased
    a = store.pop(2, lease=SHORT)
    wait_out(store, a)
    assert seqs(other.pop(10)) == [0, 1, 2]  # its stale header is refused (kv moved): it pops through the leases
    with pytest.raises(LeaseLostError):
        store.ack(a)
    store.clear_redis()


def test_bad_input_raises_and_leaves_the_store_intact(both):
    store = both.store(8)
    store.extend(items(0, 3))
    before = header(store)
    for lease in (0, -1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="lease"):
            store.pop(1, lease=lease)
    with pytest.raises(ValueError, match="batch_size"):
        store.pop(0, lease=1.0)
    with pytest.raises(ValueError, match="no lease under receipt"):
        store.ack("0123456789abcdef")
    with pytest.raises(ValueError, match="receipt"):
        store.ack("not a receipt!")
    with pytest.raises(ValueError, match="receipt"):
        store.ack(42)
    assert header(store) == before
    plain = store.pop(1)
    with pytest.raises(ValueError):
        store.ack(plain)  # a plain pop has no receipt
    store.clear_redis()


def test_the_lease_keys_go_with_the_store(both):
    store = both.store(8, ttl=3600)
    store.extend(items(0, 3))
    held = store.pop(1, lease=LONG)
    a = store.pop(1, lease=SHORT)
    wait_out(store, a)
    store.pop(1, lease=LONG).ack()
    held.ack()
    store.pop(1, lease=LONG)  # something outstanding: every lease key exists
    client = both.make_client()
    lease_keys = store._engine.keys.lease_keys
    present = [k for k in lease_keys if client.exists(k)]
    assert present and all(0 < client.pttl(k) <= 3600_000 for k in present)
    store.persist()
    assert all(client.pttl(k) == -1 for k in present)
    if both.name == "redis":
        assert audit(client, "lease", store.td_id).intact
        listed = [s for s in list_stores(client, "lease").stores if s.td_id == store.td_id]
        assert listed and not list_stores(client, "lease").unreadable
    store.clear_redis()
    assert not any(client.exists(k) for k in lease_keys)


def test_one_round_trip_each(real):
    store = LazyStackedTensorDictStore(count=16, **real.kwargs())
    store.extend(items(0, 10))
    store.pop(1, lease=LONG).ack()  # scripts loaded, leases on, header current
    got: list = []
    cmds = round_trips(top_level_commands(real.client, lambda: got.append(store.pop(3, lease=LONG))))
    assert cmds == ["evalsha"], cmds
    before = real.commandstats()
    assert store.ack(got[0]) == 3
    store.pop(2)  # a plain pop on a leased store: one call too
    after = real.commandstats()
    assert after["evalsha"] - before["evalsha"] == 2
    store.clear_redis()


def test_a_pop_reclaims_a_bounded_number_of_expired_leases(real):
    """64 expired leases at most per pop (documented in lua/README.md): the rest come with later pops."""
    store = LazyStackedTensorDictStore(count=256, **real.kwargs())
    store.extend(items(0, 100))
    leases = [store.pop(1, lease=LONG) for _ in range(100)]
    client = real.client()  # every lease ran out (its deadline moved to the past, as time would)
    client.zadd(store._engine.keys.lease_keys[1], {g.receipt.id: k for k, g in enumerate(leases)})
    first = store.pop(100, lease=LONG)
    assert len(seqs(first)) == 64 and seqs(first) == sorted(seqs(first))
    second = store.pop(100, lease=LONG)
    assert sorted(seqs(first) + seqs(second)) == list(range(100))
    store.clear_redis()


def test_leases_replicate_with_the_primarys_clock(tmp_path):
    """TIME is read in the script; what reaches a replica is the script's effects (deadlines as
    numbers), so the replica holds the same lease table, byte for byte."""
    from tdstore.server import EmbeddedServer

    with EmbeddedServer(unix_socket=False) as primary:
        with EmbeddedServer(unix_socket=False, extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
            rc = replica.client()
            end = time.monotonic() + 60
            while rc.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < end, "the replica did not sync"
                time.sleep(0.05)
            store = LazyStackedTensorDictStore(count=8, url=primary.url, prefix="lease")
            store.extend(items(0, 4))
            a = store.pop(2, lease=SHORT)
            wait_out(store, a)
            b = store.pop(3, lease=LONG)
            assert seqs(b) == [0, 1, 2]
            pc = primary.client()
            assert pc.wait(1, 30_000) == 1
            for key in [store._engine.keys.meta, *store._engine.keys.lease_keys]:
                kind = pc.type(key)
                assert kind == rc.type(key)
                assert kind != b"none" or key.endswith(":lq")  # nothing waits for redelivery now
                if kind == b"hash":
                    assert pc.hgetall(key) == rc.hgetall(key)
                elif kind == b"zset":
                    assert pc.zrange(key, 0, -1, withscores=True) == rc.zrange(key, 0, -1, withscores=True)
            assert rc.zscore(store._engine.keys.lease_keys[1], b.receipt.id) == b.deadline_ms


# -- processes on the real server ----------------------------------------------------------------


def _holder(td_id: str, url: str, holding, out: str) -> None:
    """Pop under a lease, say which items it holds, then hang until killed."""
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix="lease")
    got = store.pop(3, lease=2.0, timeout=60)
    Path(out).write_text(" ".join(map(str, got.write_numbers.tolist())))
    holding.set()
    time.sleep(600)


def test_a_reader_killed_while_holding_a_lease_loses_nothing(redis_server, tmp_path):
    store = LazyStackedTensorDictStore(count=16, url=redis_server.url, prefix="lease")
    store.extend(items(0, 3))
    ctx = mp_context()
    holding = ctx.Event()
    p = ctx.Process(target=_holder, args=(store.td_id, redis_server.url, holding, str(tmp_path / "held")))
    p.start()
    try:
        assert holding.wait(120)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.join(60)
    held = [int(w) for w in (tmp_path / "held").read_text().split()]
    assert held == [0, 1, 2]
    got = store.pop(10, lease=LONG, timeout=60)  # waits for the dead reader's lease to run out
    assert got.write_numbers.tolist() == held and got.redelivered.all()
    assert store.ack(got) == 3
    store.clear_redis()


WRITERS, PER_WRITER, BATCH = 4, 150, 5


def _acked(logs: list[str]) -> list[str]:
    """Every ``writer:seq`` the readers logged as acknowledged (whole lines only)."""
    out = []
    for log in logs:
        if os.path.exists(log):
            text = Path(log).read_text()
            out += [ln.split()[0] for ln in text[: text.rfind("\n") + 1].splitlines() if not ln.startswith("held")]
    return out


def _writer(td_id: str, url: str, w: int) -> None:
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix="lease")
    for lo in range(0, PER_WRITER, BATCH):
        store.extend(items(lo, BATCH, writer=w), timeout=120)


def _reader(td_id: str, url: str, log: str, stop, victim: bool, holding) -> None:
    """Pop under leases, ack, and log what each ack settled (one line per item, appended at once:
    a SIGKILL loses nothing logged). The victim hangs holding its third batch."""
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix="lease")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    batches = 0
    while not stop.is_set():
        try:
            got = store.pop(4, lease=3.0, timeout=1)
        except TimeoutError:
            continue
        batches += 1
        if victim and batches == 3:
            os.write(fd, ("held " + " ".join(f"{a}:{b}" for a, b in got.td["who"].tolist()) + "\n").encode())
            holding.set()
            time.sleep(600)
        who = got.td["who"].tolist()
        try:
            store.ack(got)
            lost: set[int] = set()
        except LeaseLostError as err:  # ran out before the ack (a slow machine): another reader settles those
            lost = set(err.not_held)
        lines = [f"{a}:{b} {d}\n" for (a, b), w, d in zip(who, got.write_numbers.tolist(), got.deliveries.tolist()) if w not in lost]
        os.write(fd, "".join(lines).encode())
    os.close(fd)


@pytest.mark.slow
def test_four_writers_three_leased_readers_one_killed_every_item_acknowledged_once(redis_server, tmp_path):
    store = LazyStackedTensorDictStore(count=32, url=redis_server.url, prefix="lease")
    store.set_queue(True)  # writers wait for readers: nothing is overwritten
    store.extend(items(0, 1, writer=99))  # creates the keys
    store.pop(1, lease=LONG).ack()
    ctx = mp_context()
    stop, holding = ctx.Event(), ctx.Event()
    logs = [str(tmp_path / f"reader{r}") for r in range(3)]
    readers = [ctx.Process(target=_reader, args=(store.td_id, redis_server.url, logs[r], stop, r == 2, holding)) for r in range(3)]
    writers = [ctx.Process(target=_writer, args=(store.td_id, redis_server.url, w)) for w in range(WRITERS)]
    for p in readers + writers:
        p.start()
    try:
        assert holding.wait(180)
        os.kill(readers[2].pid, signal.SIGKILL)  # mid-run, holding a lease
        for p in writers:
            p.join(300)
            assert p.exitcode == 0
        want = {(w, s) for w in range(WRITERS) for s in range(PER_WRITER)}
        end = time.monotonic() + 180
        while len(set(_acked(logs))) < len(want) and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        stop.set()
        for p in readers:
            if p.is_alive() and p is not readers[2]:
                p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    acked_pairs = [tuple(map(int, a.split(":"))) for a in _acked(logs)]
    assert sorted(acked_pairs) == sorted(want), "every item acknowledged exactly once"
    held = Path(logs[2]).read_text().splitlines()[-1].split()[1:]
    lines = {ln.split()[0]: int(ln.split()[1]) for log in logs for ln in Path(log).read_text().splitlines() if not ln.startswith("held")}
    assert held and all(lines[h] >= 2 for h in held)  # the killed reader's items came again, counted
    store.clear_redis()


def test_a_hand_edited_lease_field_is_damage_and_a_read_only_handle_cannot_lease(both):
    store = both.store(4)
    store.set_queue(True)
    store.extend(items(0, 2))
    got = store.pop(1, lease=LONG)
    reader = LazyStackedTensorDictStore.from_store(td_id=store.td_id, readonly=True, **both.kwargs())
    with pytest.raises(PermissionError):
        reader.pop(1, lease=LONG)
    with pytest.raises(PermissionError):
        reader.ack(got)
    client = both.make_client()
    client.hset(store._engine.keys.meta, "lo", "-7")
    with pytest.raises(KeyError, match="header field lo"):  # StoreDamagedError
        store.extend(items(2, 1), timeout=0)
    client.hset(store._engine.keys.meta, "lo", "0")
    store.extend(items(2, 1), timeout=0)
    assert store.ack(got) == 1
    store.clear_redis()
