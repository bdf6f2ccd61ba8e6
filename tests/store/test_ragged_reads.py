"""Padded and jagged reads of a heterogeneous key: one round trip, one result built from the raw bytes.

``store.get(key, as_padded_tensor=True)`` / ``as_nested_tensor=True`` give what the same call
gives on a local ``LazyStackedTensorDict``, and ``store.get_at(key, idx, ...)`` what
``local[idx].get(key, ...)`` gives: the batch padded to its own longest element (a local lazy
stack's ``get_at`` pads the whole key first, then indexes), without a tensor per element
(``tdstore/_format/ragged.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import top_level_commands
from tensordict import TensorDict, lazy_stack, pad_sequence

from tdstore import LazyStackedTensorDictStore


def _local(n: int = 40) -> object:
    return lazy_stack(
        [TensorDict(obs=torch.full((3,), float(i)), tokens=torch.arange(i % 7 + 1, dtype=torch.int32) * (i + 1)) for i in range(n)]
    )


@pytest.fixture
def pair(backend):
    local = _local()
    return LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs()), local


PADDED = [
    {"as_padded_tensor": True},
    {"as_padded_tensor": True, "padding_side": "left"},
    {"as_padded_tensor": True, "padding_value": -7},
    {"as_padded_tensor": True, "padding_side": "left", "padding_value": 3.0},
]


@pytest.mark.parametrize("kw", PADDED, ids=["right", "left", "value", "left-value"])
def test_padded_reads_match_a_local_lazy_stack(pair, kw):
    store, local = pair
    assert torch.equal(store.get("tokens", **kw), local.get("tokens", **kw))
    for idx in (
        torch.tensor([5, 1, 5, 39, 0]),
        [3, 4, 5],
        slice(2, 30, 3),
        torch.arange(40) % 3 == 0,
        torch.randint(40, (25,), generator=torch.Generator().manual_seed(1)),
    ):
        assert torch.equal(store.get_at("tokens", idx, **kw), local[idx].get("tokens", **kw)), idx


def test_jagged_reads_match_a_local_lazy_stack(pair):
    store, local = pair
    got, want = store.get("tokens", as_nested_tensor=True), local.get("tokens", as_nested_tensor=True)
    assert got.layout == torch.jagged and all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True))
    idx = torch.tensor([7, 2, 7, 30])
    got, want = store.get_at("tokens", idx, as_nested_tensor=True), local[idx].get("tokens", as_nested_tensor=True)
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True))


def test_elements_ragged_beyond_their_first_dim_are_read_the_usual_way(backend):
    local = lazy_stack([TensorDict(img=torch.full((i % 3 + 1, i % 2 + 1), float(i))) for i in range(9)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert torch.equal(store.get("img", as_padded_tensor=True), local.get("img", as_padded_tensor=True))
    strided = store.get("img", as_nested_tensor=True, layout=torch.strided)
    assert all(
        torch.equal(a, b)
        for a, b in zip(strided.unbind(), local.get("img", as_nested_tensor=True, layout=torch.strided).unbind(), strict=True)
    )


def test_a_padded_read_is_one_round_trip_without_a_tensor_per_element(pair, real, monkeypatch):
    store = LazyStackedTensorDictStore.from_lazy_stack(_local(), **real.kwargs())
    store.get("tokens", as_padded_tensor=True)  # warm
    from tdstore._plan import read_plan as _reads
    from tdstore._plan import read_results as _results

    for module in (_reads, _results):  # the per-element builders are not used
        monkeypatch.setattr(module, "het_rows", None)
        monkeypatch.setattr(module, "split_elements", None)
    assert top_level_commands(real.client, lambda: store.get("tokens", as_padded_tensor=True)) == ["evalsha"]
    assert top_level_commands(real.client, lambda: store.get_at("tokens", torch.randint(40, (30,)), as_padded_tensor=True)) == ["evalsha"]


def test_bad_padding_side_is_refused(pair):
    store, local = pair
    with pytest.raises(ValueError, match="padding_side"):
        store.get("tokens", as_padded_tensor=True, padding_side="middle")


@pytest.mark.ring
def test_ring_samples_as_padded_or_jagged_tensors(backend, real):
    store = LazyStackedTensorDictStore(count=64, **backend.kwargs())
    store.extend([TensorDict(obs=torch.full((3,), float(i)), tokens=torch.arange(1 + i % 5) * (i + 1)) for i in range(40)])
    plain = store.sample(16, generator=torch.Generator().manual_seed(3))
    padded = store.sample(16, generator=torch.Generator().manual_seed(3), as_padded_tensor=True, padding_side="left", padding_value=-1)
    assert torch.equal(plain.indices, padded.indices) and torch.equal(plain.generations, padded.generations)
    assert type(padded.td) is TensorDict and torch.equal(padded.td["obs"], plain.td["obs"])
    assert torch.equal(padded.td["tokens"], plain.td.get("tokens", as_padded_tensor=True, padding_side="left", padding_value=-1))
    jagged = store.sample(16, generator=torch.Generator().manual_seed(3), as_nested_tensor=True)
    assert all(torch.equal(a, b) for a, b in zip(jagged.td["tokens"].unbind(), plain.td.get("tokens", as_list=True), strict=True))
    with pytest.raises(TypeError, match="as_padded_tensor"):
        store.sample(4, as_list=True)
    if backend.name == "redis":
        assert top_level_commands(real.client, lambda: store.sample(16, as_padded_tensor=True)) == ["evalsha"]


@pytest.mark.ring
def test_samples_read_only_the_keys_asked_for_and_uploads_sample_every_element(backend, real):
    local = lazy_stack(
        [
            TensorDict(
                obs=torch.full((3,), float(i)),
                act=torch.tensor(i),
                nested=TensorDict(b=torch.arange(2) + i),
                tokens=torch.arange(i % 4 + 1),
            )
            for i in range(12)
        ]
    )
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    assert store.capacity == 12 and store.written == range(12)  # an upload is a full ring
    s = store.sample(64, generator=torch.Generator().manual_seed(0))  # every element, not "empty"
    assert sorted(set(s.indices.tolist())) == list(range(12)) and s.generations.tolist() == [1] * 64
    part = store.sample(16, generator=torch.Generator().manual_seed(1), keys=["act", "nested"])
    assert sorted(map(str, part.td.keys(True, True))) == sorted(map(str, ["act", ("nested", "b")]))
    assert part.td["act"].tolist() == part.indices.tolist() and torch.equal(part.td["nested", "b"][:, 0], part.indices)
    one = store.sample(4, keys="tokens", as_padded_tensor=True)
    assert list(one.td.keys()) == ["tokens"] and one.td["tokens"].shape[0] == 4
    with pytest.raises(KeyError, match="nope"):
        store.sample(4, keys=["nope"])
    if backend.name == "redis":
        # a full ring (an upload is one): one read transaction of plain GETRANGEs
        sent = top_level_commands(real.client, lambda: store.sample(8, keys=["obs"]))
        assert sent[0] == "multi" and sent[-1] == "exec" and "evalsha" not in sent


def _pad_mask(elements: list, key: str, side: str) -> torch.Tensor:
    """The mask tensordict.pad_sequence gives for ``key`` of these elements."""
    return pad_sequence([el.select(key) for el in elements], return_mask=True, padding_side=side)["masks", key]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_reads_return_the_mask_pad_sequence_gives(pair, side):
    store, local = pair
    kw = {"as_padded_tensor": True, "padding_side": side, "return_mask": True}
    padded, mask = store.get("tokens", **kw)
    assert torch.equal(padded, local.get("tokens", as_padded_tensor=True, padding_side=side))
    assert torch.equal(mask, _pad_mask(list(local.unbind(0)), "tokens", side))
    for idx in (torch.tensor([5, 1, 5, 39, 0]), slice(2, 30, 3), torch.randint(40, (25,), generator=torch.Generator().manual_seed(2))):
        for _ in range(2):  # the second read goes as a transaction (its offset table kept)
            padded, mask = store.get_at("tokens", idx, **kw)
            assert torch.equal(padded, local[idx].get("tokens", as_padded_tensor=True, padding_side=side))
            assert torch.equal(mask, _pad_mask(list(local[idx].unbind(0)), "tokens", side))
    # a key whose elements all have one shape: the stacked tensor, every cell data
    obs, mask = store.get_at("obs", [4, 2], as_padded_tensor=True, return_mask=True)
    assert torch.equal(obs, local[[4, 2]].get("obs")) and mask.shape == (2, 3) and bool(mask.all())


def test_return_mask_where_it_cannot_apply_is_refused(pair, backend):
    store, _ = pair
    with pytest.raises(ValueError, match="return_mask goes with as_padded_tensor"):
        store.get_at("tokens", [1, 2], as_nested_tensor=True, return_mask=True)
    with pytest.raises(ValueError, match="return_mask goes with as_padded_tensor"):
        store.get("tokens", return_mask=True)
    scalars = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(r=torch.tensor(float(i))) for i in range(4)]), **backend.kwargs()
    )
    with pytest.raises(ValueError, match="no dims to pad"):
        scalars.get_at("r", [0, 2], as_padded_tensor=True, return_mask=True)
    with pytest.raises(ValueError, match="return_mask needs a batch"):
        store.get_at("tokens", 3, as_padded_tensor=True, return_mask=True)
    img = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(img=torch.zeros(i % 3 + 1, i % 2 + 1)) for i in range(6)]), **backend.kwargs()
    )
    with pytest.raises(ValueError, match="'img' that differ in their first dim only"):
        img.get("img", as_padded_tensor=True, return_mask=True)


@pytest.mark.ring
def test_ring_samples_carry_masks_where_pad_sequence_puts_them(backend):
    store = LazyStackedTensorDictStore(count=64, **backend.kwargs())
    els = [TensorDict(obs=torch.full((3,), float(i)), tokens=torch.arange(1 + i % 5) * (i + 1)) for i in range(40)]
    store.extend(els)
    s = store.sample(16, generator=torch.Generator().manual_seed(3), as_padded_tensor=True, padding_side="left", return_mask=True)
    drawn = [els[i] for i in s.indices.tolist()]
    assert torch.equal(s.td["masks", "tokens"], _pad_mask(drawn, "tokens", "left"))
    assert s.td["masks", "obs"].shape == (16, 3) and bool(s.td["masks", "obs"].all())
    named = store.sample(4, as_padded_tensor=True, return_mask=("aux", "valid"))
    assert set(named.td.keys(True, True)) >= {("aux", "valid", "tokens"), ("aux", "valid", "obs")}
    with pytest.raises(ValueError, match="where the store has keys"):
        store.sample(4, as_padded_tensor=True, return_mask="tokens")
    with pytest.raises(TypeError, match="as_padded_tensor"):
        store.sample(4, return_mask=True)
