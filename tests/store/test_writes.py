"""Every write of the seed on both engines; results checked against a local model of the stack."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, make_stack
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore


def element(i: int, tokens: int | None = None, inner: tuple[int, ...] = ()) -> TensorDict:
    td = TensorDict(batch_size=inner)
    td.set("obs", torch.full((*inner, 4), float(-i)))
    td.set("done", torch.full((*inner, 1), True))
    td.set(("nested", "b"), torch.full((*inner, 3), -i, dtype=torch.int64))
    if tokens is not None:
        td.set("tokens", torch.full((*inner, tokens), -i, dtype=torch.int64))
    return td


@pytest.fixture(params=[True, False], ids=["het", "homog"])
def setup(request, backend):
    het = request.param
    local = make_stack(6, het=het)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    model = list(local.unbind(0))
    yield het, store, model
    store.clear_redis()


def check(store, model):
    assert_same(store.to_tensordict(), lazy_stack(model))
    for i, el in enumerate(model):
        assert_same(store[i].to_tensordict(), el)


def test_element_write(setup):
    het, store, model = setup
    new = element(7, tokens=2 if het else None)
    store[3] = new
    model[3] = new
    check(store, model)


def test_element_key_write_and_update(setup):
    het, store, model = setup
    store[2]["obs"] = torch.full((4,), 9.0)
    model[2].set("obs", torch.full((4,), 9.0))
    store[4].update(TensorDict(obs=torch.full((4,), 5.0), nested=TensorDict(b=torch.zeros(3, dtype=torch.int64))))
    model[4].set("obs", torch.full((4,), 5.0))
    model[4].set(("nested", "b"), torch.zeros(3, dtype=torch.int64))
    store[1]["nested", "b"] = torch.ones(3, dtype=torch.int64)
    model[1].set(("nested", "b"), torch.ones(3, dtype=torch.int64))
    check(store, model)


@pytest.mark.parametrize(
    "index",
    [slice(1, 4), slice(0, 6, 2), slice(5, 0, -2), [4, 1], torch.tensor([0, 5]), torch.tensor([True, False, False, True, False, True])],
    ids=repr,
)
def test_index_writes(setup, index):
    het, store, model = setup
    ids = list(range(6))
    if isinstance(index, slice):
        picked = ids[index]
    elif isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        picked = [i for i in ids if index[i]]
    else:
        picked = [int(i) for i in index]
    values = [element(20 + k, tokens=1 + (k + 2) % 5 if het else None) for k in range(len(picked))]
    store[index] = lazy_stack(values)
    for i, v in zip(picked, values):
        model[i] = v
    check(store, model)


def test_shape_changing_writes_rewrite_offsets(setup):
    het, store, model = setup
    # a homogeneous key becomes heterogeneous, a heterogeneous key grows and shrinks
    grown = element(8, tokens=9 if het else None)
    grown.set("obs", torch.arange(7, dtype=torch.float32))
    store[0] = grown
    model[0] = grown
    check(store, model)
    small = element(9, tokens=1 if het else None)
    small.set("obs", torch.arange(2, dtype=torch.float32))
    store[5] = small
    model[5] = small
    check(store, model)
    mid = element(10, tokens=3 if het else None)
    store[2] = mid
    model[2] = mid
    check(store, model)
    assert store._meta_cache["obs"][0] is None  # obs is heterogeneous now


def test_set_nested_update_del_rename(setup):
    het, store, model = setup
    store.set(("nested", "c"), torch.ones(6, 2))
    for m in model:
        m.set(("nested", "c"), torch.ones(2))
    check(store, model)
    store.update(TensorDict(extra=torch.arange(6.0).unsqueeze(-1), batch_size=[6]))
    for i, m in enumerate(model):
        m.set("extra", torch.tensor([float(i)]))
    check(store, model)
    del store["extra"]
    for m in model:
        del m["extra"]
    check(store, model)
    store.rename_key_("obs", "observation")
    for m in model:
        m.rename_key_("obs", "observation")
    check(store, model)
    store.rename_key_(("nested", "b"), ("other", "b"))
    for m in model:
        m.rename_key_(("nested", "b"), ("other", "b"))
    check(store, model)


def test_set_replaces_dtype_and_shape(setup):
    het, store, model = setup
    store.set("obs", torch.zeros(6, 2, dtype=torch.float64))
    for m in model:
        m.set("obs", torch.zeros(2, dtype=torch.float64))
    check(store, model)
    with pytest.raises(TypeError, match="obs"):
        store.set_("obs", torch.zeros(6, 2, dtype=torch.float32))
    check(store, model)


def test_fill_number(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4, het=False), **backend.kwargs())
    store[1:3] = 0
    assert store["obs"][1:3].eq(0).all() and store["obs"][0].ne(0).any()
    store.clear_redis()


def test_in_place_methods_write_back(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4, het=False), **backend.kwargs())
    before = store.to_tensordict()
    store.apply_(lambda t: t * 2)
    after = store.to_tensordict()
    assert torch.equal(after["obs"], before["obs"] * 2)
    store.zero_()
    assert store["obs"].eq(0).all()
    store.clear_redis()


@pytest.mark.parametrize("stack_dim", [1, -1])
def test_stack_dim_and_inner_batch(backend, stack_dim):
    inner = (3,)
    local = make_stack(4, het=True, inner=inner, stack_dim=stack_dim)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert store.batch_size == local.batch_size == torch.Size([3, 4])
    assert_same(store.to_tensordict(), local)
    assert_same(store[:, 1].to_tensordict(), local[:, 1])
    assert_same(store[1], local[1])
    assert_same(store[0:2, 1:3], local[0:2, 1:3])
    assert_same(store[:, torch.tensor([3, 0])], local[:, torch.tensor([3, 0])])
    new = element(5, tokens=6, inner=inner)
    store[:, 2] = new
    model = list(local.unbind(1))
    model[2] = new
    assert_same(store.to_tensordict(), lazy_stack(model, dim=1))
    store.clear_redis()


def test_stack_dim_partial_row_write_homogeneous(backend):
    inner = (3,)
    local = make_stack(4, het=False, inner=inner, stack_dim=1)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    row = store[1].clone()  # a local copy of row 1 of every element
    row["obs"] = torch.full((4, 4), 7.0)
    store[1] = row
    expected = local.to_tensordict()
    expected[1] = row
    assert_same(store.to_tensordict(), expected)
    store.clear_redis()


def test_empty_selections_and_zero_size_leaves(backend):
    local = make_stack(4, het=True, inner=(3,), stack_dim=1)
    for td in local.tensordicts:
        td.set("e", torch.zeros(3, 0))
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert store[[]].batch_size == local[[]].batch_size
    assert store[:, 1:1].batch_size == local[:, 1:1].batch_size
    assert store[:, 3:1].batch_size == local[:, 3:1].batch_size
    store[:, 3:1] = local[:, 3:1]  # writes nothing, raises nothing
    homog = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4, het=False), **backend.kwargs())
    homog.set("e", torch.zeros(4, 0))
    homog[0:2] = homog[2:4]
    homog[[3, 0]] = homog[1:3]
    homog.update(homog.to_tensordict())
    homog[1] = homog[2].to_tensordict()
    assert homog["e"].shape == (4, 0)
    assert torch.equal(homog["obs"][0], homog["obs"][2])
    store.clear_redis()
    homog.clear_redis()


def test_zero_and_fill_run_on_the_server(backend):
    local = make_stack(4, het=True)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    store[2].zero_()
    assert store[2]["tokens"].tolist() == [0, 0, 0] and store[2]["obs"].eq(0).all()
    assert store[1]["tokens"].tolist() == local[1]["tokens"].tolist()
    store.fill_("tokens", 7)
    assert [t.tolist() for t in store.get("tokens", as_list=True)] == [[7] * (1 + i % 4) for i in range(4)]
    store.fill_("nested", -1)
    assert store["nested", "b"].eq(-1).all()
    store[3].fill_("obs", 2.5)
    assert store[3]["obs"].tolist() == [2.5] * 4 and store[0]["obs"].ne(2.5).all()
    store.zero_()
    full = store.to_tensordict()
    for td in full.unbind(0):
        for v in td.values(True, True):
            assert not v.any()
    with pytest.raises(KeyError, match="nope"):
        store.fill_("nope", 1)
    store.clear_redis()


def test_other_in_place_methods_read_once_and_write_once(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4, het=True), **backend.kwargs())
    before = store.to_tensordict()
    store.apply_(lambda t: t + 1 if t.dtype != torch.bool else t)
    after = store.to_tensordict()
    for a, b in zip(before.unbind(0), after.unbind(0)):
        assert torch.equal(a["tokens"] + 1, b["tokens"])
    store[1]["nested"].add_(1)  # a write-through view of one element's sub-tree
    assert torch.equal(store[1]["nested", "b"], after[1]["nested", "b"] + 1)
    assert torch.equal(store[2]["nested", "b"], after[2]["nested", "b"])
    store.clear_redis()


def test_update_keys_to_update(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())
    before = store.to_tensordict()
    new = before.clone()
    new["obs"] += 1
    new["nested", "b"] += 1
    store.update(new, keys_to_update=["nested"])
    assert torch.equal(store["nested", "b"], before["nested", "b"] + 1) and torch.equal(store["obs"], before["obs"])
    store.update_at_(new[1], 1, keys_to_update=["obs"])
    assert torch.equal(store["obs"][1], before["obs"][1] + 1) and torch.equal(store["obs"][0], before["obs"][0])
    store[2].update(new[2], keys_to_update=[("nested", "b")])
    assert torch.equal(store[2]["nested", "b"], before[2]["nested", "b"] + 1) and torch.equal(store[2]["obs"], before[2]["obs"])
    store.clear_redis()


def test_a_write_counted_in_place_moves_tr_in_the_same_call(backend):
    """``Engine.counting_in_place`` (torchrl's in-place writes): the write's own call adds 1 to the header's
    ``tr`` (a 'B' op), whatever the write (element, rows, a key, a fill, a new key); a damaged ``tr``
    refuses the write before anything is written."""
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(6, het=False), **backend.kwargs())
    engine = store._engine
    raw = backend.client()
    writes = [
        lambda: store.__setitem__(1, store[0].to_tensordict()),
        lambda: store.__setitem__(slice(2, 5), store[0:3].to_tensordict()),
        lambda: store.zero_(),
        lambda: store.set("added", torch.ones(6, 2)),
    ]
    for n, write in enumerate(writes, 1):
        with engine.counting_in_place():
            write()
        assert int(raw.hget(engine.keys.meta, "tr")) == n
    store[0] = store[1].to_tensordict()  # outside the context: not counted
    assert int(raw.hget(engine.keys.meta, "tr")) == len(writes)
    if engine.header.spread:  # cut per node (a spread store has no ring, so no torchrl buffer): segment 0 cannot hold the rest back
        return
    raw.hset(engine.keys.meta, "tr", "-1")
    before = store.to_tensordict()
    with pytest.raises(Exception, match="damaged"), engine.counting_in_place():
        store["added"] = torch.full((6, 2), 5.0)
    assert_same(store.to_tensordict(), before)
    for bad in ("-1", "9" * 20):  # an element write too (write.lua's short path hands it to the passes, which refuse it)
        raw.hset(engine.keys.meta, "tr", bad)
        with pytest.raises(Exception, match="damaged"), engine.counting_in_place():
            store[1] = store[4].to_tensordict()
        assert_same(store.to_tensordict(), before)
    store.clear_redis()
