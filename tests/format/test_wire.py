"""The wire side of read transactions (``tdstore._format.wire``) and the random-batch reads that use it.

A scattered read of many rows is one MULTI/EXEC of plain GETRANGEs, packed by hand and read
back in one go. These tests pin the packing byte for byte, the reply reading on every kind of
connection redis-py can give (hiredis RESP2 and RESP3, the pure-Python parser), errors at
queue time and at EXEC time (raised only after every reply is read, so the connection stays
usable), and the store-level path: one write per read, the fallback through redis-py when the
held connection is busy, and reads of any order with duplicates.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import redis
import torch
from helpers import assert_same, top_level_commands
from redis._parsers import _HiredisParser, _RESP2Parser
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._format import wire as _wire


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_pack_is_resp() -> None:
    assert _wire.pack("HMGET", b"k", 7) == b"*3\r\n$5\r\nHMGET\r\n$1\r\nk\r\n$1\r\n7\r\n"
    assert _wire.pack("SET", "\u00e9", b"") == b"*3\r\n$3\r\nSET\r\n$2\r\n\xc3\xa9\r\n$0\r\n\r\n"


def test_getranges_are_packed_byte_for_byte_as_redis_py_packs_them() -> None:
    conn = redis.Connection()
    key = "p:{i%s1}:d:3"  # '%' in a key must not be taken for a format
    starts = _i64(0, 9, 10, 99, 100, 123_456_789, 10**18)
    lengths = _i64(1, 1, 5, 300, 1, 2, 7)
    body, counts = _wire.pack_chunked_getranges([[(key, starts, lengths)]], 1 << 20)
    want = b"".join(b"".join(conn.pack_command("GETRANGE", key, s, s + n - 1)) for s, n in zip(starts.tolist(), lengths.tolist()))
    assert body == want and counts == [7]


def test_getranges_are_chunked_and_empty_ranges_skipped() -> None:
    conn = redis.Connection()
    body, counts = _wire.pack_chunked_getranges(
        [[("a", _i64(0, 50), _i64(25, 0))], [("b", _i64(3), _i64(10))], [("c", _i64(), _i64())]], 10
    )
    pieces = [("a", 0, 9), ("a", 10, 19), ("a", 20, 24), ("b", 3, 12)]
    assert body == b"".join(b"".join(conn.pack_command("GETRANGE", k, s, e)) for k, s, e in pieces)
    assert counts == [3, 1, 0]  # an empty range is no command (GETRANGE k 0 -1 would read the whole value)


def _client(real, parser_class: type | None = None, **kw) -> redis.Redis:
    if parser_class is not None:
        pool = redis.ConnectionPool(
            connection_class=redis.UnixDomainSocketConnection, path=real.server.unix_socket_path, parser_class=parser_class, **kw
        )
        return redis.Redis(connection_pool=pool)
    return redis.Redis(unix_socket_path=real.server.unix_socket_path, **kw)


@pytest.fixture(params=["hiredis-resp2", "hiredis-resp3", "python-parser"])
def conn(request, real):
    kw = {"protocol": 3} if request.param == "hiredis-resp3" else {"parser_class": _RESP2Parser} if request.param == "python-parser" else {}
    client = _client(real, **kw)
    key = f"wire-{uuid.uuid4().hex}"
    client.set(key, bytes(range(256)) * 40)
    client.hset(key + "h", "f", "v")
    c = client.connection_pool.get_connection()
    assert isinstance(c._parser, _HiredisParser) != (request.param == "python-parser")
    c.key = key
    yield c
    client.delete(key, key + "h")
    client.connection_pool.release(c)


def _ping_works(c) -> bool:
    c.send_command("PING")
    return c.read_response() in (b"PONG", "PONG")


def test_transaction_returns_the_exec_reply(conn) -> None:
    k = conn.key
    body = _wire.pack("HMGET", k + "h", "f", "g") + _wire.pack_chunked_getranges([[(k, _i64(1, 300, 20_000), _i64(3, 2, 5))]], 1 << 20)[0]
    got = _wire.transaction(conn, body, 4)
    assert got == [[b"v", None], bytes([1, 2, 3]), bytes([44, 45]), b""]
    assert _ping_works(conn)


def test_an_error_while_queueing_is_raised_after_every_reply_is_read(conn) -> None:
    body = _wire.pack("GETRANGE", conn.key, 0) + _wire.pack("GETRANGE", conn.key, 0, 1)  # the first has too few arguments
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        _wire.transaction(conn, body, 2)
    assert _ping_works(conn)


def test_an_error_inside_exec_is_raised_after_every_reply_is_read(conn) -> None:
    body = _wire.pack("GETRANGE", conn.key, 0, 1) + _wire.pack("GETRANGE", conn.key + "h", 0, 1)  # a hash: WRONGTYPE
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        _wire.transaction(conn, body, 2)
    assert _ping_works(conn)


def test_a_large_reply_arrives_in_many_reads(real) -> None:
    client = _client(real)
    key = f"wire-{uuid.uuid4().hex}"
    blob = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    client.set(key, blob)
    c = client.connection_pool.get_connection()
    try:
        starts = np.arange(0, 3 << 20, 4096, dtype=np.int64)[::-1].copy()  # 768 ranges, backwards
        body = _wire.pack_chunked_getranges([[(key, starts, np.full(starts.size, 4096, np.int64))]], 1 << 20)[0]
        got = _wire.transaction(c, body, int(starts.size))
        assert b"".join(got) == b"".join(blob[s : s + 4096] for s in starts.tolist())
    finally:
        client.connection_pool.release(c)
        client.delete(key)


def _rows_store(backend, n: int = 500):
    local = lazy_stack(
        [TensorDict(obs=torch.randn(8), act=torch.tensor([i, -i]), nested=TensorDict(b=torch.arange(3) + i)) for i in range(n)]
    )
    return LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs()), local


def test_random_batches_in_any_order_with_duplicates(backend) -> None:
    store, local = _rows_store(backend)
    gen = torch.Generator().manual_seed(1)
    for idx in (
        torch.randint(500, (256,), generator=gen),  # scattered, some twice
        torch.randperm(500, generator=gen)[:64],  # scattered, no duplicates
        torch.randperm(64, generator=gen),  # a shuffled contiguous range: one run once sorted
        torch.arange(499, 99, -1),  # a reversed range
        torch.randint(500, (8, 32), generator=gen),  # a 2-d index
        torch.full((40,), 7),  # one row, forty times
        torch.randint(-500, 0, (50,), generator=gen),  # negative indices
    ):
        assert_same(store[idx], local[idx])
    dense = TensorDictStore.from_tensordict(TensorDict(x=torch.arange(2000.0).reshape(1000, 2), batch_size=[1000]), **backend.kwargs())
    idx = torch.randint(1000, (300,), generator=gen)
    assert torch.equal(dense[idx]["x"], torch.arange(2000.0).reshape(1000, 2)[idx])


def test_a_random_batch_is_one_transaction_sent_in_one_write(real) -> None:
    store, local = _rows_store(real, 5000)
    idx = torch.randint(5000, (256,), generator=torch.Generator().manual_seed(2))
    store[idx]  # warm
    cmds = top_level_commands(real.client, lambda: store[idx])
    assert cmds[0] == "multi" and cmds[-1] == "exec" and cmds.count("exec") == 1 and "evalsha" not in cmds
    assert set(cmds[1:-1]) == {"hmget", "getrange"}
    conn = store._engine._held._conn
    sends = []
    original = conn.send_packed_command
    conn.send_packed_command = lambda *a, **k: (sends.append(1), original(*a, **k))[1]
    try:
        got = store[idx]
    finally:
        del conn.send_packed_command
    assert sends == [1]
    assert_same(got, local[idx])


def test_a_busy_held_connection_falls_back_to_a_redis_py_transaction(real) -> None:
    store, local = _rows_store(real)
    idx = torch.randint(500, (100,), generator=torch.Generator().manual_seed(3))
    store[0]  # the handle holds its connection now
    held = store._engine._held
    got: list = []
    with held._lock:  # another thread is in the middle of a call on the held connection
        t = threading.Thread(target=lambda: got.append(store[idx]))
        t.start()
        t.join(30)
    assert_same(got[0], local[idx])


def test_a_schema_change_between_plan_and_read_is_caught_by_the_guards(real) -> None:
    store, local = _rows_store(real)
    idx = torch.randint(500, (128,), generator=torch.Generator().manual_seed(4))
    store[idx]
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real.kwargs())
    other.set("act", torch.zeros(500, 2, dtype=torch.float64))  # moves 'act' out of the row block, new dtype
    got = store[idx]
    assert got["act"].dtype == torch.float64 and torch.equal(got["obs"], local["obs"][idx])
    other.clear_redis()
    with pytest.raises(KeyError, match=store.td_id):
        store[idx]


def test_a_read_of_very_many_ranges_goes_through_the_script(real, monkeypatch) -> None:
    """Past TX_MAX_RANGES the server would hold every queued command until EXEC: read.lua instead."""
    from tdstore._plan import read_plan as _reads

    store, local = _rows_store(real)
    idx = torch.randint(500, (300,), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(_reads, "TX_MAX_RANGES", 100)
    store[0].to_tensordict()  # read.lua loaded
    before = real.commandstats()
    got = store[idx]
    after = real.commandstats()
    assert after.get("evalsha", 0) - before.get("evalsha", 0) == 1 and after.get("exec", 0) == before.get("exec", 0)
    assert_same(got, local[idx])
    assert_same(store[::3], local[::3])  # 167 runs: the script too


def test_scattered_reads_with_a_zero_size_key(backend) -> None:
    """A key of zero-size elements reads nothing, whichever way its ranges are planned (whole or per row)."""
    n = 300
    td = TensorDict(x=torch.arange(n * 3.0).reshape(n, 3), e=torch.zeros(n, 0), batch_size=[n])
    store = TensorDictStore.from_tensordict(td, **backend.kwargs())
    seg = TensorDictStore.from_tensordict(td, segment_bytes=64, **backend.kwargs())  # many segments
    gen = torch.Generator().manual_seed(6)
    for idx in ([3, 0], slice(None, None, 2), torch.randint(n, (64,), generator=gen), torch.randperm(n, generator=gen)[:100]):
        for s in (store, seg):
            got = s[idx]
            assert torch.equal(got["x"], td["x"][idx]) and got["e"].shape == td["e"][idx].shape


def test_a_fork_while_another_thread_holds_the_connection(real) -> None:
    """The child of a fork taken mid-call gets a free lock and no connection: it reads and closes."""
    import multiprocessing as mp

    store, local = _rows_store(real)
    store[0]
    held = store._engine._held
    with held._lock:  # another thread is in the middle of a call when the fork happens
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child_reads_and_closes, args=(store, q))
        p.start()
        p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == "ok"


def _child_reads_and_closes(store, q) -> None:
    idx = torch.arange(100, 0, -3)
    assert store._engine._held._lock.acquire(blocking=False)  # not inherited held
    store._engine._held._lock.release()
    assert torch.equal(store[idx]["obs"], store.to_tensordict()["obs"][idx])
    store.close()
    q.put("ok")


def test_resp3_pushes_are_handed_to_redis_py_not_taken_for_replies(real) -> None:
    """With client tracking on (RESP3), an invalidation push can arrive before a transaction's
    replies: it goes to redis-py's push handler, and the EXEC reply is still the one returned."""
    client = _client(real, protocol=3)
    key = f"wire-{uuid.uuid4().hex}"
    client.set(key, b"abcdef")
    c = client.connection_pool.get_connection()
    try:
        seen = []
        c._parser.handle_push_response = lambda r: seen.append(r)
        c.send_command("CLIENT", "TRACKING", "on")
        assert c.read_response() in (b"OK", "OK")
        c.send_command("GET", key)  # now tracked
        c.read_response()
        _client(real).set(key, b"ghijkl")  # another client changes it: an invalidation push for c
        got = _wire.transaction(c, _wire.pack("GETRANGE", key, 0, 2) + _wire.pack("GETRANGE", key, 3, 5), 2)
        assert got == [b"ghi", b"jkl"] and seen and b"invalidate" in seen[0][0]
        assert _ping_works(c)
    finally:
        client.connection_pool.release(c)
        client.delete(key)
