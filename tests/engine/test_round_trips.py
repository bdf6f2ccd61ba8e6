"""One operation, one round trip: counted with INFO commandstats on a real server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_stack, round_trips, top_level_commands
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore


def count_commands(backend, fn) -> tuple[int, int]:
    """(round trips clients made, EVALSHA calls and read transactions among them) while ``fn`` ran:
    MONITOR and INFO commandstats agree. A MULTI ... EXEC counts once (see ``helpers.round_trips``)."""
    before = backend.commandstats()
    top = top_level_commands(backend.client, fn)
    cmds = round_trips(top)
    after = backend.commandstats()
    # EVALSHAs inside a transaction (a direct ring write's two ends, see _direct) go with it
    evalsha = after.get("evalsha", 0) - before.get("evalsha", 0) - (top.count("evalsha") - cmds.count("evalsha"))
    transactions = after.get("exec", 0) - before.get("exec", 0)
    assert cmds.count("evalsha") == evalsha and cmds.count("transaction") == transactions, (cmds, evalsha, transactions)
    return len(cmds), evalsha + transactions


@pytest.fixture(params=[True, False], ids=["het", "homog"])
def store(request, real):
    s = LazyStackedTensorDictStore.from_lazy_stack(make_stack(8, het=request.param), **real.kwargs())
    s.prepared = {"el": s[4].to_tensordict(), "pair": s[2:4]}
    s[0] = s[0].to_tensordict()  # warm: read and write scripts loaded, header cached
    s.extend(s.prepared["pair"])  # the ring has written slots to sample
    s.extend(s.prepared["pair"])  # the second goes direct (rows as SETRANGEs, see _direct): lua/direct.lua loaded
    s.persist()  # expire.lua loaded too
    yield s
    s.clear_redis()


OPS = {
    "element read": lambda s: s[3].to_tensordict(),
    "element key read": lambda s: s[3]["obs"],
    "nested key read": lambda s: s[3]["nested", "b"],
    "element write": lambda s: s.__setitem__(3, s.prepared["el"]),
    "shape-changing element write": lambda s: s.__setitem__(
        2,
        TensorDict(
            obs=torch.zeros(9),
            done=torch.ones(1, dtype=torch.bool),
            nested=TensorDict(b=torch.zeros(3, dtype=torch.int64)),
            **({"tokens": torch.zeros(11, dtype=torch.int64)} if "tokens" in s.keys() else {}),
        ),
    ),
    "element key write": lambda s: s[3].__setitem__("done", torch.zeros(1, dtype=torch.bool)),
    "element update": lambda s: s[3].update(TensorDict(obs=torch.zeros(4), nested=TensorDict(b=torch.ones(3, dtype=torch.int64)))),
    "slice read": lambda s: s[1:5],
    "step slice read": lambda s: s[0:8:3],
    "fancy read": lambda s: s[torch.tensor([7, 1, 1, 4])],
    "list read": lambda s: s[[0, 5]],
    "mask read": lambda s: s[torch.arange(8) % 3 == 0],
    "key read": lambda s: s["obs"],
    "full key read": lambda s: s["nested", "b"],
    "nested read": lambda s: s["nested"],
    "to_tensordict": lambda s: s.to_tensordict(),
    "slice write": lambda s: s.__setitem__(slice(1, 3), s.prepared["pair"]),
    "step slice write": lambda s: s.__setitem__(slice(0, 8, 4), s.prepared["pair"]),
    "index write": lambda s: s.__setitem__(torch.tensor([6, 0]), s.prepared["pair"]),
    "mask write": lambda s: s.__setitem__(torch.arange(8) < 2, s.prepared["pair"]),
    "set nested": lambda s: s.set(("nested", "c"), torch.zeros(8, 2)),
    "update": lambda s: (
        s.update(TensorDict(obs=torch.ones(8, 4), batch_size=[8]))
        if "tokens" not in s.keys()
        else s.update(TensorDict(done=torch.ones(8, 1, dtype=torch.bool), batch_size=[8]))
    ),
    "del": lambda s: (s.set("tmp", torch.zeros(8)), s.__delitem__("tmp")),
    "rename": lambda s: s.rename_key_("done", "finished"),
    "zero_": lambda s: s.zero_(),
    "fill_": lambda s: s.fill_("obs", 1.5),
    "element zero_": lambda s: s[2].zero_(),
    "element fill_ of a heterogeneous key": lambda s: s[2].fill_("tokens" if "tokens" in s.keys() else "obs", 3),
    "apply_ (read, then write)": lambda s: s.apply_(lambda t: t.clone()),
    "ring extend": lambda s: s.extend(s.prepared["pair"]),
    "ring append": lambda s: s.append(s.prepared["el"]),
    "ring sample": lambda s: s.sample(32),
    "ring update_if": lambda s: s.update_if([0, 1], [1, 1], s.prepared["pair"]),
    "ring state (HMGET)": lambda s: s.ring_state(),
    "expire": lambda s: s.expire(60),
    "persist": lambda s: s.persist(),
    "ttl (PTTL)": lambda s: s.ttl(),
    "keys": lambda s: list(s.keys(True, True)),
    "len and in": lambda s: (len(s), "obs" in s),
}
# operations that are two public calls in the lambda
EXPECTED = {"del": 2, "keys": 0, "len and in": 0, "apply_ (read, then write)": 2}


@pytest.mark.parametrize("name", list(OPS))
def test_one_round_trip(store, real, name):
    total, calls = count_commands(real, lambda: OPS[name](store))
    want = EXPECTED.get(name, 1)
    assert total == want, f"{name}: {total} commands"
    assert calls == (0 if "(HMGET)" in name or "(PTTL)" in name else want)


@pytest.mark.parametrize("het", [False, True], ids=["homog", "het"])
def test_an_element_write_in_place_is_its_checks_and_its_setranges(real, het):
    """write.lua's short path (lua/write.lua, in_place): one HMGET of the guards, one STRLEN per key
    written (a heterogeneous leaf: its offset table's length and last offset, and the element's
    offsets), then the SETRANGEs; none of pass 1's or pass 2's other commands."""
    from collections import Counter

    s = LazyStackedTensorDictStore.from_lazy_stack(make_stack(8, het=het), **real.kwargs())
    s[0] = s[0].to_tensordict()  # the script loaded, the header cached
    el = s[5].to_tensordict().apply(lambda t: ~t if t.dtype == torch.bool else t + 1)  # same shapes, other bytes
    inner = top_level_commands(real.client, lambda: s.__setitem__(5, el), lua=True)
    want = {"hmget": 1, "strlen": 3, "getrange": 2, "setrange": 2} if het else {"hmget": 1, "strlen": 1, "setrange": 1}
    assert Counter(inner) == want, inner
    assert (s[5].to_tensordict() == el).all()
    s.clear_redis()


def test_from_store_is_one_read_only_round_trip(store, real):
    client = real.client()
    client.ping()  # the connection handshake is not part of the operation

    def attach():
        other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, client=client, prefix=real.prefix)
        assert other.batch_size == store.batch_size

    assert top_level_commands(real.client, attach) == ["hgetall"]


def test_stale_cache_costs_one_extra_round_trip(store, real):
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real.kwargs())
    other.set("added", torch.zeros(8))
    total, _ = count_commands(real, lambda: store[1].to_tensordict())
    assert total == 2
    assert "added" in store.keys()
    total, _ = count_commands(real, lambda: store[1].to_tensordict())
    assert total == 1


@pytest.mark.layout
def test_upload_round_trips_are_bounded_by_chunks(real):
    local = lazy_stack([TensorDict(x=torch.zeros(1000)) for _ in range(50)])  # 4000 bytes per element
    holder = {}
    cmds = top_level_commands(
        real.client, lambda: holder.setdefault("s", LazyStackedTensorDictStore.from_lazy_stack(local, chunk_elements=10, **real.kwargs()))
    )
    assert cmds.count("setrange") == 5  # one SETRANGE per chunk and leaf
    holder.pop("s").clear_redis()
    cmds = top_level_commands(
        real.client, lambda: holder.setdefault("s", LazyStackedTensorDictStore.from_lazy_stack(local, chunk_bytes=20_000, **real.kwargs()))
    )
    assert cmds.count("setrange") == 10  # 5 elements of 4000 bytes per chunk
    holder.pop("s").clear_redis()


def test_cache_metadata_false_reads_keys_from_the_server(store, real):
    fresh = LazyStackedTensorDictStore.from_store(td_id=store.td_id, cache_metadata=False, **real.kwargs())
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real.kwargs())
    other.set("late", torch.zeros(8))
    assert top_level_commands(real.client, lambda: list(fresh.keys())).count("hgetall") == 1
    assert "late" in fresh.keys()
    cached = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real.kwargs())
    other.set("later", torch.zeros(8))
    assert top_level_commands(real.client, lambda: list(cached.keys())) == []
    assert "later" not in cached.keys()  # a cached view: refreshed by the next data call
    cached[0].to_tensordict()
    assert "later" in cached.keys()


def test_changes_to_other_keys_do_not_disturb_a_call(store, real):
    """Leaf versions: a call is checked only against the leaves it touches."""
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real.kwargs())
    other.set("unrelated", torch.zeros(8))
    other.set("unrelated", torch.zeros(8, dtype=torch.float64))  # dtype change of another key
    total, _ = count_commands(real, lambda: store[1].__setitem__("obs", torch.ones(4)))
    assert total == 1
    total, _ = count_commands(real, lambda: store[2]["obs"])
    assert total == 1
    # a read of every key must see the new key: it is checked against the key set
    total, _ = count_commands(real, lambda: store[3].to_tensordict())
    assert total == 2 and "unrelated" in store[3].to_tensordict().keys()


def test_stale_handle_sees_renames_and_deletes(backend):
    local = lazy_stack([TensorDict(x=torch.arange(2 + i), aux=torch.zeros(2), keep=torch.ones(1)) for i in range(4)])
    a = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **backend.kwargs())
    b[1].to_tensordict()
    a.rename_key_("aux", "aux2")
    assert set(b[1].to_tensordict().keys()) == {"x", "aux2", "keep"}
    del a["aux2"]
    assert set(b[2].to_tensordict().keys()) == {"x", "keep"}
    c = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **backend.kwargs())
    a.rename_key_("keep", "kept")
    # c planned a write of "keep" with its stale view: never written into "kept"; the fresh plan
    # finds no "keep" and creates it, as any first write of a key does
    c[0]["keep"] = torch.full((1,), 5.0)
    assert a["kept"].tolist() == [[1.0]] * 4
    assert c["keep"].tolist() == [[5.0], [0.0], [0.0], [0.0]]
    a.clear_redis()


def test_bulk_reads_are_one_transaction_of_plain_getrange(real):
    big = lazy_stack([TensorDict(x=torch.full((300_000,), float(i)), y=torch.arange(3) + i) for i in range(4)])  # 4.8 MB
    s = LazyStackedTensorDictStore.from_lazy_stack(big, **real.kwargs())
    s["y"]
    s.to_tensordict()  # warm: transactions take a pool connection (scripts go on the handle's held one)
    cmds = top_level_commands(real.client, lambda: s.to_tensordict())
    assert cmds[0] == "multi" and cmds[-1] == "exec" and "evalsha" not in cmds and cmds.count("exec") == 1
    assert set(cmds[1:-1]) == {"hmget", "getrange"}
    got = s.to_tensordict()
    assert torch.equal(got["x"], big.get("x")) and torch.equal(got["y"], big.get("y"))
    assert torch.equal(s["x"][2], big[2]["x"])
    # a schema change between plan and read: the guards catch it, the handle refreshes
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **real.kwargs())
    other.set("y", torch.zeros(4, 3, dtype=torch.float64))
    assert s.to_tensordict()["y"].dtype == torch.float64
    other.clear_redis()
    with pytest.raises(KeyError, match=s.td_id):
        s.to_tensordict()


def test_bulk_writes_are_staged_then_moved_in_one_pipeline(real, monkeypatch):
    big = lazy_stack([TensorDict(x=torch.full((300_000,), float(i)), y=torch.arange(3) + i) for i in range(4)])  # 4.8 MB
    s = LazyStackedTensorDictStore.from_lazy_stack(big, segment_bytes=64 << 20, **real.kwargs())  # one segment
    s["y"]
    s.set("x", torch.zeros(4, 300_000))  # warm the write script
    new = torch.randn(4, 300_000)
    cmds = top_level_commands(real.client, lambda: s.set("x", new))
    # the staging key is created with its TTL first, so a lost connection leaves only keys that expire
    assert cmds[-1] == "evalsha" and cmds.count("evalsha") == 1 and cmds[0] == "set" and set(cmds[1:-1]) == {"setrange"}
    assert torch.equal(s["x"], new)
    assert not real.client().keys("*:stage:*")
    # a new large key goes the same way
    s.set("z", torch.ones(4, 300_000, dtype=torch.float64))
    assert s["z"].sum().item() == 4 * 300_000
    # a stale handle: the script refuses, the staging key is deleted, the retry succeeds
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **real.kwargs())
    other.rename_key_("y", "w")
    from tdstore._engine.transport import Transport

    deleted = []
    real_call = Transport._staged_call

    def spy(self, call):
        reply = real_call(self, call)
        deleted.append(reply[0])
        return reply

    monkeypatch.setattr(Transport, "_staged_call", spy)
    s.set("x", (new + 1).double())  # a schema change planned from a stale header: STALE, then retried
    assert deleted == [b"STALE", b"OK"]
    assert torch.equal(other["x"], (new + 1).double())
    assert not real.client().keys("*:stage:*")
    s.clear_redis()


def test_plain_scan_matches_the_general_scan():
    """The fast upload scan (plain TensorDicts, key dicts read directly) finds what the general one finds."""
    from tdstore._front.upload_scan import scan, scan_plain

    els = [
        TensorDict(a=torch.randn(2, 3), n=TensorDict(b=torch.arange(i + 1), c=TensorDict(d=torch.zeros(1, dtype=torch.int8))))
        for i in range(5)
    ]
    fast, slow = scan_plain(els), scan(els)
    assert fast is not None and fast[0] == slow[0]
    assert [(x.path, x.dtype, x.shape, x.ndim) for x in fast[1]] == [(x.path, x.dtype, x.shape, x.ndim) for x in slow[1]]
    assert all(np.array_equal(x.element_bytes(), y.element_bytes()) for x, y in zip(fast[1], slow[1]))
    assert all(a is b for x, y in zip(fast[1], slow[1]) for a, b in zip(x.tensors, y.tensors))
    # anything unusual goes to the general scan, which words the error
    assert scan_plain([*els, TensorDict(a=torch.randn(2, 3))]) is None  # keys in some elements only
    assert scan_plain([TensorDict(a=torch.zeros(2)), TensorDict(a=torch.zeros(2, dtype=torch.int64))]) is None  # two dtypes
    assert scan_plain([TensorDict(a=torch.zeros(2)), TensorDict(a=torch.zeros(2, 2))]) is None  # two ndims
    assert scan_plain([lazy_stack([TensorDict(a=torch.zeros(1))])]) is None  # not a plain TensorDict
