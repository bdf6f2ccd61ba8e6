"""The shared ring buffer: extend / append / sample / update_if, on both engines.

A local model of the ring (a list of slots) is kept beside the store; every
operation is checked against it.  The concurrency test runs several writers
extending one store at once (processes on redis-server, threads on one fakeredis
server, which lives in one process) and checks that no slot is written twice in
one lap, that lengths and generations add up, and that sampling only returns
written, whole elements.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch
from helpers import top_level_commands
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore

pytestmark = pytest.mark.ring


def element(tag: int, het: bool = True) -> TensorDict:
    """An element whose every field is derived from ``tag``, so a torn element is detectable."""
    d = {"obs": torch.full((4,), float(tag)), "nested": {"b": torch.tensor([tag, -tag], dtype=torch.int64)}}
    if het:
        d["tokens"] = torch.arange(1 + tag % 5, dtype=torch.int64) + 10 * tag
    return TensorDict(d, [])


def batch(tags: list[int], het: bool = True) -> LazyStackedTensorDict:
    return lazy_stack([element(t, het) for t in tags])


def tag_of(td: TensorDict, het: bool = True) -> int:
    """The tag of an element read back, after checking every field agrees with it."""
    tag = int(td["obs"][0])
    assert torch.equal(td["obs"], torch.full((4,), float(tag))), td["obs"]
    assert td["nested", "b"].tolist() == [tag, -tag]
    if het:
        assert td["tokens"].tolist() == (torch.arange(1 + tag % 5) + 10 * tag).tolist()
    return tag


@pytest.fixture(params=[True, False], ids=["het", "homog"])
def het(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_extend_wraps_and_matches_a_local_ring(backend, het):
    cap = 5
    store = LazyStackedTensorDictStore(count=cap, **backend.kwargs())
    assert store.ring_state() == (0, 0, 0) and len(store.written) == 0
    model: list[int | None] = [None] * cap
    tags = iter(range(1, 100))
    w = 0
    for n in (3, 1, 4, 5, 2):
        chunk = [next(tags) for _ in range(n)]
        out = store.extend(batch(chunk, het))
        assert out.indices.tolist() == [(w + j) % cap for j in range(n)]
        assert out.generations.tolist() == [(w + j) // cap + 1 for j in range(n)]
        for j, t in enumerate(chunk):
            model[(w + j) % cap] = t
        w += n
        assert store.write_count == w and store.cursor == w % cap and store.written == range(min(w, cap))
        for slot, t in enumerate(model):
            if t is not None:
                assert tag_of(store[slot].to_tensordict(), het) == t
    assert sorted(store.keys(True, True), key=str) == sorted(["obs", ("nested", "b"), *(["tokens"] if het else [])], key=str)


def test_first_extend_creates_keys_and_leaves_other_slots_empty(backend):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    store.extend(batch([7, 8]))
    assert tag_of(store[1].to_tensordict()) == 8
    # slots not written yet hold zeros, and empty elements for a heterogeneous key
    assert store[3]["obs"].tolist() == [0.0] * 4
    assert store[3]["tokens"].shape == (0,)
    assert store.written == range(2)


def test_homogeneous_key_becomes_heterogeneous_on_a_ring_write(backend):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    same = lazy_stack([TensorDict({"t": torch.full((2,), i)}, []) for i in range(3)])
    store.extend(same)
    assert store._header.leaves[("t",)].shape == (2,)
    store.extend(lazy_stack([TensorDict({"t": torch.full((5,), 9)}, []), TensorDict({"t": torch.full((1,), 8)}, [])]))
    assert store._header.leaves[("t",)].het
    assert [store[i]["t"].tolist() for i in range(4)] == [[8], [1, 1], [2, 2], [9] * 5]


def test_append_and_inner_batch_dims(backend):
    store = LazyStackedTensorDictStore(count=3, stack_dim=1, inner_batch_size=(2,), **backend.kwargs())
    el = TensorDict({"x": torch.arange(6.0).reshape(2, 3)}, [2])
    assert store.append(el).indices.tolist() == [0]
    two = torch.stack([el + 10, el + 20], dim=1)  # batch [2, 2]: the element dim at the stack dim
    assert store.extend(two).indices.tolist() == [1, 2]
    full = store.to_tensordict()
    assert torch.equal(full["x"][:, 0], el["x"]) and torch.equal(full["x"][:, 2], el["x"] + 20)
    s = store.sample(4, torch.Generator().manual_seed(3))
    assert s.td.batch_size == (2, 4)
    assert torch.equal(s.td["x"], full["x"][:, s.indices])
    with pytest.raises(ValueError, match="batch size"):
        store.append(TensorDict({"x": torch.zeros(3, 3)}, [3]))


def test_sample_draws_written_slots_reproducibly(backend, het):
    store = LazyStackedTensorDictStore(count=50, **backend.kwargs())
    with pytest.raises(ValueError, match="no slot of the ring has been written"):
        store.sample(4)
    store.extend(batch(list(range(1, 8)), het))  # 7 of 50 slots written
    s = store.sample(64, generator=torch.Generator().manual_seed(0))
    assert s.indices.min() >= 0 and s.indices.max() < 7
    assert len(set(s.indices.tolist())) > 3  # uniform over the 7 written slots, not a constant
    assert s.generations.tolist() == [1] * 64
    again = store.sample(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.indices, s.indices)
    assert isinstance(s.td, LazyStackedTensorDict) == het
    for k in range(64):
        assert tag_of(s.td[k].to_tensordict() if het else s.td[k], het) == int(s.indices[k]) + 1
    with pytest.raises(ValueError, match="positive int"):
        store.sample(0)


def test_a_full_ring_samples_through_a_transaction_with_the_same_draws(backend, het):
    """Once every slot is written (rw only grows), a ring's sample maps the draws to slots on the
    client and reads the rows as one MULTI/EXEC (heterogeneous keys from the offset tables the handle
    keeps, see _offsets): same rows as read.lua would draw."""
    store = LazyStackedTensorDictStore(count=6, **backend.kwargs())
    store.extend(batch(list(range(1, 5)), het))  # 4 of 6 slots
    partial = store.sample(40, generator=torch.Generator().manual_seed(5))
    assert not store._engine.ring_full and partial.indices.max() < 4
    store.extend(batch(list(range(5, 10)), het))  # 9 writes: full, slots 0..2 on their second lap
    first = store.sample(40, generator=torch.Generator().manual_seed(5))  # through read.lua: it sees the ring full
    assert store._engine.ring_full
    second = store.sample(40, generator=torch.Generator().manual_seed(5))  # through a transaction
    assert torch.equal(first.indices, second.indices) and torch.equal(first.generations, second.generations)
    assert second.generations.tolist() == [2 if i < 3 else 1 for i in second.indices.tolist()]
    want = {0: 7, 1: 8, 2: 9, 3: 4, 4: 5, 5: 6}  # the tag each slot holds
    for k in range(40):
        assert tag_of(second.td[k].to_tensordict() if het else second.td[k], het) == want[int(second.indices[k])]
    if backend.name == "redis":
        before = backend.commandstats()
        store.sample(64)
        after = backend.commandstats()
        assert after.get("exec", 0) - before.get("exec", 0) == 1
        # no read.lua, no script: distinct rows not tracked (the default), a plain HINCRBY inside it counts the sample
        assert sum(after.get(k, 0) - before.get(k, 0) for k in ("evalsha", "eval", "exec")) == 1
        assert after.get("hincrby", 0) - before.get("hincrby", 0) == 1


def test_update_if_applies_only_current_generations(backend, het):
    cap = 4
    store = LazyStackedTensorDictStore(count=cap, **backend.kwargs())
    first = store.extend(batch([1, 2, 3, 4], het))
    store.extend(batch([5], het))  # slot 0 is now at generation 2
    new = batch([11, 12], het)
    applied = store.update_if(first.indices[:2], first.generations[:2], new)
    assert applied.tolist() == [False, True]
    assert tag_of(store[0].to_tensordict(), het) == 5  # overwritten since: left alone
    assert tag_of(store[1].to_tensordict(), het) == 12
    # a subset of the keys, and the one-element form
    assert store.update_if(2, 1, TensorDict({"obs": torch.full((4,), -1.0)}, [])).tolist() == [True]
    assert store[2]["obs"].tolist() == [-1.0] * 4 and store[2]["nested", "b"].tolist() == [3, -3]
    assert store.update_if([], [], TensorDict({}, [0])).tolist() == []
    # a sampled batch names a slot twice when it drew it twice: the last row wins, as sequential writes
    applied = store.update_if([3, 1, 3], [1, 1, 1], batch([21, 22, 23], het))
    assert applied.tolist() == [True, True, True]
    assert tag_of(store[3].to_tensordict(), het) == 23 and tag_of(store[1].to_tensordict(), het) == 22
    assert store.update_if([0, 0], [1, 1], batch([31, 32], het)).tolist() == [False, False]


@pytest.mark.parametrize(
    ("name", "call", "exc", "text"),
    [
        ("missing key", lambda s: s.extend(lazy_stack([TensorDict({"obs": torch.zeros(4)}, [])])), KeyError, "missing"),
        ("wrong dtype", lambda s: s.extend(lazy_stack([element(1).set("obs", torch.zeros(4, dtype=torch.float64))])), TypeError, "obs"),
        ("too many", lambda s: s.extend(batch(list(range(1, 7)))), ValueError, "ring of 5"),
        ("not a batch", lambda s: s.extend(element(1)), ValueError, "batch size"),
        ("update_if unknown key", lambda s: s.update_if([0], [1], TensorDict({"zzz": torch.zeros(1, 1)}, [1])), KeyError, "zzz"),
        ("update_if one slot, two generations", lambda s: s.update_if([1, 1], [1, 2], batch([1, 2])), ValueError, "two generations"),
        ("update_if slot out of range", lambda s: s.update_if([9], [1], batch([1])), IndexError, "9"),
        ("update_if lengths", lambda s: s.update_if([0, 1], [1], batch([1, 2])), ValueError, "generations"),
        ("update_if ndim", lambda s: s.update_if([0], [1], TensorDict({"obs": torch.zeros(1, 4, 1)}, [1])), ValueError, "obs"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_ring_calls_write_nothing(backend, name, call, exc, text):
    store = LazyStackedTensorDictStore(count=5, **backend.kwargs())
    store.extend(batch([1, 2, 3]))
    before = store[0:3]
    with pytest.raises(exc, match=text):
        call(store)
    assert store.write_count == 3
    after = store[0:3]
    for a, b in zip(before.unbind(0), after.unbind(0)):
        assert tag_of(a) == tag_of(b)


def test_extend_with_a_new_key_adds_it_to_every_element(backend):
    """As ``store[i] = td`` does: the batch's slots hold the new key, every other slot zeros."""
    store = LazyStackedTensorDictStore(count=5, **backend.kwargs())
    store.extend(batch([1, 2, 3]))
    got = store.extend(lazy_stack([element(4).set("new", torch.full((2,), 4.0)), element(5).set("new", torch.full((2,), 5.0))]))
    assert got.indices.tolist() == [3, 4] and store.write_count == 5
    assert store["new"].tolist() == [[0.0, 0.0]] * 3 + [[4.0, 4.0], [5.0, 5.0]]
    assert [tag_of(store[i].to_tensordict()) for i in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(KeyError, match=r"missing \['new'\].*del store\[key\]"):
        store.extend(batch([6]))


def test_ring_calls_are_one_round_trip(real):
    store = LazyStackedTensorDictStore(count=8, **real.kwargs())
    store.extend(batch([1, 2, 3]))
    b = batch([4, 5])
    gen = torch.Generator().manual_seed(0)
    for fn in (
        lambda: store.extend(b),
        lambda: store.sample(16, gen),
        lambda: store.update_if([0, 1], [1, 1], b),
        lambda: store.append(element(9)),
    ):
        assert top_level_commands(real.client, fn) == ["evalsha"]


def test_ring_survives_a_schema_change_by_another_handle(backend):
    a = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    a.extend(batch([1, 2]))
    b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **{k: v for k, v in backend.kwargs().items()})
    b.set("extra", torch.zeros(4, 2))
    # a's cache misses "extra": the server refuses the stale plan, a re-plans and sees the key is missing
    with pytest.raises(KeyError, match="extra"):
        a.extend(batch([3]))
    a.extend(batch([3]).set("extra", torch.ones(1, 2)))
    assert a.write_count == 3 and a[2]["extra"].tolist() == [1.0, 1.0]


# -- several writers at once -----------------------------------------------------------------

WRITERS, ROUNDS, CHUNK, CAP = 4, 25, 3, 40


def _writer(store: LazyStackedTensorDictStore, w: int, out: list | None = None, queue: mp.Queue | None = None) -> None:
    got = []
    for r in range(ROUNDS):
        tags = [w * 1000 + r * CHUNK + j + 1 for j in range(CHUNK)]
        res = store.extend(batch(tags))
        got += list(zip(res.indices.tolist(), res.generations.tolist(), tags))
    if queue is not None:
        queue.put(got)
    else:
        assert out is not None
        out.extend(got)


def _sampler(store: LazyStackedTensorDictStore, stop: threading.Event, errors: list) -> None:
    gen = torch.Generator().manual_seed(5)
    while not stop.is_set():
        try:
            s = store.sample(16, gen)
        except ValueError:  # nothing written yet
            continue
        try:
            for k in range(16):
                tag_of(s.td[k].to_tensordict())
            assert int(s.indices.max()) < CAP and bool((s.generations >= 1).all())
        except AssertionError as err:  # pragma: no cover - reported below
            errors.append(err)


def test_concurrent_writers_never_share_a_slot_in_one_lap(backend):
    store = LazyStackedTensorDictStore(count=CAP, **backend.kwargs())
    stop = threading.Event()
    errors: list = []
    sampler = threading.Thread(target=_sampler, args=(store._clone(False), stop, errors))
    sampler.start()
    writes: list = []
    try:
        if backend.server is not None:
            ctx = mp.get_context("fork")
            queue: mp.Queue = ctx.Queue()
            procs = [ctx.Process(target=_writer, args=(store, w, None, queue)) for w in range(WRITERS)]
            for p in procs:
                p.start()
            for _ in procs:
                writes += queue.get(timeout=120)
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == 0
        else:  # fakeredis lives in this process: writers are threads sharing its server
            threads = [threading.Thread(target=_writer, args=(store._clone(False), w, writes)) for w in range(WRITERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        stop.set()
        sampler.join()
    assert not errors, errors[:3]
    total = WRITERS * ROUNDS * CHUNK
    assert len(writes) == total and store.write_count == total and store.written == range(CAP)
    # (slot, generation) is unique: no slot was written twice in one lap, and every write number was used once
    pairs = {(s, g) for s, g, _ in writes}
    assert len(pairs) == total
    assert pairs == {(n % CAP, n // CAP + 1) for n in range(total)}
    # each slot holds the element of its last lap
    last = {s: t for s, g, t in sorted(writes, key=lambda x: x[1])}
    for slot in range(CAP):
        assert tag_of(store[slot].to_tensordict()) == last[slot]
