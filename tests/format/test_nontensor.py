"""Non-tensor data (NonTensorData, NonTensorStack, str) in both store classes, on both engines."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import top_level_commands
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore


def elements(n: int = 5) -> list[TensorDict]:
    return [
        TensorDict(
            obs=torch.full((2,), float(i)),
            text=NonTensorData(f"step {i}"),
            meta={"info": NonTensorData({"i": i, "tags": ["a"] * i, "ok": i % 2 == 0, "none": None})},
            batch_size=[],
        )
        for i in range(n)
    ]


@pytest.fixture(params=["lazy", "dense"])
def store(request, backend):
    els = elements()
    if request.param == "lazy":
        return LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), **backend.kwargs())
    return TensorDictStore.from_tensordict(torch.stack(els), **backend.kwargs())


def test_round_trip_per_element_and_per_slice(store):
    assert store[1]["text"] == "step 1"
    assert store[3]["meta", "info"] == {"i": 3, "tags": ["a", "a", "a"], "ok": False, "none": None}
    assert list(store["text"]) == [f"step {i}" for i in range(5)]
    assert list(store[1:4]["text"]) == ["step 1", "step 2", "step 3"]
    assert list(store[[4, 0]]["text"]) == ["step 4", "step 0"]
    local = store.to_tensordict()
    assert [local[i]["text"] for i in range(5)] == [f"step {i}" for i in range(5)]
    assert torch.equal(local["obs"][2], torch.full((2,), 2.0))


def test_element_writes_change_one_element(store):
    store[2] = TensorDict(
        obs=torch.zeros(2), text=NonTensorData("a much longer replacement text"), meta={"info": NonTensorData([1, 2])}, batch_size=[]
    )
    assert list(store["text"]) == ["step 0", "step 1", "a much longer replacement text", "step 3", "step 4"]
    assert store[2]["meta", "info"] == [1, 2] and store[3]["meta", "info"]["i"] == 3
    store.set("text", NonTensorStack.from_list([f"new {i}" for i in range(5)]))
    assert store[4]["text"] == "new 4"


def test_a_plain_str_is_stored(store):
    store.set("label", "shared text")  # the reference silently does nothing here
    assert store[0]["label"] == "shared text" and store[4]["label"] == "shared text"
    assert "label" in store.keys()


def test_element_write_moves_only_that_element(real):
    n = 2_000
    els = [TensorDict(text=NonTensorData("x" * 100 + str(i)), batch_size=[]) for i in range(n)]
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), **real.kwargs())
    store[5] = TensorDict(text=NonTensorData("y" * 100), batch_size=[])  # warm
    client = real.client()
    before = client.info("stats")["total_net_input_bytes"]
    cmds = top_level_commands(real.client, lambda: store.__setitem__(7, TensorDict(text=NonTensorData("a short one"), batch_size=[])))
    sent = client.info("stats")["total_net_input_bytes"] - before
    assert cmds == ["evalsha"]
    assert sent < 2_000, sent  # the column is over 200 kB; one element's JSON (and the call) travel
    assert store[7]["text"] == "a short one" and store[8]["text"] == "x" * 100 + "8"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ((1, 2), "tuple"),
        ({1: "a"}, "not a str"),
        (float("nan"), "finite"),
        (object(), "object"),
        ({"k": {1, 2}}, "set"),
    ],
    ids=["tuple", "int-key", "nan", "object", "nested-set"],
)
def test_values_json_cannot_hold_raise_before_writing(store, value, text):
    before = list(store["text"])
    with pytest.raises(TypeError, match=text):
        store[1] = TensorDict(obs=torch.zeros(2), text=NonTensorData(value), meta={"info": NonTensorData(1)}, batch_size=[])
    with pytest.raises(TypeError, match=text):
        store.set("other", NonTensorData(value))
    assert list(store["text"]) == before and "other" not in store.keys()
    assert store[1]["obs"].tolist() == [1.0, 1.0]


def test_tensor_and_non_tensor_keys_do_not_mix(store):
    with pytest.raises(TypeError, match="non-tensor"):
        store[0] = TensorDict(obs=torch.zeros(2), text=torch.zeros(3), meta={"info": NonTensorData(1)}, batch_size=[])
    with pytest.raises(TypeError, match="tensors"):
        store[0] = TensorDict(obs=NonTensorData("x"), text=NonTensorData("t"), meta={"info": NonTensorData(1)}, batch_size=[])
    with pytest.raises(TypeError, match="non-tensor"):
        store.fill_("text", 0)
    store.zero_()  # zeroes the tensors, leaves non-tensor data alone (as a TensorDict does)
    assert not store["obs"].any() and store[3]["text"] == "step 3"
    store.set("text", torch.arange(5))  # set() of the whole key may replace it with a tensor
    assert torch.equal(store["text"], torch.arange(5))


def test_stored_bytes_are_never_unpickled(store, backend):
    leaf = store._engine.header.leaves[("text",)] if hasattr(store, "_engine") else None
    assert leaf is not None and leaf.json
    key = store._engine.keys.data(leaf.number)

    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled a server value",))

    payload = pickle.dumps(Boom())
    client = backend.client()
    client.set(key, payload)
    offsets = [0] + [len(payload)] * 5
    client.set(store._engine.keys.offsets(leaf.number), b"".join(o.to_bytes(8, "little") for o in offsets))
    with pytest.raises(ValueError, match="not a tdstore JSON document"):
        store[0]["text"]


@pytest.mark.ring
def test_ring_buffer_with_non_tensor_keys(backend):
    ring = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    ring.extend(lazy_stack(elements(3)))
    assert ring[3]["text"] is None  # not written yet: an empty slot holds None
    ring.extend(lazy_stack(elements(2)))
    assert [ring[i]["text"] for i in range(4)] == ["step 1", "step 1", "step 2", "step 0"]
    s = ring.sample(8, torch.Generator().manual_seed(0))
    assert all(s.td[k]["text"] == f"step {int(s.td[k]['obs'][0])}" for k in range(8))


def test_dense_shared_value_reads_back_as_one_value(backend):
    d = TensorDictStore(batch_size=[3], **backend.kwargs())
    d.set("name", "run-1")
    d.set("labels", NonTensorStack.from_list(["a", "b", "c"]))
    assert d["name"] == "run-1" and list(d["labels"]) == ["a", "b", "c"]
    local = d.to_tensordict()
    assert local["name"] == "run-1" and list(local["labels"]) == ["a", "b", "c"]
    d[1] = TensorDict(name=NonTensorData("run-1"), labels=NonTensorData("B"), batch_size=[])
    assert list(d["labels"]) == ["a", "B", "c"]
    empty = TensorDictStore(**backend.kwargs())  # batch size []
    empty.set("cfg", NonTensorData({"lr": 0.1, "layers": [64, 64]}))
    assert empty["cfg"] == {"lr": 0.1, "layers": [64, 64]}
