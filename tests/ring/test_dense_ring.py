"""The ring of a dense ``TensorDictStore``: the lazy store's ring (one code path), batches back dense.

On redis-server and fakeredis: extend wrapping around against a local model of the ring, rows
with their own batch dims, reproducible sampling of written rows only, update_if by generation,
uniform and prioritized frequencies (chi-square at 0.1 %, with a seeded generator: never flaky),
pops plain and leased, queue mode and the rate limiter, bad input refused before anything is
written (naming the key and the shapes or dtypes), what a batchless store or a sub-tree refuses;
on the real server, one round trip per call.  Elsewhere, over both kinds: a resend of every ring
call runs once (``test_exactly_once``); priorities, limiter, queue and waits (``test_replay``).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading

import pytest
import torch
from helpers import chi2_critical, chi_square, round_trips, top_level_commands
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, lazy_stack

import tdstore._ring.leases
from tdstore import DenseShapeError, LazyStackedTensorDictStore, QueueOverrunError, TensorDictStore
from tdstore._ring.leases import LeasedSample

pytestmark = pytest.mark.ring

LONG = 600.0  # seconds: a lease that never runs out during a test


def rows(lo: int, n: int, inner: tuple[int, ...] = ()) -> TensorDict:
    """n rows tagged lo .. lo + n - 1 in every key (each row of batch size ``inner``)."""
    tags = torch.arange(lo, lo + n)
    shape = (n, *inner)
    t = tags.view(n, *([1] * len(inner))).expand(shape)
    return TensorDict(
        {"obs": t.to(torch.float32).unsqueeze(-1).expand(*shape, 3).clone(), "tag": t.clone(), "nested": {"b": -t.clone()}}, shape
    )


def check_rows(td: TensorDict, slots: torch.Tensor, model: list[int | None]) -> None:
    """Every row of ``td`` is whole and holds what the model says its slot holds."""
    assert type(td) is TensorDict
    for k, s in enumerate(slots.tolist()):
        tag = model[s]
        assert tag is not None
        assert (td["tag"][k] == tag).all() and (td["obs"][k] == float(tag)).all() and (td["nested", "b"][k] == -tag).all()


@pytest.mark.parametrize("inner", [(), (2,)], ids=["rows", "rows-of-2"])
def test_extend_wraps_and_matches_a_local_ring(one_node, inner):
    cap = 5
    store = TensorDictStore(batch_size=[cap, *inner], **one_node.kwargs())
    assert store.capacity == cap and store.ring_state() == (0, 0, 0) and len(store.written) == 0
    model: list[int | None] = [None] * cap
    w, tag = 0, 1
    for n in (3, 1, 4, 5, 2):
        out = store.extend(rows(tag, n, inner))
        assert out.indices.tolist() == [(w + j) % cap for j in range(n)]
        assert out.generations.tolist() == [(w + j) // cap + 1 for j in range(n)]
        for j in range(n):
            model[(w + j) % cap] = tag + j
        w, tag = w + n, tag + n
        assert store.write_count == w and store.cursor == w % cap and store.written == range(min(w, cap))
        written = torch.arange(min(w, cap))
        check_rows(store[written], written, model)  # the store reads as the ring wrote it
    s = store.sample(64, torch.Generator().manual_seed(0))
    assert type(s.td) is TensorDict and s.td.batch_size == (64, *inner)
    check_rows(s.td, s.indices, model)
    assert store.append(rows(99, 1, inner)[0]).indices.tolist() == [w % cap]
    assert store.batch_size == (cap, *inner) and store["obs"].shape == (cap, *inner, 3)


def test_sample_draws_written_rows_reproducibly_and_update_if_respects_generations(one_node):
    store = TensorDictStore(batch_size=[8], **one_node.kwargs())
    store.extend(rows(0, 3))
    a = store.sample(100, torch.Generator().manual_seed(4))
    b = store.sample(100, torch.Generator().manual_seed(4))
    assert torch.equal(a.indices, b.indices) and int(a.indices.max()) < 3 and torch.equal(a.td["tag"], a.indices)
    assert list(store.sample(5, keys=["tag"]).td.keys()) == ["tag"]
    store.extend(rows(10, 6))  # slot 0 is written again: generation 2
    applied = store.update_if([0, 1], [1, 1], rows(50, 2))
    assert applied.tolist() == [False, True]
    assert store["tag"][:3].tolist() == [15, 51, 2]


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_sampled_frequencies(one_node, prioritized):
    cap, total = 30, 30_000
    store = TensorDictStore(batch_size=[cap], **one_node.kwargs())
    prios = (torch.arange(cap, dtype=torch.float64) % 7) * 0.5 + 0.25
    if prioritized:
        store.enable_priorities(alpha=0.7)
    store.extend(rows(0, cap), priority=prios if prioritized else None)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(cap, dtype=torch.float64)
    for _ in range(total // 1000):
        s = store.sample(1000, gen)
        assert type(s.td) is TensorDict and torch.equal(s.td["tag"], s.indices)
        counts += torch.bincount(s.indices, minlength=cap).double()
    weighted = prios**0.7 / (prios**0.7).sum()
    uniform = torch.full((cap,), 1 / cap, dtype=torch.float64)
    right, wrong = (weighted, uniform) if prioritized else (uniform, weighted)
    assert chi_square(counts, right) < chi2_critical(cap - 1)
    assert chi_square(counts, wrong) > 10 * chi2_critical(cap - 1)  # a wrong distribution would fail it
    if prioritized:
        p = store.sample(16, beta=0.5)
        assert type(p).__name__ == "PrioritizedSample" and type(p.td) is TensorDict and p.weights.shape == (16,)
        assert store.update_priority([0, 1], [0.0, 0.0]).tolist() == [True, True]


def test_pops_plain_and_leased_in_write_order(one_node):
    store = TensorDictStore(batch_size=[6], **one_node.kwargs())
    store.extend(rows(0, 4))
    got = store.pop(2)
    assert type(got.td) is TensorDict and got.td["tag"].tolist() == [0, 1]
    leased = store.pop(2, lease=LONG)
    assert isinstance(leased, LeasedSample) and type(leased.td) is TensorDict and leased.td["tag"].tolist() == [2, 3]
    assert store.ack(leased.receipt) == 2 and leased.ack() == 2  # twice is harmless
    store.extend(rows(4, 1))
    with store.pop(1, lease=LONG) as one:
        assert one.td["tag"].tolist() == [4]
    with pytest.raises(TimeoutError):
        store.pop(1, timeout=0)
    store.extend(rows(10, 6))
    store.extend(rows(20, 2))  # overwrites unread items
    with pytest.raises(QueueOverrunError):
        store.pop(1)
    assert store.pop("tag").tolist() == [21, 12, 13, 14, 15, 20]  # a key first: TensorDict's pop
    assert list(store.keys()) == ["obs", "nested"]


def test_a_resent_leased_pop_gets_the_same_rows_and_an_expired_lease_comes_back(one_node, monkeypatch):
    store = TensorDictStore(batch_size=[8], **one_node.kwargs())
    store.extend(rows(0, 6))
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "resent-1")
    first = store.pop(2, lease=LONG)
    again = store.pop(2, lease=LONG)  # what a resend after a lost reply sends: the same receipt
    assert again.td["tag"].tolist() == first.td["tag"].tolist() == [0, 1] and again.deadline_ms == first.deadline_ms
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "short")
    short = store.pop(1, lease=0.05)
    t = store._engine.client.time()
    while int(t[0]) * 1000 + int(t[1]) // 1000 <= short.deadline_ms:  # the server's clock, never a timer race
        t = store._engine.client.time()
    monkeypatch.setattr(tdstore._ring.leases, "new_receipt", lambda: "later")
    back = store.pop(10, lease=LONG)
    assert type(back.td) is TensorDict and back.td["tag"].tolist() == [2, 3, 4, 5]
    assert back.redelivered.tolist() == [True, False, False, False]
    assert store.ack(first) == 2 and store.ack(back) == 4


def test_queue_mode_and_rate_limiter(one_node):
    store = TensorDictStore(batch_size=[3], **one_node.kwargs())
    store.set_queue(True)
    store.extend(rows(0, 3))
    with pytest.raises(TimeoutError):
        store.extend(rows(3, 1), timeout=0)  # would overwrite an unread item: waits
    assert store.pop(1).td["tag"].tolist() == [0]
    store.extend(rows(3, 1))
    store.set_queue(False)
    store.set_rate_limit(min_size=3)
    assert store.sampling_policy.limit is not None and store.sampling_policy.limit.min_size == 3
    other = TensorDictStore(batch_size=[3], **one_node.kwargs())
    other.set_rate_limit(min_size=2)
    with pytest.raises(TimeoutError):
        other.sample(1, timeout=0)
    other.extend(rows(0, 2))
    assert other.sample(4, min_size=2).td.batch_size == (4,)
    assert other.wait_for(written=2).written == 2
    other.clear_rate_limit()


def _state(store: TensorDictStore) -> tuple:
    return store.ring_state(), {k: v.tolist() for k, v in store.to_tensordict().items(True, True)}


def with_obs(obs: torch.Tensor) -> TensorDict:
    """A batch of the store's keys whose "obs" is ``obs``."""
    n = obs.shape[0]
    return TensorDict(obs=obs, tag=torch.zeros(n, dtype=torch.int64), nested={"b": torch.zeros(n, dtype=torch.int64)}, batch_size=[n])


RAGGED = [TensorDict(obs=torch.zeros(k), tag=torch.tensor(0), nested={"b": torch.tensor(0)}) for k in (3, 4)]


@pytest.mark.parametrize(
    "name, value, exc, text",
    [
        ("row shape", with_obs(torch.zeros(2, 4)), DenseShapeError, r"'obs'.*\[3\].*\[\[4\]\]"),
        ("ragged rows", lazy_stack(RAGGED), DenseShapeError, r"'obs'.*\[4\]"),
        ("dtype", with_obs(torch.zeros(2, 3, dtype=torch.float64)), (TypeError, ValueError), "obs.*float"),
        ("missing key", TensorDict(obs=torch.zeros(2, 3), tag=torch.zeros(2, dtype=torch.int64), batch_size=[2]), KeyError, "nested.b"),
        ("one row", rows(0, 1)[0], ValueError, "append"),
        ("too many rows", rows(0, 5), ValueError, "1 to 4"),
    ],
    ids=["row-shape", "ragged-rows", "dtype", "missing-key", "one-row", "too-many-rows"],
)
def test_bad_input_is_refused_before_anything_is_written(one_node, name, value, exc, text):
    store = TensorDictStore(batch_size=[4], **one_node.kwargs())
    store.extend(rows(0, 3))
    before = _state(store)
    with pytest.raises(exc, match=text):
        store.extend(value)
    with pytest.raises(exc, match=text):  # another handle (its header read from the server) refuses it too
        TensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs()).extend(value)
    assert _state(store) == before


def test_a_first_write_of_ragged_rows_and_stores_without_a_ring(one_node):
    store = TensorDictStore(batch_size=[4], **one_node.kwargs())
    with pytest.raises(DenseShapeError, match=r"'tokens'.*\[\[1\], \[2\]\]"):
        store.extend(lazy_stack([TensorDict(tokens=torch.arange(n)) for n in (1, 2)]))
    assert store.write_count == 0 and list(store.keys()) == []
    with pytest.raises(TypeError, match=r"batch size \[\] has no rows"):
        TensorDictStore(**one_node.kwargs()).extend(rows(0, 1))
    store.extend(rows(0, 2))
    with pytest.raises(TypeError, match="whole store's"):
        store["nested"].sample(1)
    # a lazy store takes the same rows and turns the key heterogeneous
    lazy = LazyStackedTensorDictStore(count=4, **one_node.kwargs())
    lazy.extend(lazy_stack([TensorDict(tokens=torch.arange(n)) for n in (1, 2)]))
    assert isinstance(lazy.sample(3).td, LazyStackedTensorDict)


def test_non_tensor_rows_sample_as_a_dense_tensordict(one_node):
    store = TensorDictStore(batch_size=[4], **one_node.kwargs())
    store.extend(TensorDict(obs=torch.zeros(3, 2), text=NonTensorStack("a", "b", "c"), batch_size=[3]))
    s = store.sample(6, torch.Generator().manual_seed(1))
    assert type(s.td) is TensorDict and s.td["text"] == ["abc"[i] for i in s.indices.tolist()]
    got = store.pop(3)
    assert type(got.td) is TensorDict and got.td["text"] == ["a", "b", "c"]


def test_the_header_says_dense_and_handles_share_the_ring(one_node):
    store = TensorDictStore(batch_size=[4], **one_node.kwargs())
    store.extend(rows(0, 3))
    assert one_node.client().hget(store._engine.keys.meta, "type") == b"dense"
    other = TensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())
    assert isinstance(other, TensorDictStore) and other.write_count == 3
    other.extend(rows(3, 2))
    assert store.ring_state() == (5, 1, 4) and store["tag"].tolist() == [4, 1, 2, 3]
    with pytest.raises(TypeError, match="'dense' store"):
        LazyStackedTensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())


def test_ring_calls_are_one_round_trip(real):
    store = TensorDictStore(batch_size=[32], **real.kwargs())
    store.extend(rows(0, 3))
    store.enable_priorities(alpha=0.6)
    store.extend(rows(10, 8))
    gen = torch.Generator().manual_seed(0)
    leased: list[LeasedSample] = []
    calls = (
        lambda: store.extend(rows(3, 2), priority=[1.0, 2.0]),
        lambda: store.append(rows(5, 1)[0]),
        lambda: store.sample(16, gen),
        lambda: store.update_if([0, 1], [1, 1], rows(9, 2)),
        lambda: store.update_priority([0, 1], [3.0, 4.0]),
        lambda: store.pop(2),
        lambda: leased.append(store.pop(2, lease=LONG)),
        lambda: store.ack(leased[-1].receipt),
    )
    for fn in calls:  # the first call of each script loads it
        fn()
    for fn in calls:
        assert round_trips(top_level_commands(real.client, fn)) == ["evalsha"]
    assert round_trips(top_level_commands(real.client, lambda: store.sample(8, prioritized=False))) in (["evalsha"], ["transaction"])


WRITERS, ROUNDS, CHUNK, CAP = 3, 10, 4, 16


def _writer(store: TensorDictStore, w: int, out: list | None = None, queue=None) -> None:
    got = []
    for r in range(ROUNDS):
        lo = w * 1000 + r * CHUNK
        res = store.extend(rows(lo, CHUNK))
        got += list(zip(res.indices.tolist(), res.generations.tolist(), range(lo, lo + CHUNK)))
    if queue is not None:  # (a process)
        queue.put(got)
    else:
        assert out is not None
        out.extend(got)


def test_concurrent_writers_never_share_a_row_in_one_lap(one_node):
    store = TensorDictStore(batch_size=[CAP], **one_node.kwargs())
    writes: list = []
    if one_node.server is not None:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        # each process gets the store pickled and reconnects, its ring included
        procs = [ctx.Process(target=_writer, args=(pickle.loads(pickle.dumps(store)), w, None, queue)) for w in range(WRITERS)]
        for p in procs:
            p.start()
        for _ in procs:
            writes += queue.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    else:  # fakeredis lives in this process: writers are threads sharing its server
        threads = [threading.Thread(target=_writer, args=(store, w, writes)) for w in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    total = WRITERS * ROUNDS * CHUNK
    assert len(writes) == total and store.write_count == total and store.written == range(CAP)
    assert {(s, g) for s, g, _ in writes} == {(n % CAP, n // CAP + 1) for n in range(total)}
    last = {s: t for s, g, t in sorted(writes, key=lambda x: x[1])}
    check_rows(store[torch.arange(CAP)], torch.arange(CAP), [last[s] for s in range(CAP)])
