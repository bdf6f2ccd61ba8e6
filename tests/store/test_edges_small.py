"""Small edges of the ring and the store's identity (issue 38, item 5): each refused before anything is
allocated, sent or written, with an error naming what is wrong.

* ``sample(n)`` and ``pop(n)`` take at most ``MAX_BATCH`` rows per call: before, ``sample(10**8)`` drew
  10^8 numbers on the client (2.6 GB) and ``sample(10**7)`` held the server past its 5 s BUSY limit;
* a complex or bool priority is refused with a ``TypeError`` naming its dtype (before, a complex
  one was cast to its real part and a bool to 0/1);
* ``td_id=''`` is refused with a ``ValueError`` naming it (before, it made a new id at random, or
  looked for a store ``''``);
* a key of the store that another client set to another Redis type gives ``StoreDamagedError``
  naming the key and the store (before, redis-py's bare ``WRONGTYPE`` ``ResponseError``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, ShardedRing, StoreDamagedError, TensorDictStore
from tdstore._ring.args import MAX_BATCH


def el(i: int) -> TensorDict:
    return TensorDict(obs=torch.full((3,), float(i)), tokens=torch.arange(1 + i % 3))


def lazy_ring(backend: Any, n: int = 4, count: int = 8) -> LazyStackedTensorDictStore:
    s = LazyStackedTensorDictStore(count=count, **backend.kwargs())
    s.extend([el(i) for i in range(n)])
    return s


def dense_ring(backend: Any, n: int = 4, count: int = 8) -> TensorDictStore:
    s = TensorDictStore(batch_size=[count], **backend.kwargs())
    s.extend(TensorDict(obs=torch.arange(3.0 * n).reshape(n, 3), batch_size=[n]))
    return s


def snapshot(client: Any, prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix`` with its type and value (strings, hashes, sets, zsets, lists)."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.keys(prefix + ":*")):
        kind = client.type(key)
        if kind == b"hash":
            value: Any = client.hgetall(key)
        elif kind == b"set":
            value = client.smembers(key)
        elif kind == b"zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"list":
            value = client.lrange(key, 0, -1)
        else:
            value = client.get(key)
        out[key] = (kind, value)
    return out


# -- sample and pop sizes -------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lazy_ring, dense_ring], ids=["lazy", "dense"])
def test_a_sample_or_pop_larger_than_the_bound_is_refused_before_anything_is_drawn(one_node, make):
    """Failed before: ``sample(10**12)`` asked torch for 8 TB of draws (RuntimeError), ``MAX_BATCH + 1``
    was drawn and read in one script, and so was a pop of that size."""
    s = make(one_node)
    before = snapshot(one_node.client(), one_node.prefix)
    for n in (MAX_BATCH + 1, 10**12):
        with pytest.raises(ValueError, match=rf"sample takes at most {MAX_BATCH:,} rows per call.*batch_size={n:,}"):
            s.sample(n)
        with pytest.raises(ValueError, match=rf"pop takes at most {MAX_BATCH:,} rows"):
            s.pop(n, timeout=0)
    with pytest.raises(ValueError, match="pop takes at most"):
        s.pop(MAX_BATCH + 1, lease=5)
    assert snapshot(one_node.client(), one_node.prefix) == before
    assert s.sample(3).indices.numel() == 3  # the bound itself is still a sample
    s.clear_redis()


def test_a_torchrl_sample_larger_than_the_bound_is_refused_before_its_draws(one_node):
    """``StoreSampler`` draws the slots on the client (``torch.randint(..., (batch_size,))``): before, it
    did so for any size (10^12: torch's allocation error)."""
    pytest.importorskip("torchrl")
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(8, **one_node.kwargs())
    rb.extend(TensorDict(obs=torch.arange(4.0), batch_size=[4]))
    with pytest.raises(ValueError, match="sample takes at most"):
        rb.sample(10**12)
    assert rb.sample(2).batch_size == (2,)
    rb.storage.delete()


def test_a_sharded_ring_refuses_a_sample_or_pop_larger_than_the_bound(redis_cluster):
    s = ShardedRing(count=30, url=redis_cluster.url, prefix="edges")
    s.extend(TensorDict(obs=torch.arange(6.0), batch_size=[6]))
    with pytest.raises(ValueError, match="sample takes at most"):
        s.sample(10**12)
    with pytest.raises(ValueError, match="pop takes at most"):
        s.pop(MAX_BATCH + 1)
    assert s.sample(2).indices.numel() == 2
    s.clear_redis()


# -- priorities -----------------------------------------------------------------------------------
BAD_PRIORITIES = [
    (torch.tensor([1 + 2j, 3 + 0j]), "complex64"),
    (torch.tensor([1.0, 2.0], dtype=torch.complex128), "complex128"),
    ([1 + 1j, 2], "complex"),
    (2 + 0j, "complex"),
    (torch.tensor([True, False]), "bool"),
    ([True, True], "bool"),
]


@pytest.mark.parametrize(("priority", "dtype"), BAD_PRIORITIES, ids=[d + str(i) for i, (_, d) in enumerate(BAD_PRIORITIES)])
def test_complex_and_bool_priorities_are_refused_before_anything_is_written(one_node, priority, dtype):
    """Failed before: a complex tensor was cast to its real part (torch warns, tdstore wrote it), a bool
    one to 0/1, without a word."""
    s = lazy_ring(one_node)
    s.enable_priorities(alpha=1.0)
    before = snapshot(one_node.client(), one_node.prefix)
    with pytest.raises(TypeError, match=rf"priority must be real numbers.*{dtype}"):
        s.update_priority([0, 1], priority)
    with pytest.raises(TypeError, match=rf"priority must be real numbers.*{dtype}"):
        s.extend([el(5), el(6)], priority=priority)
    assert snapshot(one_node.client(), one_node.prefix) == before
    for real in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):  # still numbers
        assert s.update_priority([0, 1], torch.tensor([2, 3], dtype=real)).tolist() == [True, True]
        s.extend([el(5)], priority=torch.tensor([4], dtype=real))
    s.clear_redis()


def test_torchrl_refuses_a_complex_td_error(one_node):
    """torchrl's ``update_priority``: before, the sampler cast a complex priority to float64 (its real
    part) and a bool one to 0/1, and wrote them. (``update_tensordict_priority`` reduces a ``td_error``
    with torchrl's ``max``, which refuses complex input itself.)"""
    pytest.importorskip("torchrl")
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(8, batch_size=4, sampler="prioritized", alpha=1.0, **one_node.kwargs())
    rb.extend(TensorDict(obs=torch.arange(4.0), batch_size=[4]))
    s = rb.sample()
    before = snapshot(one_node.client(), one_node.prefix)
    s.set("td_error", torch.ones(4, dtype=torch.complex64))
    with pytest.raises((TypeError, RuntimeError), match="complex"):
        rb.update_tensordict_priority(s)
    with pytest.raises(TypeError, match="complex64"):
        rb.update_priority(s["index"], torch.ones(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="bool"):
        rb.update_priority(s["index"], torch.ones(4, dtype=torch.bool))
    assert snapshot(one_node.client(), one_node.prefix) == before
    rb.update_priority(s["index"], torch.ones(4, dtype=torch.float16))  # a real dtype is kept
    rb.storage.delete()


def test_a_sharded_ring_refuses_complex_priorities_before_any_shard_is_written(redis_cluster):
    s = ShardedRing(count=30, url=redis_cluster.url, prefix="edges")
    s.enable_priorities(alpha=1.0)
    w = s.extend(TensorDict(obs=torch.arange(6.0), batch_size=[6]))
    with pytest.raises(TypeError, match="complex"):
        s.update_priority(w.indices[:2], torch.tensor([1 + 1j, 2 + 0j]))
    for p in (torch.tensor([1 + 1j]), torch.tensor([1 + 1j, 2, 3])):
        with pytest.raises(TypeError, match="complex"):
            s.extend(TensorDict(obs=torch.arange(float(p.numel())), batch_size=[p.numel()]), priority=p)
    assert s.write_count == 6
    s.clear_redis()


# -- an empty td_id -------------------------------------------------------------------------------
EMPTY_ID_PATHS = [
    ("LazyStackedTensorDictStore", lambda kw: LazyStackedTensorDictStore(count=2, td_id="", **kw)),
    ("LazyStackedTensorDictStore.from_store", lambda kw: LazyStackedTensorDictStore.from_store(td_id="", **kw)),
    ("LazyStackedTensorDictStore readonly", lambda kw: LazyStackedTensorDictStore(count=2, td_id="", readonly=True, **kw)),
    ("from_lazy_stack", lambda kw: LazyStackedTensorDictStore.from_lazy_stack(torch.stack([el(0), el(0)]), td_id="", **kw)),
    ("TensorDictStore", lambda kw: TensorDictStore(batch_size=[2], td_id="", **kw)),
    ("TensorDictStore.from_store", lambda kw: TensorDictStore.from_store(td_id="", **kw)),
    ("from_tensordict", lambda kw: TensorDictStore.from_tensordict(TensorDict(a=torch.zeros(2), batch_size=[2]), td_id="", **kw)),
    ("from_dict", lambda kw: TensorDictStore.from_dict({"a": torch.zeros(2)}, batch_size=[2], td_id="", **kw)),
    ("from_schema", lambda kw: TensorDictStore.from_schema({"a": ((), torch.float32)}, batch_size=[2], td_id="", **kw)),
]


@pytest.mark.parametrize("make", [m for _, m in EMPTY_ID_PATHS], ids=[n for n, _ in EMPTY_ID_PATHS])
def test_an_empty_td_id_is_refused_on_every_path(backend, make):
    """Failed before: ``td_id=''`` made a store under a fresh random id (``td_id or new_td_id()``), or
    looked for a store named ''."""
    with pytest.raises(ValueError, match="td_id='' names no store"):
        make(backend.kwargs())
    assert backend.keys() == []


def test_an_empty_td_id_is_refused_by_the_torchrl_buffer_and_attach(one_node):
    pytest.importorskip("torchrl")
    from tdstore.torchrl import StoreStorage, attach, replay_buffer

    for make in (
        lambda: replay_buffer(8, td_id="", **one_node.kwargs()),
        lambda: attach("", **one_node.kwargs()),
        lambda: StoreStorage(8, td_id="", **one_node.kwargs()),
    ):
        with pytest.raises(ValueError, match="td_id='' names no store"):
            make()
    assert one_node.keys() == []


# -- a key of another Redis type ------------------------------------------------------------------
def _key(s: Any, which: str) -> str:
    keys = (s._store if isinstance(s, TensorDictStore) else s)._engine.keys
    return {
        "header": keys.meta,
        "data": keys.data(0),
        "offsets": keys.offsets(1),
        "priority tree": keys.priorities,
        "lease table": keys.lease_keys[0],
        "lease deadlines": keys.lease_keys[1],
        "reply cache": keys.replies,
    }[which]


# (key set to another type by hand, the calls that touch it)
WRONG_TYPE_CASES = [
    ("header", ["read", "write", "extend", "sample", "pop", "open"]),
    ("data", ["read", "write", "extend", "sample", "pop", "leased pop"]),
    ("offsets", ["read", "write", "extend", "sample"]),
    ("priority tree", ["extend", "sample", "update_priority"]),
    ("lease table", ["leased pop", "pop"]),
    ("lease deadlines", ["leased pop"]),
    ("reply cache", ["extend", "pop"]),
]

CALLS = {
    "read": lambda s: s[[0, 1]],
    "write": lambda s: s.__setitem__(1, el(9)),
    "extend": lambda s: s.extend([el(7)]),
    "sample": lambda s: s.sample(2),
    "pop": lambda s: s.pop(1),
    "leased pop": lambda s: s.pop(1, lease=30),
    "update_priority": lambda s: s.update_priority([0], [2.0]),
    "open": lambda s: LazyStackedTensorDictStore.from_store(td_id=s.td_id, prefix=s.prefix, client=s._engine.client),
}


@pytest.mark.parametrize(("which", "calls"), WRONG_TYPE_CASES, ids=[w for w, _ in WRONG_TYPE_CASES])
@pytest.mark.parametrize("kind", ["set", "list", "hash"])
def test_a_key_of_another_type_is_a_damaged_store_naming_the_key(one_node, which, calls, kind):
    """Failed before: each call raised redis-py's ``ResponseError: WRONGTYPE Operation against a key
    holding the wrong kind of value`` (with a script hash and line), naming neither key nor store."""
    client = one_node.client()
    s = lazy_ring(one_node)
    if which == "priority tree":
        s.enable_priorities(alpha=1.0)
    if which.startswith("lease"):
        s.pop(1, lease=30)
    key = _key(s, which)
    if kind == "hash" and client.type(key) == b"hash":
        kind = "set"
    kept = client.dump(key) if client.exists(key) else None
    client.delete(key)
    {"set": lambda: client.sadd(key, "x"), "list": lambda: client.rpush(key, "x"), "hash": lambda: client.hset(key, "x", "1")}[kind]()
    before = snapshot(client, one_node.prefix)
    for call in calls:
        with pytest.raises(StoreDamagedError) as err:
            CALLS[call](s)
        text = str(err.value)
        assert f"key {key!r} holds a {kind}" in text and s.td_id in text and "WRONGTYPE" in text, (call, text)
        assert snapshot(client, one_node.prefix) == before, f"{call} wrote before it raised"
    # the key put back as it was: the store is as before (nothing was written meanwhile)
    client.delete(key)
    if kept is not None:
        client.restore(key, 0, kept)
    assert s.sample(2).indices.numel() == 2
    s.clear_redis()


def test_a_dense_store_data_key_of_another_type_is_a_damaged_store(one_node):
    client = one_node.client()
    s = dense_ring(one_node)
    key = _key(s, "data")
    client.delete(key)
    client.sadd(key, "x")
    for call in (lambda: s[0:2], lambda: s.sample(2), lambda: s.extend(TensorDict(obs=torch.zeros(1, 3), batch_size=[1]))):
        with pytest.raises(StoreDamagedError, match=rf"key {key!r} holds a set, where tdstore keeps a string"):
            call()
    client.delete(key)
    s.clear_redis()


def test_a_registry_of_another_type_refuses_a_new_store_before_its_header_is_written(one_node):
    """Failed before: ``create.lua`` wrote the header, then met the registry's ``WRONGTYPE``: the constructor
    raised a bare ``ResponseError`` and left a header no registry lists."""
    client = one_node.client()
    registry = f"{one_node.prefix}:stores"
    client.set(registry, "x")
    with pytest.raises(StoreDamagedError, match=rf"key {registry!r} holds a string, where tdstore keeps a set"):
        LazyStackedTensorDictStore(count=2, **one_node.kwargs())
    assert one_node.keys() == [registry.encode()]
    client.delete(registry)
