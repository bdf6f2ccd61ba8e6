"""Ring writes whose rows go as plain SETRANGEs between the two ends of ``lua/direct.lua`` (``tdstore/_ring/direct_extend.py``).

Each test runs on redis-server and on fakeredis: the transaction, the refusals and the fall back
to ``write.lua`` are the same on both.
"""

from __future__ import annotations

import pytest
import redis
import torch
from conftest import Backend, ClusterBackend
from helpers import round_trips, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, StoreDamagedError, TensorDictStore
from tdstore._ring import direct_extend as _direct
from tdstore.server import EmbeddedServer

pytestmark = pytest.mark.ring

COUNT = 10


def rows(lo: int, n: int) -> TensorDict:
    """n rows tagged lo .. lo + n - 1 (a row block of obs and tag)."""
    tags = torch.arange(lo, lo + n)
    return TensorDict({"obs": tags.to(torch.float32).unsqueeze(-1).expand(n, 3).clone(), "tag": tags.clone()}, [n])


def tags(s: LazyStackedTensorDictStore) -> list[int]:
    return s.get("tag").tolist()


def asides(raw: redis.Redis, s: LazyStackedTensorDictStore) -> list[bytes]:
    """Keys a direct write moves its data keys to: none may outlive its transaction."""
    return [k for k in raw.keys(f"{s._engine.keys.base}:*") if k.endswith(b":w")]


@pytest.fixture
def ring(one_node: Backend) -> LazyStackedTensorDictStore:
    s = LazyStackedTensorDictStore(count=COUNT, **one_node.kwargs())
    s.extend(rows(0, 4))  # creates the schema and the keys (direct, as the handle made the store)
    return s


def test_an_extend_goes_direct_and_wraps(ring, one_node):
    before = dict(_direct.outcomes)
    ring.extend(rows(4, 3))
    ring.extend(rows(7, 5))  # slots 7, 8, 9, then 0, 1
    assert _direct.outcomes["direct"] == before.get("direct", 0) + 2
    assert tags(ring) == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    assert ring.write_count == 12
    assert ring.sample(64).td["tag"].min() >= 2
    assert asides(one_node.client(), ring) == []


def test_the_first_extend_of_a_new_ring_goes_direct_and_allocates_its_keys(one_node):
    """A ring made empty gets its schema and its keys from its first extend, in the same transaction:
    the row block is allocated whole (zeros past the rows), listed in the inventory, and read back
    as written by a handle that saw none of it."""
    raw = one_node.client()
    s = LazyStackedTensorDictStore(count=COUNT, **one_node.kwargs())
    before = dict(_direct.outcomes)
    got = s.extend(rows(0, 4))
    assert _direct.outcomes["direct"] == before.get("direct", 0) + 1
    assert got.indices.tolist() == [0, 1, 2, 3] and s.write_count == 4
    keys = s._engine.keys
    block = keys.data(s._engine.header.row[0])
    assert raw.strlen(block) == COUNT * s._engine.header.row[1]
    assert raw.hkeys(keys.inventory) == [block.encode()] and raw.hget(keys.meta, "na") == b"1"
    assert raw.hget(keys.meta, "dw") is None and asides(raw, s) == []
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **one_node.kwargs())
    assert tags(other) == [0, 1, 2, 3, 0, 0, 0, 0, 0, 0] and other.write_count == 4
    assert other.get("obs")[3].tolist() == [3.0, 3.0, 3.0]
    s.extend(rows(4, 2))  # direct again, into the keys it made
    assert _direct.outcomes["direct"] == before.get("direct", 0) + 2 and tags(other)[:6] == list(range(6))


def test_a_new_rings_first_extend_is_one_transaction(real):
    s = TensorDictStore(batch_size=[COUNT], **real.kwargs())
    assert round_trips(top_level_commands(real.client, lambda: s.extend(rows(0, 3)))) == ["transaction"]
    assert s["tag"][:3].tolist() == [0, 1, 2]


def test_a_first_extend_that_another_handle_beat_is_planned_again(one_node):
    """Two handles give a new ring its first rows: the second one's schema was planned from the version
    the first changed, so its 'open' refuses (nothing written, no key taken) and it writes through write.lua."""
    raw = one_node.client()
    first = LazyStackedTensorDictStore(count=COUNT, **one_node.kwargs())
    second = LazyStackedTensorDictStore(count=COUNT, td_id=first.td_id, **one_node.kwargs())  # attached: cursor unknown
    _direct.learn(second._engine, 0)  # as if it had made the store too
    first.extend(rows(0, 3))
    before = dict(_direct.outcomes)
    second.extend(rows(100, 2))
    assert _direct.outcomes["refused"] == before.get("refused", 0) + 1
    assert tags(first)[:5] == [0, 1, 2, 100, 101] and first.write_count == 5
    assert asides(raw, first) == [] and raw.hget(first._engine.keys.meta, "na") == b"1"


def test_a_first_extend_gives_its_keys_the_stores_deadline(real):
    raw = real.client()
    s = LazyStackedTensorDictStore(count=COUNT, ttl=600, **real.kwargs())
    s.extend(rows(0, 2))
    keys = s._engine.keys
    pipe = raw.pipeline(transaction=True)  # one EXEC: the three are read within a millisecond (Redis 6 has no PEXPIRETIME)
    for k in (keys.meta, keys.data(s._engine.header.row[0]), keys.inventory):
        pipe.pttl(k)
    header, block, inventory = pipe.execute()
    assert header > 0 and abs(block - header) <= 1 and abs(inventory - header) <= 1


def test_a_first_extend_past_maxmemory_is_refused_before_writing():
    """The keys the first rows need would take the server past its maxmemory: 'open' refuses, nothing
    is allocated or written, and the same extend goes in once there is room."""
    with EmbeddedServer(extra_args=["--maxmemory", "24mb"]) as srv:
        raw = srv.client()
        raw.setrange("someone-else", (12 << 20) - 1, b"\0")  # the server holds 12 MiB of other data
        s = LazyStackedTensorDictStore(count=1 << 20, segment_bytes=64 << 20, url=srv.url, prefix="p")  # a 16 MiB row block
        with pytest.raises(MemoryError, match="maxmemory"):
            s.extend(rows(0, 2))
        assert [k for k in raw.keys("p:*") if b":d:" in k or k.endswith(b":w")] == []
        assert raw.hget(s._engine.keys.meta, "rw") is None
        raw.delete("someone-else")
        s.extend(rows(0, 2))
        assert s.write_count == 2 and s.get("tag")[:3].tolist() == [0, 1, 0]


def test_a_write_found_after_another_writer_goes_through_write_lua(ring, one_node):
    other = LazyStackedTensorDictStore.from_store(td_id=ring.td_id, **one_node.kwargs())
    other.extend(rows(100, 2))  # the first handle's cursor is stale now
    before = dict(_direct.outcomes)
    ring.extend(rows(4, 3))
    assert _direct.outcomes["moved"] == before.get("moved", 0) + 1
    assert tags(ring)[:9] == [0, 1, 2, 3, 100, 101, 4, 5, 6]
    assert ring.write_count == 9
    for k in range(8):  # backing off, then direct again: every row lands once
        ring.extend(rows(200 + k, 1))
    assert ring.write_count == 17
    assert asides(one_node.client(), ring) == []


def test_a_lost_key_is_named_and_never_recreated(ring, one_node):
    raw = one_node.client()
    block = ring._engine.keys.data(ring._engine.header.row[0])
    raw.delete(block)
    with pytest.raises(StoreDamagedError):
        ring.extend(rows(4, 2))
    assert raw.exists(block) == 0
    assert asides(raw, ring) == []


def test_a_flushed_script_cache_writes_once(ring, one_node):
    raw = one_node.client()
    ring.extend(rows(4, 1))  # the direct script is loaded
    raw.script_flush()
    ring.extend(rows(5, 2))
    ring.extend(rows(7, 1))
    assert tags(ring)[:8] == list(range(8)) and ring.write_count == 8
    assert asides(raw, ring) == []


def test_a_schema_change_by_another_handle_is_seen(ring, one_node):
    other = LazyStackedTensorDictStore.from_store(td_id=ring.td_id, **one_node.kwargs())
    other["extra"] = torch.zeros(COUNT, 2)
    with pytest.raises(KeyError, match="extra"):  # planned again from the new schema: the batch lacks a key
        ring.extend(rows(4, 2))
    batch = rows(4, 2)
    batch["extra"] = torch.ones(2, 2)
    ring.extend(batch)
    assert tags(ring)[4:6] == [4, 5] and ring.get("extra")[4:6].tolist() == [[1.0, 1.0]] * 2
    assert ring.write_count == 6


def test_bad_input_raises_before_anything_is_written(ring):
    bad = rows(4, 2)
    bad["tag"] = bad["tag"].to(torch.int32)
    with pytest.raises((TypeError, ValueError)):
        ring.extend(bad)
    assert ring.write_count == 4 and tags(ring)[:4] == [0, 1, 2, 3]


def test_a_batch_that_fits_the_row_block_skips_the_general_planner(ring, monkeypatch):
    """A batch giving every key of the row block as a plain tensor of its dtype and shape is planned by
    the row block's own path; anything else (a dtype, a shape, a key missing or new, a tensor subclass)
    goes to the general planner, which words the error or plans the schema change."""
    from tdstore._ring import extend

    general = extend.plan_rows
    planned: list[int] = []

    def counting(*args, **kwargs):
        planned.append(1)
        return general(*args, **kwargs)

    monkeypatch.setattr(extend, "plan_rows", counting)
    ring.extend(rows(4, 3))
    assert planned == [] and tags(ring)[4:7] == [4, 5, 6]
    other_dtype, missing, subclass, other_shape = (rows(7, 2) for _ in range(4))
    other_dtype["tag"] = other_dtype["tag"].to(torch.int32)
    del missing["tag"]
    for batch in (other_dtype, missing):
        with pytest.raises((TypeError, KeyError)):
            ring.extend(batch)
    assert len(planned) == 2 and ring.write_count == 7
    subclass["obs"] = torch.nn.Parameter(subclass["obs"], requires_grad=False)
    ring.extend(subclass)
    assert len(planned) == 3 and tags(ring)[7:9] == [7, 8]
    other_shape["obs"] = torch.zeros(2, 4)
    ring.extend(other_shape)  # a lazy store's key of another shape turns heterogeneous: a schema change
    assert len(planned) >= 4 and ring.get("obs", as_list=True)[0].shape == (4,) and ring.write_count == 11


def test_a_store_with_a_sampling_policy_goes_through_write_lua(ring):
    ring.set_rate_limit(min_size=1, samples_per_insert=100.0, error_buffer=1e9)
    before = dict(_direct.outcomes)
    ring.extend(rows(4, 2))
    assert _direct.outcomes.get("direct", 0) == before.get("direct", 0)
    assert tags(ring)[4:6] == [4, 5]


def test_an_error_in_the_opening_script_writes_nothing(ring, one_node):
    """A header field out of range makes 'open' raise inside the transaction: the rows land only on the
    aside key (created by the SETRANGEs), which 'close' deletes; the data keys keep every byte."""
    raw = one_node.client()
    ring.extend(rows(4, 1))  # direct from here on
    meta = ring._engine.keys.meta
    before = {k: raw.get(k) for k in raw.keys(f"{ring._engine.keys.base}:d:*")}
    raw.hset(meta, "rw", "-3")  # out of range: tds_ring_fields raises
    with pytest.raises(Exception, match="rw"):
        ring.extend(rows(5, 2))
    raw.hset(meta, "rw", "5")
    assert {k: raw.get(k) for k in raw.keys(f"{ring._engine.keys.base}:d:*")} == before
    assert asides(raw, ring) == []
    ring.extend(rows(5, 2))
    assert tags(ring)[:7] == list(range(7))


def test_a_ring_on_a_cluster_goes_direct_on_its_primary(redis_cluster):
    """A store that is not spread keeps every key under the header's hash tag: the transaction goes to the
    primary that serves it, and a lost key or another writer is handled as on one server."""
    backend = ClusterBackend(redis_cluster)
    s = LazyStackedTensorDictStore(count=COUNT, **backend.kwargs())
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **backend.kwargs())
    s.extend(rows(0, 4))
    before = dict(_direct.outcomes)
    s.extend(rows(4, 3))
    s.extend(rows(7, 5))
    assert _direct.outcomes["direct"] == before.get("direct", 0) + 2
    other.extend(rows(100, 1))
    s.extend(rows(12, 1))  # the cursor moved: write.lua
    assert tags(s) == [10, 11, 100, 12, 4, 5, 6, 7, 8, 9] and s.write_count == 14
    assert [k for k in backend.keys() if k.endswith(b":w")] == []
    s.clear_redis()


def test_a_new_handle_reuses_the_script_the_server_has(real):
    """The direct script is sent once per server and process: a new handle's first direct write
    sends EVALSHA only; after a SCRIPT FLUSH the next new handle's write finds NOSCRIPT and writes once."""
    raw = real.client()
    first = LazyStackedTensorDictStore(count=COUNT, **real.kwargs())
    first.extend(rows(0, 2))
    first.extend(rows(2, 2))  # direct: the script is on the server now

    def loads() -> int:
        return int(raw.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0))

    other = LazyStackedTensorDictStore.from_store(td_id=first.td_id, **real.kwargs())
    other.extend(rows(4, 1))  # write.lua: the handle learns the cursor
    before, direct = loads(), _direct.outcomes["direct"]
    other.extend(rows(5, 1))
    assert loads() == before and _direct.outcomes["direct"] == direct + 1
    raw.script_flush()
    third = LazyStackedTensorDictStore.from_store(td_id=first.td_id, **real.kwargs())
    third.extend(rows(6, 1))
    third.extend(rows(7, 2))  # NOSCRIPT: through write.lua, once
    third.extend(rows(9, 1))  # the script is loaded again
    assert tags(third) == list(range(10)) and third.write_count == 10
    assert asides(raw, third) == []


def test_a_direct_write_into_a_ring_filled_by_index_counts_on_from_its_count(one_node):
    """A store written by index holds a full ring (rw counts as ``count`` while the raw counter is 0): a
    direct write into it moves the counter to ``count + n``, as write.lua does, never to ``n``."""
    s = LazyStackedTensorDictStore(count=COUNT, **one_node.kwargs())
    s.extend(rows(0, COUNT))  # the keys exist
    raw = one_node.client()
    raw.hset(s._engine.keys.meta, "rw", 0)  # as a store filled by index has it (holds data, raw counter 0)
    assert s.write_count == COUNT
    st = _direct._state(s._engine)
    st.rw, st.skip = COUNT, 0  # the handle knows where the cursor is: the write goes direct
    before = dict(_direct.outcomes)
    got = s.extend(rows(100, 2))
    assert _direct.outcomes["direct"] == before.get("direct", 0) + 1
    assert got.indices.tolist() == [0, 1] and s.write_count == COUNT + 2
    assert int(raw.hget(s._engine.keys.meta, "rw")) == COUNT + 2
    assert tags(s)[:3] == [100, 101, 2] and s.sample(64).td["tag"].min() >= 2  # every slot stays written
