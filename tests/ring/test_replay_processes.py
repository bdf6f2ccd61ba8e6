"""Four actor processes and two learners on one server: a prioritized, rate-limited buffer, and a FIFO queue.

Every process opens its own handle by ``td_id``. Nothing here waits on a timer: blocked
calls are released by the other processes' calls (a deadlock would surface as the
calls' ``timeout`` of a minute, far above what any of them needs).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore

pytestmark = pytest.mark.ring

ACTORS, LEARNERS, ROUNDS, CHUNK, CAP = 4, 2, 12, 5, 300
SPI, MIN_SIZE, BUFFER = 2.0, 10, 40.0
BATCH = 8


def priority_of(tag: torch.Tensor) -> torch.Tensor:
    """The priority every process gives a tag (0 for multiples of 7: never drawn)."""
    return torch.where(tag % 7 == 0, torch.zeros_like(tag, dtype=torch.float64), 1.0 + (tag % 5).double())


def element_rows(tags: torch.Tensor) -> TensorDict:
    n = tags.numel()
    return TensorDict({"tag": tags, "obs": tags.double().unsqueeze(-1).expand(n, 4).clone(), "neg": -tags}, [n])


def _actor(url: str, prefix: str, td_id: str, a: int, out: mp.Queue) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    for r in range(ROUNDS):
        tags = torch.arange(CHUNK) + 1000 * a + CHUNK * r + 1
        store.extend(element_rows(tags), priority=priority_of(tags), timeout=60)
    out.put(("actor", a, len(store), store.write_count))


def _learner(url: str, prefix: str, td_id: str, k: int, samples: int, out: mp.Queue) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    gen = torch.Generator().manual_seed(k)
    bad = 0
    for _ in range(samples):
        s = store.sample(BATCH, gen, timeout=60)
        whole = torch.equal(s.td["obs"][:, 0], s.td["tag"].double()) and torch.equal(s.td["neg"], -s.td["tag"])
        bad += int(not whole) + int(bool((priority_of(s.td["tag"]) == 0).any()))
        # a learner's update gives each row the priority its actor gave: final priorities do not depend on the order
        store.update_priority(s.indices, priority_of(s.td["tag"]), generation=s.generations)
    out.put(("learner", k, bad, samples))


def test_four_actors_two_learners_share_a_prioritized_rate_limited_buffer(real):
    store = LazyStackedTensorDictStore(count=CAP, **real.kwargs())
    store.enable_priorities(alpha=0.8)
    store.set_rate_limit(min_size=MIN_SIZE, samples_per_insert=SPI, error_buffer=BUFFER)
    inserts = ACTORS * ROUNDS * CHUNK
    # the learners take every sample the ratio allows once all is inserted, minus a margin
    per_learner = int((inserts * SPI - (SPI * MIN_SIZE - BUFFER)) // (LEARNERS * BATCH)) - 2
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    kw = real.kwargs()
    procs = [ctx.Process(target=_actor, args=(kw["url"], kw["prefix"], store.td_id, a, out)) for a in range(ACTORS)]
    procs += [ctx.Process(target=_learner, args=(kw["url"], kw["prefix"], store.td_id, k, per_learner, out)) for k in range(LEARNERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r[2] for r in results if r[0] == "learner") == [0] * LEARNERS  # every row whole, none of priority 0
    # every process saw the rows in one server-side length; the limiter's counters add up across processes
    assert len(store) == CAP and store.write_count == inserts and len(store.written) == inserts
    raw = real.client().hgetall(store._engine.keys.meta)
    sampled = int(raw[b"sn"])
    assert sampled == LEARNERS * per_learner * BATCH
    diff = inserts * SPI - sampled
    assert SPI * MIN_SIZE - BUFFER <= diff <= SPI * MIN_SIZE + BUFFER
    # the actors ran ahead of the learners by at most what the limiter allows: the learners
    # finished, so the actors were never refused for good, and the final diff is in bounds
    # sampled frequencies follow the final priorities (a seeded draw: deterministic)
    store.clear_rate_limit()
    tags = store.get("tag")
    w = priority_of(tags) ** 0.8
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(CAP, dtype=torch.float64)
    for _ in range(20):
        counts += torch.bincount(store.sample(1000, gen).indices, minlength=CAP).double()
    from helpers import chi2_critical, chi_square

    live = int((w > 0).sum())
    assert chi_square(counts, w / w.sum()) < chi2_critical(live - 1)


WRITERS, READERS, ITEMS, QCAP = 4, 2, 60, 16


def _writer(url: str, prefix: str, td_id: str, w: int) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    for start in range(0, ITEMS, 3):
        tags = torch.arange(start, min(start + 3, ITEMS)) + 1000 * (w + 1)
        store.extend(element_rows(tags), timeout=60)


def _reader(url: str, prefix: str, td_id: str, out: mp.Queue) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    got: list[tuple[int, int]] = []  # (write number, tag)
    while True:
        p = store.pop(1, timeout=60)
        tag = int(p.td["tag"][0])
        if tag < 0:  # the sentinel: one per reader
            break
        assert torch.equal(p.td["neg"], -p.td["tag"])
        got.append(((int(p.generations[0]) - 1) * QCAP + int(p.indices[0]), tag))
    out.put(got)


def test_four_writers_two_readers_share_a_fifo_queue(real):
    store = LazyStackedTensorDictStore(count=QCAP, **real.kwargs())
    store.extend(element_rows(torch.tensor([0])))  # creates the keys; popped below
    assert store.pop(1).td["tag"].tolist() == [0]
    store.set_queue(True)  # writers wait for readers: QCAP is far below the items written
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    kw = real.kwargs()
    readers = [ctx.Process(target=_reader, args=(kw["url"], kw["prefix"], store.td_id, out)) for _ in range(READERS)]
    writers = [ctx.Process(target=_writer, args=(kw["url"], kw["prefix"], store.td_id, w)) for w in range(WRITERS)]
    for p in readers + writers:
        p.start()
    for p in writers:
        p.join(timeout=120)
        assert p.exitcode == 0
    store.extend(element_rows(torch.full((READERS,), -1)), timeout=60)
    got = [out.get(timeout=120) for _ in readers]
    for p in readers:
        p.join(timeout=60)
        assert p.exitcode == 0
    tags = [t for part in got for _, t in part]
    assert len(tags) == len(set(tags)) == WRITERS * ITEMS  # every item read once, none lost
    assert set(tags) == {1000 * (w + 1) + i for w in range(WRITERS) for i in range(ITEMS)}
    for part in got:  # each reader got its items in write order
        numbers = [n for n, _ in part]
        assert numbers == sorted(numbers)
    for w in range(WRITERS):  # and each writer's items were read in the order it wrote them
        mine = sorted((n, t) for part in got for n, t in part if t // 1000 == w + 1)
        assert [t for _, t in mine] == sorted(t for _, t in mine)
