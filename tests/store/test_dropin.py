"""A port from ``tensordict.store`` 0.15.3 (issue #16): the calls a reference user makes, with only
the import changed, give the same results; where the reference is wrong (it imports modules a
server names, it reads chat rows wrong) tdstore's correct behaviour is asserted instead.

Points covered here: chat-style nested batch sizes (3), tensorclasses (4) and the small
differences a port trips on (5). Behaviour runs on a real server, fakeredis and a cluster
(``backend``); round trips are counted on the real server (``real``).
"""

from __future__ import annotations

import json
import pickle
import sys
import types
import warnings

import pytest
import tensordict
import torch
from helpers import round_trips, top_level_commands
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, lazy_stack, tensorclass

import tdstore
from tdstore import LazyStackedTensorDictStore, StoreFormatError, TensorDictStore  # was: from tensordict.store import TensorDictStore


@tensorclass
class Obs:
    obs: torch.Tensor


@tensorclass
class Other:
    obs: torch.Tensor


# -- 3. chat-style nested batch sizes ------------------------------------------------------------


def chat_td(n: int = 5, word: str = "x") -> TensorDict:
    """The reference's chat layout: a ``[n]`` tensordict whose ``("chat", "prompt")`` has batch ``[n, 1]``."""
    with tensordict.set_list_to_stack(True):
        td = TensorDict({"chat": {"prompt": {"role": [["user"]] * n, "content": [[f"{word}{i}"] for i in range(n)]}}}, batch_size=[n])
        td["chat", "prompt"].batch_size = [n, 1]
        td["chat", "prompt", "tokens"] = torch.arange(n * 3).reshape(n, 1, 3)
        td["reward"] = torch.arange(float(n))
    return td


def one_turn(word: str, batch: tuple[int, ...] = ()) -> TensorDict:
    """One row (``batch=()``) or rows (``batch=(k,)``) of chat, as ``store[i] = td`` writes them."""
    k = batch[0] if batch else None
    with tensordict.set_list_to_stack(True):
        if k is None:
            td = TensorDict({"chat": {"prompt": {"role": ["user"], "content": [word]}}}, batch_size=[])
            td["chat", "prompt"].batch_size = [1]
            td["chat", "prompt", "tokens"] = torch.full((1, 3), 100)
            td["reward"] = torch.tensor(-1.0)
        else:
            td = TensorDict({"chat": {"prompt": {"role": [["user"]] * k, "content": [[f"{word}{i}"] for i in range(k)]}}}, batch_size=[k])
            td["chat", "prompt"].batch_size = [k, 1]
            td["chat", "prompt", "tokens"] = torch.full((k, 1, 3), 100)
            td["reward"] = torch.full((k,), -1.0)
    return td


def same_chat(got, want) -> None:
    """Batch sizes of every sub-tree, the per-row lists and the tensors, as a local TensorDict has them."""
    assert got.batch_size == want.batch_size
    assert got["chat"].batch_size == want["chat"].batch_size
    assert got["chat", "prompt"].batch_size == want["chat", "prompt"].batch_size
    for key in ("role", "content"):
        g, w = got["chat", "prompt", key], want["chat", "prompt", key]
        assert (g.tolist() if hasattr(g, "tolist") else g) == (w.tolist() if hasattr(w, "tolist") else w), key
    assert torch.equal(got["chat", "prompt", "tokens"], want["chat", "prompt", "tokens"])
    assert torch.equal(got["reward"], want["reward"])


def test_chat_subtree_keeps_its_batch_size(backend):
    local = chat_td()
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    # the reference keeps [5, 1] here as well; tdstore used to give [5]
    assert store["chat", "prompt"].batch_size == torch.Size([5, 1])
    assert store["chat"].batch_size == torch.Size([5])
    same_chat(store.to_tensordict(), local)
    for index in (0, 3, -1, slice(1, 4), slice(None, None, 2), torch.tensor([4, 1]), torch.tensor([True, False, True, False, True])):
        same_chat(store[index], local[index])
    # the sub-tree view indexes its own dims, the store's rows on the server and the rest locally
    view = store["chat", "prompt"]
    for index in ((0, 0), (slice(1, 3), 0), (Ellipsis, 0), 2):
        got, want = view[index], local["chat", "prompt"][index]
        assert got.batch_size == want.batch_size
        assert (
            got["content"] == want["content"] if isinstance(want["content"], str) else got["content"].tolist() == want["content"].tolist()
        )
        assert torch.equal(got["tokens"], want["tokens"])
    assert store["chat", "prompt", "content"].tolist() == local["chat", "prompt", "content"].tolist()


def test_chat_rows_write_and_read_back_per_element(backend):
    local = chat_td()
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    store[0] = one_turn("hello")
    local[0] = one_turn("hello")
    store[2:4] = one_turn("bye", (2,))
    local[2:4] = one_turn("bye", (2,))
    same_chat(store.to_tensordict(), local)
    # the reference reads row 1 of s[0:2] as every row's list ([['x'], ['x'], ...]); tdstore reads row 1
    two = store[0:2]
    assert two["chat", "prompt", "content"].tolist() == [["hello"], ["x1"]]
    assert store[0]["chat", "prompt"].batch_size == torch.Size([1])
    assert store[0]["chat", "prompt", "content"] == ["hello"]


def test_chat_subtree_batch_size_survives_handles_pickles_and_renames(backend):
    local = chat_td()
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    again = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    same_chat(again.to_tensordict(), local)
    if backend.name != "fakeredis":  # (a pickled handle reconnects by address, which fakeredis has not)
        same_chat(pickle.loads(pickle.dumps(store)).to_tensordict(), local)
    store.rename_key_("chat", "talk")
    assert store["talk", "prompt"].batch_size == torch.Size([5, 1])
    # a key added for the whole sub-tree keeps to its batch dims; a contradicting one is refused by name
    store["talk", "prompt", "mask"] = torch.ones(5, 1, dtype=torch.bool)
    before = store.to_tensordict()
    with pytest.raises(ValueError, match="bad") as err:
        store["talk", "prompt", "bad"] = torch.zeros(5, 3)
    assert "[1]" in str(err.value)
    same_chat(store.to_tensordict().rename_key_("talk", "chat"), before.rename_key_("talk", "chat"))
    assert ("talk", "prompt", "bad") not in store.keys(include_nested=True)
    with pytest.raises(RuntimeError):  # a local TensorDict refuses it as well
        local["chat", "prompt", "bad"] = torch.zeros(5, 3)


def test_chat_store_of_an_older_tdstore_reads_as_before(backend):
    """A header without the sub-tree record (written by a tdstore before this change) still reads: the store's batch size."""
    local = chat_td()
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    client = backend.client()
    meta = store._engine.keys.meta
    schema = json.loads(client.hget(meta, "schema"))
    assert schema["sub"] == [[["chat", "prompt"], [1]]]
    del schema["sub"]
    client.hset(meta, "schema", json.dumps(schema, separators=(",", ":")))
    old = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    got = old.to_tensordict()
    assert got["chat", "prompt"].batch_size == torch.Size([5])
    assert torch.equal(got["chat", "prompt", "tokens"], local["chat", "prompt", "tokens"])
    assert [c.data for c in got["chat", "prompt"].get("content").tensordicts] == [[f"x{i}"] for i in range(5)]
    # a malformed record is refused, not guessed at
    client.hset(meta, "schema", json.dumps({**schema, "sub": [[["chat"], [-2]]]}))
    with pytest.raises(StoreFormatError):
        TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())


def test_chat_lazy_stack_keeps_element_subtrees(backend):
    local = lazy_stack([one_turn(f"w{i}") for i in range(4)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert store[1]["chat", "prompt"].batch_size == torch.Size([1])
    assert store[1]["chat", "prompt", "content"] == ["w1"]
    whole = store.to_tensordict()
    assert whole["chat", "prompt"].batch_size == torch.Size([4, 1])
    assert whole["chat", "prompt", "content"].tolist() == [["w0"], ["w1"], ["w2"], ["w3"]]
    # elements whose sub-trees disagree are refused, naming the sub-tree (tensordict's lazy_stack refuses them too)
    flat = TensorDict({"chat": {"prompt": {"tokens": torch.zeros(1, 3)}}}, batch_size=[])
    with pytest.raises(ValueError, match=r"\('chat', 'prompt'\).*element 1"):
        tdstore._front.upload._subtrees([one_turn("a"), flat], 0)


def test_chat_row_read_is_one_round_trip(real):
    store = TensorDictStore.from_tensordict(chat_td(), **real.kwargs())
    store[0]  # noqa: B018  (warm: scripts loaded)
    assert len(round_trips(top_level_commands(real.client, lambda: store[1]))) == 1
    assert len(round_trips(top_level_commands(real.client, lambda: store["chat", "prompt"][1, 0]))) == 1


@tensorclass
class Inner:
    x: torch.Tensor
    name: str


def test_nested_tensorclass_written_as_tensordict_keeps_its_non_tensor_fields(backend):
    local = TensorDict(inner=TensorDict(x=torch.zeros(5, 2), name=NonTensorStack(*"abcde"), batch_size=[5]), batch_size=[5])
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    tc = Inner(x=torch.ones(2), name="zed", batch_size=[])
    store[1] = TensorDict(inner=tc.to_tensordict())
    local[1] = TensorDict(inner=tc.to_tensordict())
    assert store[1]["inner", "name"] == local[1]["inner", "name"] == "zed"
    assert store["inner", "name"] == list(local["inner", "name"]) == ["a", "zed", "c", "d", "e"]
    assert torch.equal(store["inner", "x"], local["inner", "x"])
    # a tensorclass field that is a tensorclass, uploaded whole, reads back field by field
    outer = TensorDictStore.from_tensordict(
        TensorDict(inner=Inner(x=torch.ones(3, 2), name=NonTensorStack("p", "q", "r"), batch_size=[3]), batch_size=[3]), **backend.kwargs()
    )
    assert outer["inner", "name"] == ["p", "q", "r"] and torch.equal(outer["inner", "x"], torch.ones(3, 2))


# -- 4. tensorclasses ----------------------------------------------------------------------------


def test_from_tensordict_of_a_tensorclass_returns_the_store_with_its_class_path(backend):
    store = TensorDictStore.from_tensordict(Obs(obs=torch.zeros(3, 2), batch_size=[3]), **backend.kwargs())
    assert type(store) is TensorDictStore  # as the reference returns
    assert store._tensorclass_cls == store.tensorclass_path == f"{__name__}.Obs"
    assert torch.equal(store["obs"], torch.zeros(3, 2))
    plain = TensorDictStore.from_tensordict(TensorDict(a=torch.zeros(3), batch_size=[3]), **backend.kwargs())
    assert plain._tensorclass_cls is None and plain.tensorclass_path is None
    assert store["obs"] is not None and TensorDictStore(batch_size=[2], **backend.kwargs())._tensorclass_cls is None
    # pickles keep the class path
    assert pickle.loads(pickle.dumps(store))._tensorclass_cls == f"{__name__}.Obs"


def test_from_store_gives_the_tensorclass_back_and_writes_through(backend):
    store = TensorDictStore.from_tensordict(Obs(obs=torch.zeros(3, 2), batch_size=[3]), **backend.kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the class's module is imported here: no warning
        restored = TensorDictStore.from_store(td_id=store._td_id, **backend.kwargs())
    assert isinstance(restored, Obs) and restored._tensordict._tensorclass_cls == f"{__name__}.Obs"
    restored.obs = torch.ones(3, 2)  # reaches the server
    assert torch.equal(store["obs"], torch.ones(3, 2))
    by_class = TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls=Obs, **backend.kwargs())
    by_path = TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls=f"{__name__}.Obs", **backend.kwargs())
    assert isinstance(by_class, Obs) and isinstance(by_path, Obs)
    assert isinstance(pickle.loads(pickle.dumps(restored)), Obs)
    with pytest.raises(TypeError, match="Obs"):
        TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls=Other, **backend.kwargs())
    with pytest.raises(TypeError, match="not a tensorclass"):
        TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls="json.JSONDecoder", **backend.kwargs())
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls="no_such_module_xyz.Obs", **backend.kwargs())


def test_a_class_path_the_server_names_is_never_imported(backend, monkeypatch):
    store = TensorDictStore.from_tensordict(Obs(obs=torch.zeros(3, 2), batch_size=[3]), **backend.kwargs())
    client = backend.client()
    meta = store._engine.keys.meta
    imported: list[str] = []
    real_import = __import__
    monkeypatch.setattr("builtins.__import__", lambda name, *a, **k: imported.append(name) or real_import(name, *a, **k))
    # the reference imports this module (then fails); tdstore warns and returns the plain store
    client.hset(meta, "tensorclass", "tdstore_dropin_never_imported.Foo")
    with pytest.warns(UserWarning, match=r"tdstore_dropin_never_imported\.Foo.*tensorclass_cls="):
        got = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert type(got) is TensorDictStore and got._tensorclass_cls == "tdstore_dropin_never_imported.Foo"
    assert "tdstore_dropin_never_imported" not in sys.modules and "tdstore_dropin_never_imported" not in imported
    # an imported module is looked up without running its module __getattr__ (a lazy importer)
    lazy = types.ModuleType("tdstore_dropin_lazy")
    asked: list[str] = []
    lazy.__getattr__ = lambda name: asked.append(name) or Obs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tdstore_dropin_lazy", lazy)
    client.hset(meta, "tensorclass", "tdstore_dropin_lazy.Obs")
    with pytest.warns(UserWarning, match="tdstore_dropin_lazy.Obs"):
        got = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert type(got) is TensorDictStore and asked == []


def test_registered_tensorclass_comes_back(backend, monkeypatch):
    monkeypatch.setattr(tdstore._format.tensorclass, "_REGISTRY", {})
    store = TensorDictStore.from_tensordict(Obs(obs=torch.zeros(2, 1), batch_size=[2]), **backend.kwargs())
    monkeypatch.delitem(sys.modules, __name__)  # as if the class's module were not imported
    with pytest.warns(UserWarning):
        assert type(TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())) is TensorDictStore
    tdstore.register_tensorclass(Obs)
    assert isinstance(TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs()), Obs)


def test_tensorclass_resolution_adds_no_round_trip(real):
    store = TensorDictStore.from_tensordict(Obs(obs=torch.zeros(2, 1), batch_size=[2]), **real.kwargs())
    client = real.client()
    client.ping()  # connected before counting
    plain = TensorDictStore.from_tensordict(TensorDict(obs=torch.zeros(2, 1), batch_size=[2]), **real.kwargs())
    tc = round_trips(
        top_level_commands(real.client, lambda: TensorDictStore.from_store(td_id=store.td_id, client=client, prefix=real.prefix))
    )
    pl = round_trips(
        top_level_commands(real.client, lambda: TensorDictStore.from_store(td_id=plain.td_id, client=client, prefix=real.prefix))
    )
    assert tc == pl == ["hgetall"]


# -- 5. small differences ----------------------------------------------------------------------


def nested_store(backend, **kwargs):
    return TensorDictStore.from_tensordict(
        TensorDict(a=torch.zeros(3, 2), nested=TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3]), **backend.kwargs(**kwargs)
    )


def test_entry_class_of_a_subtree_is_the_store_class(backend):
    store = nested_store(backend)
    assert store.entry_class("nested") is TensorDictStore is type(store["nested"])
    assert store.entry_class("a") is torch.Tensor
    assert store.entry_class(("nested", "b")) is torch.Tensor


def test_share_memory_raises_not_implemented(backend):
    store = nested_store(backend)
    with pytest.raises(NotImplementedError, match="share_memory_"):
        store.share_memory_()
    assert torch.equal(store["a"], torch.zeros(3, 2))


@pytest.mark.parametrize("cls", [TensorDictStore, LazyStackedTensorDictStore])
def test_from_store_of_an_unknown_id(backend, cls):
    with pytest.raises(KeyError) as err:
        cls.from_store(td_id="no-such-id", **backend.kwargs())
    text = err.value.args[0]
    assert text.startswith("No TensorDictStore with td_id='no-such-id'")
    assert f"under prefix {backend.prefix!r} on " in text
    if backend.name != "fakeredis":  # (each fakeredis client names a random host)
        assert TensorDictStore(batch_size=[1], **backend.kwargs())._engine.spec.describe() in text


def test_meta_cache_full_key_path_and_td_id(backend):
    store = nested_store(backend)
    expect = {"a": ([3, 2], torch.float32), "nested.b": ([3], torch.float32)}
    assert store._meta_cache == expect and store["nested"]._meta_cache == expect
    assert store._full_key_path("x") == "x" and store["nested"]._full_key_path("b") == "nested.b"
    assert isinstance(store._td_id, str) and TensorDictStore.from_store(td_id=store._td_id, **backend.kwargs()).batch_size == torch.Size(
        [3]
    )
    assert nested_store(backend, cache_metadata=False)._meta_cache is None
    fresh = TensorDictStore(batch_size=[3], cache_metadata=False, **backend.kwargs())
    fresh["a"] = torch.zeros(3, 2)
    assert fresh._meta_cache is None
    lazy = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(x=torch.zeros(i + 1), y=torch.zeros(2)) for i in range(3)]), **backend.kwargs()
    )
    assert lazy._meta_cache == {"x": (None, torch.float32), "y": ([3, 2], torch.float32)}
    assert LazyStackedTensorDictStore.from_store(td_id=lazy.td_id, cache_metadata=False, **backend.kwargs())._meta_cache is None
    assert lazy._full_key_path(("p", "q")) == "p.q" and lazy._tensorclass_cls is None


def test_full_slice_is_the_store_and_writes_through(backend):
    store = TensorDictStore.from_tensordict(TensorDict(obs=torch.zeros(4, 2), act=torch.zeros(4), batch_size=[4]), **backend.kwargs())
    assert store[:] is store and store[:,] is store
    # torchrl's ReplayBuffer.set_ / set_at_ / update_ write into storage[:]
    store[:].set_("obs", torch.ones(4, 2))
    store[:].set_at_("act", torch.tensor(5.0), 2)
    store[:].update_(TensorDict(act=torch.full((4,), 7.0), batch_size=[4]), keys_to_update=["act"])
    other = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert torch.equal(other["obs"], torch.ones(4, 2)) and torch.equal(other["act"], torch.full((4,), 7.0))
    # partial slices stay local copies, as on the reference
    part = store[0:2]
    assert type(part) is TensorDict
    part.set_("obs", torch.zeros(2, 2))
    assert torch.equal(other["obs"], torch.ones(4, 2))


def test_full_slice_then_key_reads_only_that_key(real, monkeypatch):
    store = TensorDictStore.from_tensordict(TensorDict(obs=torch.zeros(4, 2), big=torch.zeros(4, 1000), batch_size=[4]), **real.kwargs())
    store["obs"]  # noqa: B018  (warm)
    asked = []
    real_read = store._engine.read
    monkeypatch.setattr(store._engine, "read", lambda index, paths=None, **kw: asked.append(paths) or real_read(index, paths, **kw))
    cmds = round_trips(top_level_commands(real.client, lambda: store[:]["obs"]))
    assert len(cmds) == 1 and asked == [[("obs",)]]


def test_lazy_store_port_names(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([TensorDict(x=torch.zeros(2)) for _ in range(3)]), **backend.kwargs())
    assert isinstance(store[:], (TensorDict, LazyStackedTensorDict))  # the lazy store's full slice is a local read, as there
    assert store._td_id == store.td_id


def test_chat_ring_sample_keeps_element_subtrees(backend):
    if getattr(backend, "spread", False):
        pytest.skip("ring calls are refused on a spread store")
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([one_turn(f"w{i}") for i in range(4)]), **backend.kwargs())
    store.extend(lazy_stack([one_turn("new0"), one_turn("new1")]))
    got = store.sample(6, generator=torch.Generator().manual_seed(0))
    assert got.td["chat", "prompt"].batch_size == torch.Size([6, 1])
    words = [row[0] for row in got.td["chat", "prompt", "content"].tolist()]
    # an upload is a full ring: the extend overwrote slots 0 and 1, slots 2 and 3 still hold the upload
    assert words == [f"new{int(s)}" if s < 2 else f"w{int(s)}" for s in got.indices]
