"""A key the store does not have, written at some elements, is created for every element (as the reference does).

``TensorDictStore(batch_size=[5])`` then ``store[0] = TensorDict(obs=...)``: the key is created
for the whole batch, the other rows read as zeros (``None`` for non-tensor data), in the same
atomic call that writes row 0. torchrl's ``StoreStorage`` uses a store exactly this way. The
lazy store goes further than the reference: a later write of another shape makes the key
heterogeneous, as for any key.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, top_level_commands
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, lazy_stack, tensorclass

from tdstore import LazyStackedTensorDictStore, TensorDictStore


def _zeros_but(rows: dict[int, torch.Tensor], n: int, feat: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(n, *feat, dtype=dtype)
    for i, v in rows.items():
        out[i] = v
    return out


@pytest.mark.parametrize(
    "index, n",
    [(0, 1), (slice(1, 3), 2), (torch.tensor([0, 3]), 2), (torch.tensor([True, False, True, False, True]), 3), ([4, 1], 2)],
    ids=["int", "slice", "tensor", "mask", "list"],
)
def test_first_write_into_an_empty_dense_store_creates_the_keys(backend, index, n):
    store = TensorDictStore(batch_size=[5], **backend.kwargs())
    value = TensorDict(obs=torch.arange(4.0 * n).reshape(n, 4) + 1, act=torch.arange(n), batch_size=[n])
    local = TensorDict(obs=torch.zeros(5, 4), act=torch.zeros(5, dtype=torch.int64), batch_size=[5])
    if isinstance(index, int):
        store[index] = value[0]
        local[index] = value[0]
    else:
        store[index] = value
        local[index] = value
    assert_same(store.to_tensordict(), local)
    assert sorted(store.keys()) == ["act", "obs"]


def test_a_new_key_at_an_index_of_a_store_with_data(backend):
    td = TensorDict(obs=torch.ones(5, 4), batch_size=[5])
    store = TensorDictStore.from_tensordict(td, **backend.kwargs())
    store[1] = TensorDict(obs=torch.full((4,), 2.0), extra=torch.tensor(7))
    assert store["extra"].tolist() == [0, 7, 0, 0, 0] and store["obs"][:, 0].tolist() == [1, 2, 1, 1, 1]
    other = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert other["extra"].tolist() == [0, 7, 0, 0, 0]


def test_non_tensor_rows_never_written_read_as_none(backend):
    store = TensorDictStore(batch_size=[5], **backend.kwargs())
    store[0] = TensorDict(obs=torch.ones(4), text="hi")
    assert [store[i]["text"] for i in range(5)] == ["hi", None, None, None, None]
    store[0:2] = TensorDict(tag=NonTensorStack("a", "b"), batch_size=[2])
    assert [store[i]["tag"] for i in range(5)] == ["a", "b", None, None, None]
    store[3] = TensorDict(obs=torch.ones(4), text="later")
    assert [store[i]["text"] for i in range(5)] == ["hi", None, None, "later", None]


def test_lazy_store_first_writes_create_keys_and_shapes_may_differ(backend):
    store = LazyStackedTensorDictStore(count=5, inner_batch_size=[], **backend.kwargs())
    store[0] = TensorDict(obs=torch.ones(3), tokens=torch.arange(3))
    store[2] = TensorDict(obs=torch.full((3,), 2.0), tokens=torch.arange(5))  # another shape: heterogeneous
    store[torch.tensor([3, 4])] = lazy_stack(
        [TensorDict(obs=torch.ones(3), tokens=torch.arange(1)), TensorDict(obs=torch.ones(3), tokens=torch.arange(2))]
    )
    assert store._engine.header.leaves[("tokens",)].het
    assert store[0]["tokens"].tolist() == [0, 1, 2] and store[2]["tokens"].tolist() == [0, 1, 2, 3, 4]
    assert store[4]["tokens"].tolist() == [0, 1] and store[1]["tokens"].tolist() == [0, 0, 0]  # never written: zeros
    assert torch.equal(store["obs"], _zeros_but({0: torch.ones(3), 2: torch.full((3,), 2.0), 3: torch.ones(3), 4: torch.ones(3)}, 5, (3,)))
    assert isinstance(store[0:5], LazyStackedTensorDict) and store[0:5][2]["tokens"].tolist() == [0, 1, 2, 3, 4]


def test_a_new_heterogeneous_key_at_several_elements(backend):
    store = LazyStackedTensorDictStore(count=6, inner_batch_size=[], **backend.kwargs())
    value = lazy_stack([TensorDict(seq=torch.arange(1 + i, dtype=torch.int32)) for i in range(3)])
    store[1:4] = value
    assert store._engine.header.leaves[("seq",)].het
    assert [store[i]["seq"].tolist() for i in range(6)] == [[], [0], [0, 1], [0, 1, 2], [], []]


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def test_tensorclass_values_are_written_like_their_tensordict(backend):
    store = TensorDictStore(batch_size=[4], **backend.kwargs())
    store[1] = Transition(obs=torch.ones(3), reward=torch.tensor(2.0), batch_size=[])
    store[2:4] = Transition(obs=torch.full((2, 3), 3.0), reward=torch.tensor([4.0, 5.0]), batch_size=[2])
    assert store["reward"].tolist() == [0.0, 2.0, 4.0, 5.0] and store["obs"][:, 0].tolist() == [0.0, 1.0, 3.0, 3.0]


def test_bad_first_writes_raise_and_write_nothing(backend):
    store = TensorDictStore(batch_size=[4], **backend.kwargs())
    store[0] = TensorDict(obs=torch.ones(3))
    before = store.to_tensordict()
    with pytest.raises(TypeError, match="obs.*float32"):
        store[1] = TensorDict(obs=torch.ones(3, dtype=torch.float64), new=torch.ones(2))
    with pytest.raises(TypeError, match="new.*one shape"):
        store[0:2] = lazy_stack([TensorDict(obs=torch.ones(3), new=torch.ones(2)), TensorDict(obs=torch.ones(3), new=torch.ones(5))])
    with pytest.raises(ValueError, match="new"):
        store[0:2] = {"obs": torch.ones(2, 3), "new": torch.ones(3, 2)}  # 3 rows for 2
    assert sorted(store.keys()) == ["obs"]
    assert_same(store.to_tensordict(), before)


def test_a_first_write_that_creates_keys_is_one_round_trip(real):
    store = TensorDictStore(batch_size=[100], **real.kwargs())
    store[0] = TensorDict(a=torch.ones(2))  # the store's first keys

    def write() -> None:
        store[5] = TensorDict(a=torch.ones(2), b=torch.ones(3), c="text")

    assert top_level_commands(real.client, write) == ["evalsha"]
    assert store["b"][5].tolist() == [1.0, 1.0, 1.0] and store[5]["c"] == "text" and store[6]["c"] is None


def test_a_chat_row_written_into_an_empty_store_keeps_its_sub_tree_batch_size(backend):
    import tensordict

    with tensordict.set_list_to_stack(True):
        row = TensorDict({"chat": {"prompt": TensorDict({"role": ["user"], "content": ["hello"]}, batch_size=[1])}}, batch_size=[])
        store = TensorDictStore(batch_size=[5], **backend.kwargs())
        store[0] = row
        assert store["chat", "prompt"].batch_size == (5, 1)
        assert store[0]["chat", "prompt", "content"] == ["hello"] and store[1]["chat", "prompt", "content"] is None
        ring = LazyStackedTensorDictStore(count=4, **backend.kwargs())
        if backend.name != "cluster" or not getattr(backend, "spread", False):
            ring.extend(lazy_stack([row, row]))
            # a lazy ring records the dims as varying (-1): later rows may hold chats of other lengths
            assert ring._engine.header.sub == {("chat", "prompt"): (-1,)}
            assert ring[1]["chat", "prompt"].batch_size == (1,) and ring[:2]["chat", "prompt"].batch_size == (2, 1)
