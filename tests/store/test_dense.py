"""The dense TensorDictStore: every read and write checked against the same operation on a local TensorDict."""

from __future__ import annotations

import pickle
import sys
from unittest import mock

import pytest
import torch
from helpers import assert_same, round_trips, top_level_commands
from tensordict import TensorDict, tensorclass

import tdstore
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore.inspect_store import list_stores
from tdstore.server import EmbeddedServer


def local_td(bs=(6,)) -> TensorDict:
    n = int(torch.Size(bs).numel())
    return TensorDict(
        obs=torch.arange(n * 3, dtype=torch.float32).reshape((*bs, 3)),
        done=(torch.arange(n) % 2 == 0).reshape((*bs, 1)),
        nested=TensorDict(b=torch.arange(n, dtype=torch.int64).reshape(bs) * 10, batch_size=bs),
        batch_size=bs,
    )


@pytest.fixture(params=[(6,), (3, 4), ()], ids=["bs6", "bs3x4", "bs_empty"])
def pair(request, backend):
    local = local_td(request.param)
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    return store, local.clone()


READS = {
    "int": 1,
    "negative int": -1,
    "slice": slice(1, 3),
    "step slice": slice(0, None, 2),
    "reversed": slice(None, None, -1),
    "list": [2, 0, 2],
    "tensor": torch.tensor([1, 0]),
    "mask": "mask",
    "ellipsis": Ellipsis,
    "2d": (slice(0, 2), 1),
}


@pytest.mark.parametrize("name", list(READS))
def test_index_reads_match_local(pair, name):
    store, local = pair
    idx = READS[name]
    if name == "mask":
        idx = torch.arange(local.batch_size[0]) % 2 == 1 if local.batch_size else torch.tensor(True)
    if not local.batch_size:
        if name != "ellipsis":
            with pytest.raises(IndexError):
                store[idx]
            return
    if name == "2d" and len(local.batch_size) < 2:
        pytest.skip("needs two batch dims")
    got = store[idx]
    # a TensorDict refuses negative steps, which a store takes (as numpy): compare with the same rows by index
    want = local[torch.arange(local.batch_size[0] - 1, -1, -1)] if name == "reversed" else local[idx]
    assert_same(got.to_tensordict() if isinstance(got, TensorDictStore) else got, want)


@pytest.mark.parametrize("name", ["int", "slice", "step slice", "list", "tensor", "mask", "2d"])
def test_index_writes_match_local(pair, name):
    store, local = pair
    if not local.batch_size:
        pytest.skip("a batch size of [] has no index to write but ...")
    idx = READS[name] if name != "mask" else torch.arange(local.batch_size[0]) % 2 == 1
    if name == "2d" and len(local.batch_size) < 2:
        pytest.skip("needs two batch dims")
    value = (local[idx] * 0 + 7).to_tensordict() if hasattr(local[idx], "to_tensordict") else local[idx] * 0 + 7
    value["done"] = ~local[idx]["done"]
    store[idx] = value
    local[idx] = value
    assert_same(store.to_tensordict(), local)
    store[idx] = 0
    local[idx] = 0
    assert_same(store.to_tensordict(), local)


def test_key_reads_writes_and_schema_changes(pair):
    store, local = pair
    bs = local.batch_size
    assert torch.equal(store["obs"], local["obs"]) and torch.equal(store["nested", "b"], local["nested", "b"])
    store["new"] = torch.ones((*bs, 2), dtype=torch.int16)
    local["new"] = torch.ones((*bs, 2), dtype=torch.int16)
    store["obs"] = torch.zeros((*bs, 5), dtype=torch.float64)  # replacing a key may change dtype and shape
    local["obs"] = torch.zeros((*bs, 5), dtype=torch.float64)
    store.set_("done", torch.ones((*bs, 1), dtype=torch.bool))
    local.set_("done", torch.ones((*bs, 1), dtype=torch.bool))
    del store["new"]
    del local["new"]
    store.rename_key_("done", "finished")
    local.rename_key_("done", "finished")
    assert_same(store.to_tensordict(), local)
    key, value = store.popitem()
    assert_same(value, local.pop(key)) if not isinstance(value, torch.Tensor) else torch.equal(
        value, local.pop(key)
    )  # (the order of keys after a rename may differ from a TensorDict's)
    assert key not in store.keys(include_nested=True)
    assert_same(store.to_tensordict(), local)
    store.update(TensorDict(extra=torch.ones(bs), nested=TensorDict(c=torch.zeros(bs), batch_size=bs), batch_size=bs))
    local.update(TensorDict(extra=torch.ones(bs), nested=TensorDict(c=torch.zeros(bs), batch_size=bs), batch_size=bs))
    assert_same(store.to_tensordict(), local)
    with pytest.raises(KeyError, match="absent"):
        store.set_("absent", torch.zeros(bs))
    with pytest.raises(KeyError, match="absent"):
        store.update_(TensorDict(absent=torch.zeros(bs), batch_size=bs))
    store.zero_()
    local.zero_()
    store.fill_("extra", 3)
    local.fill_("extra", 3)
    assert_same(store.to_tensordict(), local)


def test_nested_key_is_a_write_through_view(pair):
    store, local = pair
    bs = local.batch_size
    view = store["nested"]
    assert isinstance(view, TensorDictStore) and view.batch_size == bs
    view["c"] = torch.full(bs, 5)
    view["b"] = torch.zeros(bs, dtype=torch.int64)
    assert torch.equal(store["nested", "c"], torch.full(bs, 5)) and not store["nested", "b"].any()
    assert sorted(view.keys()) == ["b", "c"] and "c" in store["nested"].keys()
    del view["c"]
    assert ("nested", "c") not in store.keys(include_nested=True)
    assert_same(view.to_tensordict(), store.to_tensordict()["nested"])


def test_bad_writes_raise_before_writing(pair):
    store, local = pair
    bs = local.batch_size
    before = store.to_tensordict()
    with pytest.raises(TypeError, match="obs"):
        store.set_("obs", torch.zeros(*bs, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="done"):
        store.update(
            {"obs": torch.zeros(*bs, 3), "done": torch.zeros(9, 9, dtype=torch.bool)}, inplace=True
        )  # 'done' is bad: nothing written
    if bs:
        with pytest.raises(ValueError, match="one shape per key"):
            store[0] = TensorDict(obs=torch.zeros(*bs[1:], 4), batch_size=bs[1:])
        with pytest.raises(ValueError, match="one shape per key"):  # the new key is not created either
            store[0] = TensorDict(brand_new=torch.zeros(bs[1:]), obs=torch.zeros(*bs[1:], 4), batch_size=bs[1:])
    assert_same(store.to_tensordict(), before)


def test_clone_copies_on_the_server_and_clone_false_shares(pair, backend):
    store, local = pair
    copy = store.clone()
    assert isinstance(copy, TensorDictStore) and copy.td_id != store.td_id
    assert_same(copy.to_tensordict(), local)
    copy["obs"] = copy["obs"] + 1  # the copy is independent
    assert_same(store.to_tensordict(), local)
    shallow = store.clone(False)
    shallow["obs"] = shallow["obs"] * 0
    assert not store["obs"].any()
    assert store["nested"].clone().__class__ is TensorDict  # a view clones into local memory
    copy.clear_redis()


def test_clone_is_one_atomic_call(real):
    store = TensorDictStore.from_tensordict(local_td(), **real.kwargs())
    store.clone().clear_redis()  # warm: copy.lua loaded
    cmds = top_level_commands(real.client, lambda: store.clone())
    assert cmds == ["evalsha"]  # the new handle knows its header from the copy's own check


def test_constructor_attaches_and_refuses_other_layouts(backend):
    a = TensorDictStore(batch_size=[4], td_id="dense-a", **backend.kwargs())
    a["x"] = torch.arange(4)
    b = TensorDictStore(batch_size=[4], td_id="dense-a", **backend.kwargs())
    assert torch.equal(b["x"], torch.arange(4))
    with pytest.raises(ValueError, match="batch size"):
        TensorDictStore(batch_size=[5], td_id="dense-a", **backend.kwargs())
    with pytest.raises(TypeError, match="dense"):
        LazyStackedTensorDictStore(count=4, td_id="dense-a", **backend.kwargs())
    with pytest.raises(TypeError, match="dense"):
        LazyStackedTensorDictStore.from_store(td_id="dense-a", **backend.kwargs())
    again = TensorDictStore.from_store(td_id="dense-a", **backend.kwargs())
    assert isinstance(again, TensorDictStore) and again.batch_size == (4,)


def test_from_dict_and_from_schema(backend, real):
    d = TensorDictStore.from_dict({"a": torch.zeros(3, 2), "n": {"b": torch.ones(3)}}, batch_size=[3], **backend.kwargs())
    assert d.batch_size == (3,) and torch.equal(d["n", "b"], torch.ones(3))
    s = TensorDictStore.from_schema(
        {"obs": ([84, 84, 3], torch.uint8), ("n", "r"): ([], torch.float32)}, batch_size=[16], **backend.kwargs()
    )
    assert s["obs"].shape == (16, 84, 84, 3) and s["obs"].dtype == torch.uint8 and not s["obs"].any()
    assert s["n", "r"].shape == (16,)
    with pytest.raises(TypeError, match="dtype"):
        TensorDictStore.from_schema({"x": ([2], "float32")}, batch_size=[2], **backend.kwargs())


def test_a_refused_schema_leaves_nothing_on_the_server(backend):
    """from_schema checks every entry, and that the store fits, before creating it. Before, each of these
    (but the float size, which was truncated to 2) raised, saying nothing was written, after creating an
    empty "ready" store that tdstore ls listed."""
    cases = [
        ({"x": ([2], "float32")}, [2], {}, TypeError, "not a torch.dtype"),
        ({"x": ([2, -1], torch.float32)}, [2], {}, ValueError, "negative size"),
        ({"x": ([2.5], torch.float32)}, [2], {}, TypeError, "must hold ints"),
        ({"x": ([2], torch.float32), ("x", "y"): ([], torch.float32)}, [2], {}, KeyError, "parent"),
        ({"x": ([1024], torch.float32)}, [1 << 20], {"segment_bytes": 4096}, ValueError, "1048576 segments"),
    ]
    for schema, batch_size, extra, error, match in cases:
        with pytest.raises(error, match=match):
            TensorDictStore.from_schema(schema, batch_size=batch_size, **backend.kwargs(**extra))
        assert backend.keys() == [], match
        if backend.name != "cluster":  # (the registry tdstore ls reads)
            assert list_stores(backend.client(), backend.prefix).stores == [], match


def test_a_schema_too_big_for_the_server_leaves_nothing_on_it():
    """A store past maxmemory, or a key one element of which is larger than one string may be, is refused
    before the store is created. Before, the first left an empty store; the second was made, and only its
    first write would have failed."""
    with EmbeddedServer(extra_args=["--maxmemory", "50mb", "--proto-max-bulk-len", "1mb"]) as srv:
        with pytest.raises(MemoryError, match=r"320000000 bytes.*maxmemory \(52428800 bytes\); nothing was written"):
            TensorDictStore.from_schema({"x": ([4], torch.float32)}, batch_size=[20_000_000], url=srv.url, prefix="p")
        with pytest.raises(ValueError, match=r"key 'x' needs 2097152 bytes.*proto-max-bulk-len"):
            TensorDictStore.from_schema({"x": ([1 << 19], torch.float32)}, batch_size=[4], url=srv.url, prefix="p")
        assert srv.client().keys("p:*") == [] and list_stores(srv.client(), "p").stores == []
        ok = TensorDictStore.from_schema({"x": ([1 << 17], torch.float32)}, batch_size=[4], url=srv.url, prefix="p")
        assert [s.td_id for s in list_stores(srv.client(), "p").stores] == [ok.td_id]


def test_from_schema_sends_no_data(real):
    client = real.client()
    before = client.info("stats")["total_net_input_bytes"]
    store = TensorDictStore.from_schema({"big": ([1024, 1024], torch.float32)}, batch_size=[8], **real.kwargs())  # 32 MiB of zeros
    sent = client.info("stats")["total_net_input_bytes"] - before
    keys, segs = store._engine.keys, store._engine.header.segments
    assert segs.n == 8  # 4 MiB per element, 4 MiB segments by default
    assert sent < 1 << 20, sent  # no data crossed the network
    # nothing is allocated until written: reads of segments never written give zeros
    assert sum(client.strlen(keys.data(0, k)) for k in range(segs.n)) == 0
    assert store["big"][7, 1023, 1023].item() == 0.0 and not store["big"].any()
    # the first write of an element allocates its segment only (the server fills the rest with zeros)
    store[5] = TensorDict(big=torch.ones(1024, 1024))
    assert [client.strlen(keys.data(0, k)) for k in range(segs.n)] == [0, 0, 0, 0, 0, 4 << 20, 0, 0]
    assert torch.equal(store["big"].sum(dim=(1, 2)), torch.tensor([0.0] * 5 + [1024.0 * 1024] + [0.0] * 2))


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


@tensorclass
class Unregistered:
    obs: torch.Tensor


def test_tensorclass_round_trip_by_allow_list(backend, monkeypatch):
    monkeypatch.setattr(tdstore._format.tensorclass, "_REGISTRY", {})  # registrations stay inside this test
    tc = Transition(obs=torch.ones(4, 2), reward=torch.arange(4.0), batch_size=[4])
    out = TensorDictStore.from_tensordict(tc, **backend.kwargs())  # the store, as tensordict.store returns
    assert (
        isinstance(out, TensorDictStore)
        and out.tensorclass_path == f"{__name__}.Transition"
        and torch.equal(out["reward"], torch.arange(4.0))
    )
    td_id = out.td_id
    # not registered and not given: the name on the server is never imported; the plain store comes back
    with pytest.warns(UserWarning, match="tensorclass_cls="), mock.patch.dict(sys.modules, {__name__: None}):
        plain = TensorDictStore.from_store(td_id=td_id, **backend.kwargs())
    assert isinstance(plain, TensorDictStore)
    given = TensorDictStore.from_store(td_id=td_id, tensorclass_cls=Transition, **backend.kwargs())
    assert isinstance(given, Transition) and torch.equal(given.obs, torch.ones(4, 2))
    with pytest.raises(TypeError, match="Transition"):
        TensorDictStore.from_store(td_id=td_id, tensorclass_cls=Unregistered, **backend.kwargs())
    tdstore.register_tensorclass(Transition)
    assert isinstance(TensorDictStore.from_store(td_id=td_id, **backend.kwargs()), Transition)
    given.reward = torch.zeros(4)  # writes through to the server
    assert not plain["reward"].any()


def test_a_server_named_class_is_never_imported(backend, monkeypatch):
    store = TensorDictStore.from_tensordict(local_td(), **backend.kwargs())
    backend.client().hset(store._engine.keys.meta, "tensorclass", "os.system")
    imported = []
    real_import = __import__
    monkeypatch.setattr("builtins.__import__", lambda name, *a, **k: imported.append(name) or real_import(name, *a, **k))
    with pytest.warns(UserWarning, match="os.system"):
        again = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert isinstance(again, TensorDictStore) and "os" not in imported


def test_pickles_and_locks(backend):
    store = TensorDictStore.from_tensordict(local_td(), **backend.kwargs())
    if backend.server is not None:
        again = pickle.loads(pickle.dumps(store["nested"]))
        assert torch.equal(again["b"], store["nested", "b"])
    store.lock_()
    with pytest.raises(RuntimeError, match="locked"):
        store["new"] = torch.zeros(6)
    store["obs"] = torch.zeros(6, 3)  # existing keys are still written in place
    assert not store["obs"].any()
    store.unlock_()
    store["new"] = torch.zeros(6)


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("key read", lambda s: s["obs"]),
        ("nested key read", lambda s: s["nested", "b"]),
        ("row read", lambda s: s[2]),
        ("slice read", lambda s: s[1:4]),
        ("index read", lambda s: s[torch.tensor([5, 0])]),
        ("to_tensordict", lambda s: s.to_tensordict()),
        ("key write", lambda s: s.__setitem__("obs", torch.zeros(6, 3))),
        ("new key", lambda s: s.set("tmp", torch.zeros(6))),
        (
            "row write",
            lambda s: s.__setitem__(
                2, TensorDict(obs=torch.ones(3), done=torch.ones(1, dtype=torch.bool), nested=TensorDict(b=torch.tensor(1)), batch_size=[])
            ),
        ),
        ("fill", lambda s: s.fill_("obs", 2)),
        ("zero_", lambda s: s.zero_()),
        ("nested view write", lambda s: s["nested"].__setitem__("b", torch.zeros(6, dtype=torch.int64))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_one_round_trip(real, name, op):
    store = TensorDictStore.from_tensordict(local_td(), **real.kwargs())
    store[0] = store[0]  # warm: scripts loaded, header cached
    assert len(round_trips(top_level_commands(real.client, lambda: op(store)))) == 1
