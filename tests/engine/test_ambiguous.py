"""Ambiguous timeouts are resolvable (issue 38, item 1).

A ring call whose deadline passes after its command was sent (written to the server, its reply not
read) may have run: it raises ``tdstore.AmbiguousTimeoutError`` carrying its request id, and
``err.retry()`` (or the same call with ``request_id=err.request_id``) sends it again under that id
and returns the first reply: the popped items (the same bytes, never other rows), the ``RingWrite``,
each applied once. A call whose deadline passed before anything of it was sent (a server that cannot
be reached, a wait that ran out after a ``WAIT`` reply) raises the plain ``TimeoutError``: it did not run.

The ambiguity is made deterministically, never by racing the machine: the test's own server is
stopped (SIGSTOP) before the call, so its command sits unanswered in the server's socket; or
another client's script holds the server (observed busy before the call is sent); or the server
pauses writers (``CLIENT PAUSE``). Once the server goes on, the state it reached is polled (an
observable state, not a timer). Lazy and dense stores both; the request-id keyword on fakeredis too.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from tensordict import TensorDict

from tdstore import AmbiguousTimeoutError, LazyStackedTensorDictStore, QueueOverrunError, TensorDictStore
from tdstore._ring import direct_extend as _direct
from tdstore.server import EmbeddedServer

pytestmark = pytest.mark.ring

KINDS = ["lazy", "dense"]
#: Elements of the big items (int32): 16 MiB each, far more than a reply read in ``MIN_SOCKET_S``
#: needs to be cut short on its own; the tests stop the server all the same, so the size never decides.
BIG = 4 << 20
#: A script of another client that holds the server this long (below busy-reply-threshold, 5 s).
BUSY_S = 3.0


def make(kind: str, count: int, **kwargs: Any) -> Any:
    if kind == "lazy":
        return LazyStackedTensorDictStore(count=count, **kwargs)
    return TensorDictStore(batch_size=[count], **kwargs)


def big(i: int) -> torch.Tensor:
    """Item ``i`` of the big ones: every element tells the item and its position."""
    return torch.arange(BIG, dtype=torch.int32) * 7 + i


def small(lo: int, n: int) -> TensorDict:
    tags = torch.arange(lo, lo + n)
    return TensorDict(obs=tags.to(torch.float32).unsqueeze(-1).expand(n, 3).clone(), tag=tags, batch_size=[n])


def wait_until(cond: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll ``cond`` (an observable state, not a timer) for at most ``limit`` seconds."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


@contextmanager
def stopped(srv: EmbeddedServer) -> Iterator[None]:
    """The server stopped (SIGSTOP) in the block: a command sent meanwhile waits in its socket, unanswered."""
    assert srv.pid is not None
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(srv.pid, signal.SIGCONT)


def read_cursor(srv: EmbeddedServer, store: Any) -> int:
    return int(srv.client().hget(_engine(store).keys.meta, "rr") or 0)


def _engine(store: Any) -> Any:
    return store._engine if isinstance(store, LazyStackedTensorDictStore) else store._ring_work().engine


def ambiguous(call: Callable[[], Any]) -> AmbiguousTimeoutError:
    with pytest.raises(AmbiguousTimeoutError) as info:
        call()
    err = info.value
    assert isinstance(err, TimeoutError) and not isinstance(err, redis.RedisError)
    assert "may have run" in str(err) and err.request_id in str(err)
    # caused by the late reply's redis-py error, as the deadline's TimeoutError was: a sharded ring's pop
    # tells a lost reply (sent again under its id) from a wait by that cause
    assert isinstance(err.__cause__, (redis.TimeoutError, redis.ConnectionError)), repr(err.__cause__)
    return err


# -- pops ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_pop_of_big_items_with_timeout_0_is_answered_again_with_the_same_items(server, kind):
    """The adversary's case: ``pop(1, timeout=0)`` on items of 16 MiB, its reply never read in time
    (the server stopped right after the command was sent). The pop ran once the server went on (the
    read cursor moved by 1); ``err.retry()`` returns that item, the same bytes, and takes nothing more;
    the reply cache keeps where the items were, not their bytes."""
    store = make(kind, 4, url=server.url, prefix="amb")
    for i in range(3):
        store.extend(TensorDict(x=big(i).unsqueeze(0), batch_size=[1]))
    assert store.pop(1, timeout=60).indices.tolist() == [0]  # the server knows the script (no NOSCRIPT below)
    with stopped(server):
        err = ambiguous(lambda: store.pop(1, timeout=0))
    wait_until(lambda: read_cursor(server, store) == 2, "the pop ran once the server went on")
    got = err.retry(timeout=60)
    assert got.indices.tolist() == [1] and got.generations.tolist() == [1]
    assert type(got.td) is TensorDict and torch.equal(got.td["x"][0], big(1))
    assert read_cursor(server, store) == 2  # taken once
    again = store.pop(1, request_id=err.request_id, timeout=60)  # the keyword: the same answer
    assert again.indices.tolist() == [1] and torch.equal(again.td["x"][0], big(1))
    nxt = store.pop(1, timeout=60)
    assert nxt.indices.tolist() == [2] and torch.equal(nxt.td["x"][0], big(2))
    replies = _engine(store).keys.replies
    assert server.client().memory_usage(replies) < 4096  # a few records of where items were, no item bytes


@pytest.mark.parametrize("kind", KINDS)
def test_a_pop_held_by_another_clients_long_script_is_answered_again(server, kind):
    """``pop(2, timeout=0.2)`` while another client's script holds the server (seen busy before the pop is
    sent): the pop runs after the script, and the retry returns its two items; the next pop goes on after them."""
    store = make(kind, 8, url=server.url, prefix="amb")
    store.extend(small(0, 6))
    assert store.pop(1, timeout=60).td["tag"].tolist() == [0]  # the server knows the script
    busy = redis.Connection(host="127.0.0.1", port=server.port)
    spin = "local e = tonumber(redis.call('TIME')[1]) + ARGV[1] while tonumber(redis.call('TIME')[1]) < e do end return 1"
    busy.send_command("EVAL", spin, 0, str(int(BUSY_S)))
    probe = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.05, retry=None)

    def answers() -> bool:
        try:
            probe.ping()
            return True
        except redis.TimeoutError:
            return False

    wait_until(lambda: not answers(), "the other client's script holds the server", limit=BUSY_S / 2)
    err = ambiguous(lambda: store.pop(2, timeout=0.2))
    assert busy.read_response() == 1
    busy.disconnect()
    wait_until(lambda: read_cursor(server, store) == 3, "the pop ran after the script")
    got = err.retry(timeout=60)
    assert got.indices.tolist() == [1, 2] and got.td["tag"].tolist() == [1, 2] and type(got.td) is TensorDict
    assert store.pop(2, timeout=60).td["tag"].tolist() == [3, 4]


@pytest.mark.parametrize("kind", KINDS)
def test_a_leased_pop_and_its_ack_are_answered_again(server, kind):
    """A leased pop whose reply was not read: the retry returns the items under the same receipt (the
    request id), taking nothing more; an ack likewise settles them once."""
    store = make(kind, 8, url=server.url, prefix="amb")
    store.extend(small(0, 5))
    assert store.ack(store.pop(1, lease=600, timeout=60).receipt) == 1  # the server knows the scripts
    with stopped(server):
        err = ambiguous(lambda: store.pop(2, lease=600, timeout=0))
    got = err.retry(timeout=60)
    assert got.receipt.id == err.request_id and got.td["tag"].tolist() == [1, 2] and got.deliveries.tolist() == [1, 1]
    with stopped(server):
        settle = ambiguous(lambda: store.ack(got.receipt, timeout=0))
    assert settle.retry(timeout=60) == 2
    assert store.pop(2, timeout=60).td["tag"].tolist() == [3, 4]  # the leased items were not handed out again


# -- writes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["write.lua", "direct"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_extend_sent_to_a_stopped_server_writes_once(server, kind, path, monkeypatch):
    """``extend(..., timeout=0.05)`` sent to a stopped server: once it goes on, the rows are written; the
    retry returns where they went and writes nothing more (``write_count`` moves once), through
    ``write.lua`` and through the direct path (rows as SETRANGEs in one transaction) alike."""
    if path == "write.lua":
        monkeypatch.setattr(_direct, "usable", lambda *_: False)
    store = make(kind, 16, url=server.url, prefix="amb")
    store.extend(small(0, 2))  # the same path as the extend below: the server knows its script
    with stopped(server):
        err = ambiguous(lambda: store.extend(small(10, 3), timeout=0.05))
    wait_until(lambda: store.write_count == 5, "the extend ran once the server went on")
    out = err.retry(timeout=60)
    assert out.indices.tolist() == [2, 3, 4] and out.generations.tolist() == [1, 1, 1]
    assert store.write_count == 5
    same = store.extend(small(10, 3), request_id=err.request_id, timeout=60)  # the keyword: the same answer
    assert same.indices.tolist() == [2, 3, 4] and store.write_count == 5
    assert store[2:5]["tag"].tolist() == [10, 11, 12]


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_held_by_client_pause_is_written_once(server, kind):
    """The server pauses writers (``CLIENT PAUSE ... WRITE``): the extend is read and held, its deadline
    passes; after ``CLIENT UNPAUSE`` the retry writes the rows once, whether or not the held one ran."""
    store = make(kind, 16, url=server.url, prefix="amb")
    store.extend(small(0, 2))
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        err = ambiguous(lambda: store.extend(small(10, 3), timeout=0.2))
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    out = err.retry(timeout=60)
    assert out.indices.tolist() == [2, 3, 4] and store.write_count == 5
    assert store[2:5]["tag"].tolist() == [10, 11, 12]


def test_a_counted_sample_is_answered_again_and_counted_once(server):
    """A sample the rate limiter counts: the retry returns the rows the first draw took, counted once."""
    store = LazyStackedTensorDictStore(count=8, url=server.url, prefix="amb")
    store.extend(small(0, 8))
    store.set_rate_limit(min_size=1, samples_per_insert=100.0, error_buffer=1000.0)
    store.sample(1, timeout=60)  # the server knows the script
    meta = store._engine.keys.meta
    before = int(server.client().hget(meta, "sn") or 0)
    with stopped(server):
        err = ambiguous(lambda: store.sample(4, timeout=0))
    wait_until(lambda: int(server.client().hget(meta, "sn") or 0) == before + 4, "the sample ran once the server went on")
    got = err.retry(timeout=60)
    assert got.td["tag"].tolist() == got.indices.tolist() and len(got.indices) == 4
    assert int(server.client().hget(meta, "sn") or 0) == before + 4


# -- what did not run ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_only_a_call_that_may_have_run_says_so(server, kind):
    """A wait that ran out after the server answered ``WAIT`` (a full queue; nothing unread), and any call
    to a server that cannot be reached, did not run: the plain ``TimeoutError``. The same calls sent to a
    stopped server may have run: the ambiguous one, whose retry settles them once."""
    store = make(kind, 4, url=server.url, prefix="amb")
    store.set_queue(True)
    store.extend(small(0, 4))
    with pytest.raises(TimeoutError) as info:
        store.extend(small(9, 1), timeout=0.2)  # the queue is full: WAIT, then the wait runs out
    assert type(info.value) is TimeoutError
    assert store.pop(4, timeout=60).td["tag"].tolist() == [0, 1, 2, 3]
    with pytest.raises(TimeoutError) as info:
        store.pop(1, timeout=0.2)  # nothing unread: WAIT, then the wait runs out
    assert type(info.value) is TimeoutError
    with stopped(server):
        wrote = ambiguous(lambda: store.extend(small(4, 1), timeout=0.2))
    assert wrote.retry(timeout=60).indices.tolist() == [0] and store.write_count == 5
    with stopped(server):
        took = ambiguous(lambda: store.pop(1, timeout=0.2))
    assert took.retry(timeout=60).td["tag"].tolist() == [4]
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    server._proc.wait()  # type: ignore[union-attr]
    for call in (lambda: store.extend(small(9, 1), timeout=0.3), lambda: store.pop(1, timeout=0.3)):
        with pytest.raises(TimeoutError) as info:
            call()  # no connection: nothing of the call was sent
        assert type(info.value) is TimeoutError, info.value


def test_without_a_timeout_a_socket_timeout_says_the_call_may_have_run(server):
    """No ``timeout=``: redis-py's own ``TimeoutError`` (the client's ``socket_timeout``, retries off) keeps
    its type, says the call may have run and carries its ``request_id``, which resends it once; the calls
    without ``request_id=`` (``update_priority``, ``update_if``, policy changes) say it too."""
    store = LazyStackedTensorDictStore(
        count=8, url=server.url, prefix="amb", socket_timeout=0.3, retry=Retry(NoBackoff(), 0), retry_on_error=[]
    )
    store.extend(small(0, 4))
    store.enable_priorities()
    assert store.pop(1).td["tag"].tolist() == [0]
    with stopped(server):
        with pytest.raises(redis.TimeoutError, match="may have run") as info:
            store.pop(1)
    err = info.value
    assert err.request_id in str(err) and "request_id=" in str(err)  # type: ignore[attr-defined]
    wait_until(lambda: read_cursor(server, store) == 2, "the pop ran once the server went on")
    assert store.pop(1, request_id=err.request_id).td["tag"].tolist() == [1]  # type: ignore[attr-defined]
    assert read_cursor(server, store) == 2
    for call in (
        lambda: store.update_priority([0, 1], 2.0),
        lambda: store.update_if([0], [1], small(50, 1)),
        lambda: store.set_queue(True),
    ):
        store.ring_state()  # the handle's connection open again: the call is sent
        with stopped(server):
            with pytest.raises(redis.TimeoutError, match="may have run"):
                call()


# -- the request-id keyword, on both engines ------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_call_sent_again_with_its_request_id_runs_once(one_node, kind):
    """``request_id=`` is the second way to resend: an extend under one id writes once (the same
    ``RingWrite``), a pop under one id takes once (the same items); items overwritten before the resend
    raise ``QueueOverrunError``, never other rows; a malformed id is refused before anything is sent."""
    store = make(kind, 4, **one_node.kwargs())
    rid = "ab" * 16
    first = store.extend(small(0, 3), request_id=rid)
    again = store.extend(small(0, 3), request_id=rid)
    assert first.indices.tolist() == again.indices.tolist() == [0, 1, 2] and store.write_count == 3
    pid = "cd" * 16
    got = store.pop(2, request_id=pid, timeout=5)
    assert store.pop(2, request_id=pid, timeout=5).td["tag"].tolist() == got.td["tag"].tolist() == [0, 1]
    assert store.pop(1, timeout=5).td["tag"].tolist() == [2]
    store.extend(small(3, 4))  # a full lap: the items popped under pid are overwritten
    with pytest.raises(QueueOverrunError, match="sent again"):
        store.pop(2, request_id=pid, timeout=5)
    for bad in ("xyz", "12", 12, "g" * 32):
        with pytest.raises(ValueError, match="request_id"):
            store.extend(small(9, 1), request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            store.pop(1, request_id=bad)
    assert store.write_count == 7


def test_the_error_pickles_with_its_id_and_reshapes_its_resend():
    err = AmbiguousTimeoutError("late", request_id="ef" * 16, resend=lambda t: ("got", t))
    assert err.retry(3) == ("got", 3)
    assert err.then(lambda r: r[1]).retry(5) == 5
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, TimeoutError) and back.request_id == "ef" * 16 and str(back) == "late"
    with pytest.raises(RuntimeError, match="request_id="):
        back.retry()
