"""Offline then online: an uploaded dataset stays in the ring when actors start extending it.

torchrl's ``OfflineToOnlineReplayBuffer`` pattern: a store made with ``from_tensordict`` (an
upload) is a full ring of ``count`` written slots, so the first ``extend`` overwrites slot 0
(the oldest), the next slot 1, ..., and sampling keeps drawing from every slot. Before, the
upload's ``written`` said ``range(0, 0)`` and after one ``extend`` every sample was slot 0.

A store written only by index (``store[i] = td``, never extended) is a full ring too, while a
ring created empty and filled by ``extend`` never draws a slot it has not written.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore

N = 100
BOTH = pytest.mark.parametrize("backend", ["redis", "fakeredis"], indirect=True)


def _element(tag: int, het: bool = True) -> TensorDict:
    """Element ``tag``: its obs holds the tag, its tokens (a heterogeneous key) 1 + tag % 5 of them."""
    td = TensorDict(obs=torch.full((3,), float(tag)), tag=torch.tensor(tag))
    if het:
        td["tokens"] = torch.full((1 + tag % 5,), tag)
    return td


def _chi2_threshold(df: int, p: float) -> float:
    """An ``x`` with ``P(chi2(df) >= x) <= p``, from the Chernoff bound ``(x/df)^(df/2) e^((df-x)/2)``
    (rigorous, unlike an approximation of the quantile): solved by bisection."""

    def log_bound(x: float) -> float:
        return df / 2 * math.log(x / df) + (df - x) / 2

    lo, hi = float(df), 100.0 * df
    for _ in range(200):
        mid = (lo + hi) / 2
        if log_bound(mid) > math.log(p):
            lo = mid
        else:
            hi = mid
    return hi


def _chi2_over_slots(store: LazyStackedTensorDictStore, slots: int, seed: int) -> tuple[float, torch.Tensor]:
    """Chi-square statistic of 20,000 uniform draws over ``slots`` slots, and the counts per slot."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(slots, dtype=torch.float64)
    for _ in range(20):
        s = store.sample(1000, generator=gen)
        assert whole(s.td)
        counts += torch.bincount(s.indices, minlength=slots).double()
    expected = counts.sum() / slots
    return float(((counts - expected) ** 2 / expected).sum()), counts


def whole(td: TensorDict) -> bool:
    """Each row read whole: its obs and its tokens carry its tag."""
    tags = td["tag"]
    if not bool((td["obs"] == tags.double().unsqueeze(-1)).all()):
        return False
    if "tokens" in td.keys():
        return all(bool((t == tag).all()) for t, tag in zip(td.get("tokens", as_list=True), tags.tolist()))
    return True


@pytest.mark.ring
@BOTH
def test_an_uploaded_store_is_a_full_ring_that_extends_overwrite_oldest_first(backend):
    store = TensorDictStore.from_tensordict(lazy_stack([_element(i) for i in range(N)]), **backend.kwargs())
    try:
        assert store.written == range(N) and store.write_count == N and store.cursor == 0
        s = store.sample(500, generator=torch.Generator().manual_seed(0))
        assert set(s.generations.tolist()) == {1} and whole(s.td)
        for k in range(10):  # online: one element at a time
            w = store.extend(lazy_stack([_element(1000 + k)]))
            assert w.indices.tolist() == [k] and w.generations.tolist() == [2]  # the oldest slot, its second write
            assert store.written == range(N) and store.write_count == N + k + 1 and store.cursor == k + 1
        tags = store.get("tag").tolist()
        assert tags == [1000 + k for k in range(10)] + list(range(10, N))  # new data in slots 0..9, the upload in the rest
        # every slot stays sampleable, uniformly: a chi-square over the 100 slots (99 dof) below the level a
        # uniform sampler exceeds with probability < 1e-6 (slot 0 alone, the old failure, gives ~2e6)
        stat, counts = _chi2_over_slots(store, N, seed=1)
        assert bool((counts > 0).all()), counts
        assert stat < _chi2_threshold(N - 1, 1e-6), stat
        s = store.sample(2000, generator=torch.Generator().manual_seed(2))
        assert torch.equal(s.generations, torch.where(s.indices < 10, 2, 1))
        assert torch.equal(s.td["tag"], torch.where(s.indices < 10, s.indices + 1000, s.indices))
        # generations a learner read still guard its writes: slot 3 was overwritten since the upload, slot 50 was not
        assert store.update_if([3, 50], [1, 1], lazy_stack([_element(-1), _element(-2)])).tolist() == [False, True]
    finally:
        store.clear_redis()


@pytest.mark.ring
@BOTH
def test_an_upload_with_priorities_keeps_every_slot_drawable_after_extends(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([_element(i, het=False) for i in range(20)]), **backend.kwargs())
    try:
        store.enable_priorities(alpha=1.0)  # every uploaded slot weighs 1
        store.extend(lazy_stack([_element(100, het=False), _element(101, het=False)]), priority=1.0)
        s = store.sample(4000, generator=torch.Generator().manual_seed(3), prioritized=True)
        assert set(s.indices.tolist()) == set(range(20))  # each slot has probability 1/20: missed with p < 1e-80
        assert torch.allclose(s.probabilities, torch.full((4000,), 1 / 20, dtype=torch.float64))
        assert store.update_priority([0, 5], 3.0, generation=[1, 1]).tolist() == [False, True]  # slot 0 holds generation 2
    finally:
        store.clear_redis()


@pytest.mark.ring
@BOTH
def test_a_store_written_by_index_is_a_full_ring(backend):
    store = LazyStackedTensorDictStore(count=10, **backend.kwargs())
    try:
        assert store.written == range(0) and store.write_count == 0
        for i in range(10):
            store[i] = _element(i, het=False)
        assert store.written == range(10) and store.write_count == 10 and store.cursor == 0
        assert store.extend(lazy_stack([_element(50, het=False)])).indices.tolist() == [0]
        assert store.written == range(10) and store.write_count == 11
        s = store.sample(1000, generator=torch.Generator().manual_seed(4))
        assert set(s.indices.tolist()) == set(range(10)) and whole(s.td)
        assert torch.equal(s.generations, torch.where(s.indices == 0, 2, 1))
    finally:
        store.clear_redis()


@pytest.mark.ring
@BOTH
def test_a_ring_filled_by_extend_never_draws_a_slot_it_did_not_write(backend):
    store = LazyStackedTensorDictStore(count=50, **backend.kwargs())
    try:
        store.extend(lazy_stack([_element(i) for i in range(3)]))
        assert store.written == range(3) and store.write_count == 3
        s = store.sample(1000, generator=torch.Generator().manual_seed(5))
        assert set(s.indices.tolist()) == {0, 1, 2} and whole(s.td)
        store[1] = _element(7)  # a write by index into a ring the ring wrote: still 3 slots
        assert store.written == range(3)
        store.enable_priorities(alpha=1.0)
        s = store.sample(1000, generator=torch.Generator().manual_seed(6), prioritized=True)
        assert set(s.indices.tolist()) == {0, 1, 2}
    finally:
        store.clear_redis()
