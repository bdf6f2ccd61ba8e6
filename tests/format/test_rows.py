"""The row block (``_format.row_block``): small homogeneous leaves side by side, one row per element.

Checked on every engine: which leaves group, that reads and writes of every kind see
and leave exactly the right bytes (other columns untouched, dead columns ignored),
that leaves leave the block on delete, conversion and shape change with their data,
and that the block goes with its last leaf.  On a real server, ``INFO commandstats``
shows what the block is for: a random batch is one ``GETRANGE`` per element whatever
the number of leaves, and ``store[i] = td`` one ``SETRANGE``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_same, make_stack
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._format.schema import Header, StoreFormatError
from tdstore._format.wire import TX_WHOLE_BYTES_PER_RANGE


def _local(n: int = 40, het: bool = True):
    return make_stack(n, het=het)


def _store(backend, n: int = 40, het: bool = True, **kw) -> tuple[LazyStackedTensorDictStore, object]:
    local = _local(n, het)
    return LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs(**kw)), local


def _data_keys(backend) -> list[str]:
    return [k.decode() for k in backend.keys() if b":d:" in k]


@pytest.mark.layout
def test_upload_groups_the_small_homogeneous_leaves(backend) -> None:
    store, local = _store(backend)
    h = store._engine.header
    assert h.row is not None
    grouped = {leaf.path: leaf.col for leaf in h.leaves.values() if leaf.col is not None}
    # obs f32[4], done bool[1], nested.b i64[3] side by side in upload order; tokens keeps its own blobs
    assert grouped == {("obs",): 0, ("done",): 16, ("nested", "b"): 17}
    assert h.row[1] == 16 + 1 + 24
    assert h.leaves[("tokens",)].col is None
    if backend.name != "cluster":
        assert len(_data_keys(backend)) == 2  # the block and the heterogeneous blob
    assert_same(store.to_tensordict(), local)


def test_one_leaf_alone_or_an_inner_batch_size_does_not_group(backend) -> None:
    one = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([TensorDict(x=torch.ones(3) * i) for i in range(5)]), **backend.kwargs())
    assert one._engine.header.row is None
    inner = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4, het=False, inner=(2,)), **backend.kwargs())
    assert inner._engine.header.row is None
    big = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(a=torch.ones(2), img=torch.zeros(5000)) for _ in range(3)]), **backend.kwargs()
    )
    assert big._engine.header.row is None  # img is over the column limit, which leaves a alone


@pytest.mark.parametrize(
    "index", [3, slice(2, 30, 3), slice(None), [5, 1, 5, 39, 0], torch.randperm(40)[:25]], ids=["int", "step", "all", "list", "scattered"]
)
def test_reads_of_grouped_leaves_match_local(backend, index) -> None:
    store, local = _store(backend, het=False)
    assert_same(store[index] if not isinstance(index, int) else store[index].to_tensordict(), local[index])
    for key in ("obs", ("nested", "b"), "done"):
        assert torch.equal(store.get(key), local.get(key))
        assert torch.equal(store[index].get(key), local[index].get(key))


def test_writes_keep_the_other_columns(backend) -> None:
    store, local = _store(backend, het=False)
    # whole rows: one element, a slice, scattered rows (a later duplicate wins)
    for index in (7, slice(10, 20), torch.tensor([3, 33, 3])):
        value = make_stack(40, het=False)[index].apply(lambda t: t + 1000 if t.dtype != torch.bool else ~t)
        store[index] = value
        local[index] = value
    # some columns only: one key of one element, a key of a slice, a whole key
    store[5]["obs"] = torch.full((4,), -1.0)
    local[5]["obs"] = torch.full((4,), -1.0)
    store[0:6] = TensorDict({"nested": {"b": torch.full((6, 3), -7)}}, [6])
    local[0:6] = TensorDict({"nested": {"b": torch.full((6, 3), -7)}}, [6])
    store.set("done", torch.ones(40, 1, dtype=torch.bool))
    local.set("done", torch.ones(40, 1, dtype=torch.bool))
    assert_same(store.to_tensordict(), local.to_tensordict())
    assert store._engine.header.row is not None  # no write moved a key out of the block


def test_fill_and_zero_touch_only_their_column(backend) -> None:
    store, local = _store(backend, het=False)
    store.fill_("obs", 2.5)
    local.fill_("obs", 2.5)
    store[3].zero_()
    local[3].zero_()
    assert_same(store.to_tensordict(), local.to_tensordict())


@pytest.mark.layout
def test_delete_rename_and_retype_leave_the_block(backend) -> None:
    store, local = _store(backend, het=False)
    del store["done"]
    store.rename_key_("obs", "o")
    local = local.to_tensordict().exclude("done").rename_key_("obs", "o")
    assert_same(store.to_tensordict(), local)
    h = store._engine.header
    assert h.leaves[("o",)].col == 0 and h.row is not None  # the dead column of 'done' stays a gap
    # whole-row writes with a dead column in the row
    store[4] = local[4].apply(lambda t: t * 3)
    local[4] = local[4].apply(lambda t: t * 3)
    # a new dtype: the key gets a blob of its own
    store.set("o", local.get("o").double())
    local.set("o", local.get("o").double())
    assert store._engine.header.leaves[("o",)].col is None
    assert_same(store.to_tensordict(), local)
    # the last grouped key goes: so does the block
    del store[("nested", "b")]
    assert store._engine.header.row is None
    if backend.name != "cluster":
        assert len(_data_keys(backend)) == 1  # only o's own blob
    assert_same(store.to_tensordict(), local.exclude(("nested", "b")))


def test_a_shape_change_moves_the_key_out_with_its_data(backend) -> None:
    store, local = _store(backend, het=False)
    store[6] = TensorDict({"obs": torch.arange(7.0), "done": torch.ones(1, dtype=torch.bool), "nested": {"b": torch.arange(3)}}, [])
    h = store._engine.header
    assert h.leaves[("obs",)].het and h.leaves[("obs",)].col is None
    assert h.leaves[("done",)].col is not None
    for i in range(40):
        if i == 6:
            assert torch.equal(store[i]["obs"], torch.arange(7.0))
        else:
            assert torch.equal(store[i]["obs"], local[i]["obs"]), i
            assert torch.equal(store[i]["nested", "b"], local[i]["nested", "b"]), i


def test_segments_cut_the_block_like_any_leaf(backend) -> None:
    store, local = _store(backend, het=True, segment_bytes=4 * 41)  # four rows per segment
    h = store._engine.header
    assert h.row is not None and h.seg == 4 and h.segments.n == 10
    idx = torch.tensor([0, 39, 4, 3, 17, 22, 8, 9, 12, 30, 31])
    assert_same(store[idx], local[idx])
    store[17] = local[2]
    store[5] = TensorDict(
        {
            "obs": torch.zeros(9),
            "done": torch.zeros(1, dtype=torch.bool),
            "nested": {"b": torch.zeros(3, dtype=torch.int64)},
            "tokens": torch.zeros(2, dtype=torch.int64),
        },
        [],
    )
    for i in range(40):
        if i != 5:
            assert_same(store[i].to_tensordict(), local[2 if i == 17 else i])
    assert torch.equal(store[5]["obs"], torch.zeros(9))


def _ring_batch(tags: list[int]) -> object:
    return lazy_stack(
        [TensorDict({"obs": torch.full((4,), float(t)), "step": torch.tensor([t]), "prio": torch.tensor([0.5])}, []) for t in tags]
    )


@pytest.mark.ring
def test_first_ring_write_groups_and_update_if_writes_one_column(backend) -> None:
    ring = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    ring.extend(_ring_batch([1, 2, 3]))
    h = ring._engine.header
    assert h.row is not None and {leaf.path for leaf in h.grouped()} == {("obs",), ("step",), ("prio",)}
    w = ring.extend(_ring_batch([4, 5]))
    applied = ring.update_if(w.indices, w.generations, TensorDict(prio=torch.tensor([[0.9], [0.8]]), batch_size=[2]))
    assert applied.tolist() == [True, True]
    got = ring[0:5]
    assert got["step"].reshape(-1).tolist() == [1, 2, 3, 4, 5]
    assert got["obs"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert got["prio"].reshape(-1).tolist() == pytest.approx([0.5, 0.5, 0.5, 0.9, 0.8])
    s = ring.sample(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(s.td["obs"][:, 0].long(), s.td["step"].reshape(-1))  # whole rows: never torn


def test_dense_store_groups_too(backend) -> None:
    td = TensorDict(a=torch.arange(12.0).reshape(6, 2), b=torch.arange(6), batch_size=[6])
    store = TensorDictStore.from_tensordict(td, **backend.kwargs())
    assert store._engine.header.row is not None
    store[2] = TensorDict(a=torch.tensor([-1.0, -2.0]), b=torch.tensor(-3), batch_size=[])
    td[2] = TensorDict(a=torch.tensor([-1.0, -2.0]), b=torch.tensor(-3), batch_size=[])
    assert_same(store.to_tensordict(), td)


@pytest.mark.ring
def test_the_header_format_tells_old_clients_about_the_block(backend) -> None:
    store, _ = _store(backend, n=4)
    client = backend.client()
    assert client.hget(store._engine.keys.meta, "format") == b"2"
    one = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([TensorDict(x=torch.ones(3) * i) for i in range(4)]), **backend.kwargs())
    assert client.hget(one._engine.keys.meta, "format") == b"1"  # no block: readable by every tdstore
    ring = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    assert client.hget(ring._engine.keys.meta, "format") == b"1"
    ring.extend(_ring_batch([1, 2]))
    assert client.hget(ring._engine.keys.meta, "format") == b"2"  # set by the write that made the block
    assert LazyStackedTensorDictStore.from_store(td_id=ring.td_id, **backend.kwargs())._engine.header.row is not None


def test_a_bad_column_in_the_header_is_refused() -> None:
    h = Header(version=1, count=2, stack_dim=0, inner=(), device="", next_leaf=0)
    fields = h.fields()
    fields["format"] = "2"
    schema = {"next": 3, "leaves": [{"path": ["a"], "n": 0, "dtype": "float32", "ndim": 1, "shape": [2], "v": 1, "col": 4}], "row": [2, 12]}
    fields["schema"] = json.dumps(schema)
    assert Header.from_fields(fields).leaves[("a",)].col == 4
    for bad in ({**schema, "row": [2, 11]}, {**schema, "row": None}, {**schema, "row": [0, 16]}, {**schema, "row": [5, 16]}):
        fields["schema"] = json.dumps(bad)
        with pytest.raises(StoreFormatError):
            Header.from_fields(fields)
    two = {
        **schema,
        "leaves": [*schema["leaves"], {"path": ["b"], "n": 1, "dtype": "int32", "ndim": 0, "shape": [], "v": 1, "col": 10}],
        "row": [2, 16],
    }
    fields["schema"] = json.dumps(two)
    with pytest.raises(StoreFormatError, match="overlaps"):
        Header.from_fields(fields)  # b's bytes 10..13 overlap a's 4..11
    fields["schema"] = json.dumps(schema)
    fields["format"] = "1"  # a block in a header that says it has none
    with pytest.raises(StoreFormatError, match="row block"):
        Header.from_fields(fields)


@pytest.mark.layout
def test_one_getrange_per_row_for_a_batch_and_one_setrange_per_element(real) -> None:
    store, local = _store(real, n=5000, het=False)
    idx = torch.randperm(5000)[:64]
    # the block is large enough (more than 2 KiB per run) that rows are read one by one, not whole
    assert 5000 * store._engine.header.block.element_nbytes > 64 * TX_WHOLE_BYTES_PER_RANGE
    before = real.commandstats()
    got = store[idx]
    after = real.commandstats()
    # one MULTI/EXEC of plain GETRANGEs (see _wire): three leaves in the block, one range per row
    assert after.get("exec", 0) - before.get("exec", 0) == 1 and after.get("evalsha", 0) == before.get("evalsha", 0)
    runs = 1 + int((idx.diff() != 1).sum())  # scattered rows are read in the order asked; neighbours share a range
    assert after.get("getrange", 0) - before.get("getrange", 0) == runs
    assert_same(got, local[idx])
    before = real.commandstats()
    store[9] = local[1]
    after = real.commandstats()
    assert after.get("evalsha", 0) - before.get("evalsha", 0) == 1
    assert after.get("setrange", 0) - before.get("setrange", 0) == 1


def test_reads_keep_the_store_key_order(backend) -> None:
    local = lazy_stack(
        [TensorDict({"a": torch.ones(2) * i, "big": torch.zeros(2000) + i, "b": torch.arange(3) + i}, []) for i in range(12)]
    )
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert [leaf.path for leaf in store._engine.header.grouped()] == [("a",), ("b",)]  # big is too large for the block
    want = ["a", "big", "b"]
    assert list(store[3].to_tensordict().keys()) == want
    assert list(store[0:5].keys()) == want and list(store.to_tensordict().keys()) == want
    assert list(store[torch.tensor([9, 1, 4, 7, 0, 11, 2, 5, 10, 3])].keys()) == want


@pytest.mark.ring
def test_a_ring_write_that_moves_the_last_keys_out_of_the_block(backend) -> None:
    ring = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    ring.extend(TensorDict({"a": torch.ones(2, 3), "b": torch.ones(2, 2)}, [2]))
    block = ring._engine.header.row[0]
    ring.extend(lazy_stack([TensorDict({"a": torch.ones(3 + i) * 7, "b": torch.ones(2 + i) * 8}, []) for i in range(2)]))
    h = ring._engine.header
    assert h.row is None and h.leaves[("a",)].het and h.leaves[("b",)].het
    got = ring[0:4]
    assert [got[i]["a"].tolist() for i in range(4)] == [[1.0] * 3, [1.0] * 3, [7.0] * 3, [7.0] * 4]
    assert [got[i]["b"].tolist() for i in range(4)] == [[1.0] * 2, [1.0] * 2, [8.0] * 2, [8.0] * 3]
    assert not [k for k in _data_keys(backend) if k.endswith(f":d:{block}")]  # the block is gone, in every segment


def test_a_key_of_the_block_written_or_filled_whole_alone_gets_its_own_blob(backend) -> None:
    store, local = _store(backend, het=False)
    local = local.to_tensordict()
    store.set("obs", torch.arange(160.0).reshape(40, 4))  # the whole key, without the rest of the block
    local.set("obs", torch.arange(160.0).reshape(40, 4))
    h = store._engine.header
    assert h.leaves[("obs",)].col is None and h.leaves[("done",)].col is not None
    store.fill_(("nested", "b"), 5)
    local.fill_(("nested", "b"), 5)
    assert store._engine.header.leaves[("nested", "b")].col is None
    assert_same(store.to_tensordict(), local)
    store[3] = local[0]  # the block keeps working for the key left in it
    local[3] = local[0]
    assert_same(store.to_tensordict(), local)


@pytest.mark.layout
def test_whole_key_writes_and_fills_stay_a_few_commands(real) -> None:
    store, local = _store(real, n=2000, het=False)
    store[0]  # warm the scripts
    before = real.commandstats()
    store.zero_()  # every key of the block: one row of zeros that the server repeats
    after = real.commandstats()
    assert after.get("setrange", 0) - before.get("setrange", 0) == 1
    assert torch.count_nonzero(store.get("obs")) == 0 and not store.get("done").any()
    before = real.commandstats()
    store.set("obs", torch.ones(2000, 4))  # one key alone: a blob of its own, not 2,000 ranges
    after = real.commandstats()
    assert after.get("setrange", 0) - before.get("setrange", 0) == 0
    assert after.get("set", 0) - before.get("set", 0) == 1
    assert torch.equal(store.get("obs"), torch.ones(2000, 4))
