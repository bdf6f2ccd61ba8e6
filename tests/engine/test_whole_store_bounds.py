"""Whole-store calls in bounded batches: ``clear_redis``/``tdstore rm``, ``expire``/``persist``, an
upload's commit, and the dense ``clone()`` refused above its bound (``tdstore/_engine/batches.py``).

On every engine, with the batch bound forced small: the store is deleted whole, every key gets
one deadline, an upload appears whole; a client that dies after a first batch leaves a store that
every call treats as gone and that the next ``clear``, ``rm`` or creation of the same id deletes
(never read as the new store's data). On a real server (slow): a store of 4,096 one-element
segments, and SLOWLOG's slowest command of each whole-store call stays under a generous bound
(figures in lua/README.md, Worst cases).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import torch
from helpers import assert_same, make_stack, pttls, same_deadline
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, StoreDamagedError, TensorDictStore, inspect_store
from tdstore._engine import batches as _batches
from tdstore._engine import scripts as _scripts
from tdstore._engine import whole_store as _whole_store
from tdstore._format.keys import registry_key

SMALL = 6  # keys per call in the logic tests: a store of a few segments takes several calls


def one_slot(backend) -> None:
    """Skip for a store spread over cluster nodes: its whole-store calls go per segment under the
    schema lock instead (tdstore/_engine/spread.py; tests/sharded/test_spread.py)."""
    if getattr(backend, "spread", False):
        pytest.skip("a spread store deletes and expires per segment under its schema lock")


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(_batches, "BATCH_KEYS", SMALL)


def segmented(backend, n: int = 6, **extra) -> LazyStackedTensorDictStore:
    """A lazy store of ``n`` elements, each its own segment (tiny ``segment_bytes``)."""
    return LazyStackedTensorDictStore.from_lazy_stack(make_stack(n), segment_bytes=64, **backend.kwargs(**extra))


def own_keys(backend, store) -> list[bytes]:
    return [k for k in backend.keys() if store.td_id.encode() in k and b"{" in k]


def first_clear_batch(store) -> None:
    """What a ``clear_redis`` whose client dies after its first batch did (the tombstone)."""
    engine = store._engine
    h = engine.header
    every = engine.keys.all_keys(h.next_leaf, h.segments.n) + engine.keys.lease_keys
    head = [every[0]] if engine.spec.cluster else [every[0], engine.keys.registry]
    args = [f"{h.epoch}:V{h.version}", engine.keys.td_id, "noreg" if engine.spec.cluster else "", "keep"]
    assert _scripts.call(engine.client, "clear", [*head, *every[1:SMALL]], args)[0] == b"OK"


def test_a_big_store_is_deleted_in_batches(backend, small_batches):
    store = segmented(backend)
    assert store._engine.header.segments.n == 6 and len(own_keys(backend, store)) > SMALL
    assert store.clear_redis() >= 6
    assert own_keys(backend, store) == []
    assert store.td_id not in {m.decode() for m in backend.client().smembers(registry_key(backend.prefix))}


def test_an_interrupted_clear_reads_as_gone_and_the_next_clear_finishes_it(backend, small_batches):
    one_slot(backend)
    store = segmented(backend)
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    first_clear_batch(store)
    assert own_keys(backend, store)  # the tombstone and most keys are still there
    for call in (lambda: other[0].to_tensordict(), lambda: other.sample(2), lambda: other.expire(10)):
        with pytest.raises(KeyError) as err:
            call()
        assert not isinstance(err.value, StoreDamagedError), err.value  # gone, not "damaged"
    with pytest.raises(KeyError):
        LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    store._engine.set_header(None)
    assert store.clear_redis() == 0  # the handle's header reads as gone...
    other._engine.set_header(None)
    # ... and `tdstore rm` deletes the tombstone's keys
    done = inspect_store.delete_store(backend.client(), backend.prefix, store.td_id)
    assert not done.registry_only and done.keys_deleted > 0
    assert own_keys(backend, store) == []


def test_creating_the_same_id_over_a_tombstone_deletes_it_first(backend, small_batches):
    one_slot(backend)
    store = segmented(backend)
    old = set(own_keys(backend, store))
    first_clear_batch(store)
    # a new store under the same id: none of the old keys (trusted by their size) may be left to show through
    fresh = LazyStackedTensorDictStore(count=6, td_id=store.td_id, **backend.kwargs())
    assert fresh._engine.header.state == "ready" and fresh._engine.header.epoch != store._engine.header.epoch
    assert old & set(own_keys(backend, fresh)) <= {fresh._engine.keys.meta.encode()}
    fresh.extend(TensorDict(x=torch.ones(1), batch_size=[1]))
    assert fresh.written == range(0, 1) and fresh[0]["x"].item() == 1.0
    fresh.clear_redis()
    assert own_keys(backend, fresh) == []


def test_expire_and_persist_in_batches_give_every_key_one_deadline(backend, small_batches):
    store = segmented(backend)
    store.expire(600)  # read back within a tenth of it: a busy machine never runs out the window
    ttls = pttls(backend, store)
    assert len(ttls) > SMALL and same_deadline(backend, ttls) and 540_000 < next(iter(ttls.values())) <= 600_000
    assert backend.client().hget(store._engine.keys.meta, "xd") is None
    store.persist()
    assert set(pttls(backend, store).values()) == {-1}
    assert_same(store.to_tensordict(), make_stack(6))


def test_an_interrupted_expire_reads_as_gone_once_a_key_may_have_expired(backend, small_batches):
    one_slot(backend)
    store = segmented(backend)
    engine = store._engine
    h = engine.header
    every = engine.keys.all_keys(h.next_leaf, h.segments.n)
    # a first batch with a deadline already passed (its keys are gone at once), then the client dies
    reply = _scripts.call(engine.client, "expire", [every[0], *every[1:SMALL]], [f"{h.epoch}:V{h.version}", 1000, "1", "first"])
    assert reply[0] == b"OK"
    assert backend.client().pttl(engine.keys.meta) == -1  # the header outlives every key
    with pytest.raises(KeyError):
        store[0].to_tensordict()
    late = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())  # its header is there...
    with pytest.raises(KeyError):
        late[5].to_tensordict()  # ... but every call answers GONE: never zeros, never "damaged"
    fresh = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), td_id=store.td_id, **backend.kwargs())
    assert_same(fresh.to_tensordict(), make_stack(3, het=False))
    assert fresh._engine.header.epoch != h.epoch
    fresh.clear_redis()
    assert own_keys(backend, fresh) == []


def test_a_big_upload_commits_in_batches_and_appears_whole(backend, small_batches):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(6), segment_bytes=64, ttl=600, **backend.kwargs())
    assert store._engine.header.segments.n == 6
    assert_same(store.to_tensordict(), make_stack(6))
    ttls = pttls(backend, store)
    assert same_deadline(backend, ttls) and 540_000 < next(iter(ttls.values())) <= 600_000
    assert backend.client().hget(store._engine.keys.meta, "xd") is None
    assert store.written == range(0, 6)
    store.clear_redis()


def test_a_dense_clone_above_its_bound_is_refused_naming_the_alternative(backend, small_batches, monkeypatch):
    if backend.name == "cluster":
        pytest.skip("on Redis Cluster clone() goes through the client")
    td = TensorDict({"x": torch.arange(6.0), "y": torch.ones(6, 2)}, [6])
    store = TensorDictStore.from_tensordict(td, segment_bytes=16, **backend.kwargs())
    with pytest.raises(ValueError, match="export_checkpoint"):
        store.clone()
    monkeypatch.setattr(_batches, "BATCH_KEYS", 1023)
    monkeypatch.setattr(_whole_store, "COPY_BYTES", 10)
    with pytest.raises(ValueError, match="import_checkpoint"):
        store.clone()
    monkeypatch.setattr(_whole_store, "COPY_BYTES", 1 << 20)
    copy = store.clone()
    assert_same(copy.to_tensordict(), td)
    copy.clear_redis()
    store.clear_redis()


def test_clear_and_expire_name_the_store_when_the_server_is_unreachable(backend):
    """Whole-store calls in batches name the store and its server in their errors, as every call does."""
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())

    def refused(client: Any, *args: Any) -> Any:
        raise redis.ConnectionError("Connection refused")

    store._engine.execute = refused  # type: ignore[method-assign]
    for call in (store.clear_redis, lambda: store.expire(10), store.persist):
        with pytest.raises(redis.ConnectionError, match=store.td_id):
            call()


def test_a_clone_does_not_inherit_an_expire_in_progress(backend):
    """The source's 'xd' (an expire cut in batches, still running or dead half-way) is not the copy's:
    the copy's keys all get one deadline, and a copy holding it would read as gone once it passed."""
    if backend.name == "cluster":
        pytest.skip("on Redis Cluster clone() goes through the client")
    store = TensorDictStore.from_tensordict(TensorDict({"x": torch.arange(6.0)}, [6]), **backend.kwargs())
    client = backend.client()
    client.hset(store._engine.keys.meta, "xd", str(4_000_000_000_000))  # far ahead: the source still reads whole
    copy = store.clone()
    assert client.hget(copy._engine.keys.meta, "xd") is None
    assert copy["x"].tolist() == list(range(6))
    copy.clear_redis()
    store.clear_redis()


@pytest.mark.slow
def test_whole_store_calls_on_4096_segments_stay_bounded(real):
    """SLOWLOG's slowest command of each whole-store call on a store of 4,096 one-element segments
    (~50,000 keys): each was 95-870 ms as one call; in batches each call is a few ms."""
    client = real.client()
    client.config_set("slowlog-log-slower-than", 1000)
    client.config_set("slowlog-max-len", 100_000)
    n = 4096
    tags = torch.arange(n)
    stack = lazy_stack(
        [TensorDict({"obs": torch.full((14,), float(i)), "a": tags[i], "tok": torch.arange(1 + i % 5)}, []) for i in range(n)]
    )

    def slowest(fn) -> float:
        client.slowlog_reset()
        fn()
        return max((e["duration"] / 1000 for e in client.slowlog_get(100_000)), default=0.0)

    worst: dict[str, float] = {}
    holder: list[LazyStackedTensorDictStore] = []
    worst["commit"] = slowest(lambda: holder.append(LazyStackedTensorDictStore.from_lazy_stack(stack, segment_bytes=64, **real.kwargs())))
    store = holder[0]
    assert store._engine.header.segments.n == n
    worst["expire"] = slowest(lambda: store.expire(3600))
    ttls = pttls(real, store)
    assert len(ttls) > 8000 and same_deadline(real, ttls)
    worst["persist"] = slowest(store.persist)
    assert set(pttls(real, store).values()) == {-1}
    assert store[n - 1]["obs"][0].item() == n - 1
    worst["clear"] = slowest(store.clear_redis)
    assert own_keys(real, store) == []
    print("slowest command (ms):", {k: round(v, 1) for k, v in worst.items()})
    # the upload's own chunks (plain SETRANGE pipelines, not this change) are logged too: only scripts count
    assert all(v < 250 for v in worst.values()), worst


def test_an_upload_that_dies_in_its_commit_is_never_read_and_is_deleted_later(backend, small_batches, monkeypatch):
    one_slot(backend)
    calls = {"commit": 0}
    real_call = _scripts.call

    def dying(client, name, keys, args, execute=None):
        if name == "commit":
            calls["commit"] += 1
            if calls["commit"] == 2:  # the client dies after the commit's first batch
                raise ConnectionError("client died")
        return real_call(client, name, keys, args, execute)

    monkeypatch.setattr(_scripts, "call", dying)
    monkeypatch.setattr(_whole_store, "abort_upload", lambda *a, **k: None)  # nobody cleans up
    with pytest.raises(ConnectionError):
        LazyStackedTensorDictStore.from_lazy_stack(make_stack(6), segment_bytes=64, td_id="dies", **backend.kwargs())
    monkeypatch.setattr(_scripts, "call", real_call)
    client = backend.client()
    meta = [k for k in own_keys(backend, type("S", (), {"td_id": "dies"})) if k.endswith(b":m")][0]
    assert client.hget(meta, "state").startswith(b"uploading") and client.pttl(meta) == -1  # outlives every key
    with pytest.raises(KeyError, match="uploaded"):
        LazyStackedTensorDictStore.from_store(td_id="dies", **backend.kwargs())
    client.hset(meta, "xd", 1)  # as if its keys' upload deadline had passed
    found = inspect_store.audit(client, backend.prefix, "dies")
    assert not found.intact and "tdstore rm dies" in found.problems[0]
    fresh = LazyStackedTensorDictStore.from_lazy_stack(make_stack(2, het=False), td_id="dies", **backend.kwargs())
    assert_same(fresh.to_tensordict(), make_stack(2, het=False))
    fresh.clear_redis()
    assert own_keys(backend, fresh) == []


def test_check_and_rm_understand_a_tombstone(backend, small_batches):
    one_slot(backend)
    store = segmented(backend)
    first_clear_batch(store)
    found = inspect_store.audit(backend.client(), backend.prefix, store.td_id)
    assert not found.intact and "being deleted" in found.problems[0] and f"tdstore rm {store.td_id}" in found.problems[0]
    listed = {i.td_id: i.state for i in inspect_store.list_stores(backend.client(), backend.prefix).stores}
    assert listed[store.td_id] == "deleting"
    inspect_store.delete_store(backend.client(), backend.prefix, store.td_id)
    assert own_keys(backend, store) == []
    assert store.td_id not in {m.decode() for m in backend.client().smembers(registry_key(backend.prefix))}


def test_a_resent_batch_changes_nothing_twice(backend, small_batches):
    one_slot(backend)
    store = segmented(backend)
    first_clear_batch(store)
    first_clear_batch(store)  # redis-py resends a batch whose reply was lost: the tombstone takes it
    assert backend.client().hget(store._engine.keys.meta, "state") == b"deleting"
    assert inspect_store.delete_store(backend.client(), backend.prefix, store.td_id).keys_deleted > 0
    assert own_keys(backend, store) == []


def _pexpiretime(client, key: str) -> int | None:
    """The key's deadline in ms (Redis 7's PEXPIRETIME); None on Redis 6, which lacks it."""
    try:
        return int(client.pexpiretime(key))
    except redis.exceptions.RedisError:  # a server's unknown command (a cluster client refuses it before sending)
        return None


def test_an_interrupted_persist_keeps_the_header_alive_and_the_next_one_finishes(backend, small_batches):
    one_slot(backend)
    store = segmented(backend, ttl=600)
    engine = store._engine
    h = engine.header
    every = engine.keys.all_keys(h.next_leaf, h.segments.n)
    client = backend.client()
    old_deadline = _pexpiretime(client, engine.keys.meta) if backend.name != "fakeredis" else None
    reply = _scripts.call(engine.client, "expire", [every[0], *every[1:SMALL]], [f"{h.epoch}:V{h.version}", 0, "", "first"])
    assert reply[0] == b"OK"
    assert client.pttl(engine.keys.meta) == -1  # the header outlives every key...
    xd = int(client.hget(engine.keys.meta, "xd"))  # ... and says when the first of them may vanish
    if old_deadline is not None:
        assert xd == old_deadline
    assert -1 in pttls(backend, store).values() and max(pttls(backend, store).values()) > 540_000
    assert_same(store.to_tensordict(), make_stack(6))  # until then the store reads whole
    store.persist()
    assert set(pttls(backend, store).values()) == {-1} and client.hget(engine.keys.meta, "xd") is None


def test_a_delete_of_large_values_is_cut_by_bytes_too(backend, monkeypatch):
    one_slot(backend)
    monkeypatch.setattr(_batches, "CLEAR_BYTES", 100)  # bytes freed per call, then the next call
    sent: list[list] = []
    real_call = _scripts.call

    def counting(client, name, keys, args, execute=None):
        if name == "clear":
            sent.append(args)
        return real_call(client, name, keys, args, execute)

    monkeypatch.setattr(_scripts, "call", counting)
    store = segmented(backend)  # fewer keys than a batch: only the bytes cut it
    assert len(own_keys(backend, store)) < _batches.BATCH_KEYS
    assert store.clear_redis() > 6
    assert len(sent) > 2 and ":V" in sent[0][0]
    assert all(a[0].endswith(":X") for a in sent[1:])  # the later calls run under the tombstone
    assert own_keys(backend, store) == []


@pytest.mark.slow
def test_deleting_large_values_stays_bounded(real):
    client = real.client()
    client.config_set("slowlog-log-slower-than", 1000)
    store = TensorDictStore.from_tensordict(TensorDict(x=torch.ones(48, 1 << 20), batch_size=[48]), **real.kwargs())
    assert store._engine.header.segments.n == 48  # 48 values of 4 MiB: one call would free 192 MiB
    client.slowlog_reset()
    store.clear_redis()
    worst = max((e["duration"] / 1000 for e in client.slowlog_get(1000)), default=0.0)
    print(f"slowest command deleting 48 x 4 MiB: {worst:.1f} ms")
    assert worst < 250 and own_keys(real, store) == []
