"""Checkpoints taken while writer processes extend the ring (``export_checkpoint``, ``rb.dumps``, ``tdstore export``).

A 20,000-slot ring with priorities is filled with stamped rows (every leaf carries the row's stamp,
``helpers.stamped``; its priority follows from the stamp), then two writer processes extend it in
batches while it is exported. The export is held between its chunk reads until the writers have
written more batches (an event, no clock), so that rows are overwritten during every export. Each
writer logs the write number of every row it wrote (``RingWrite``: ``(generation - 1) * count + slot``),
so the test knows which row every ring write put where. The restored ring must be the ring as of
the export's fence: its write count and cursor, every row it holds the one the fence's write put
there (whole), the rows overwritten during the export absent (never drawn, zero weight) and counted,
priorities those of the rows, stats those of the fence. On the code before, the export raised
"changed while it was exported (rw moved): stop its writers".
"""

from __future__ import annotations

import math
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Backend
from helpers import consistent, mp_context, stamped
from tensordict import lazy_stack

from tdstore import LazyStackedTensorDictStore, export_checkpoint, import_checkpoint
from tdstore._checkpoint import export_import as _checkpoint
from tdstore._checkpoint.disk_format import read_meta
from tdstore.cli import main

COUNT = 20_000
BATCH = 64
#: Batches every writer writes while the export is held (after its fence).
HELD_BATCHES = 4
DEADLINE_S = 120.0


def priority_of(stamps: list[int]) -> torch.Tensor:
    return torch.tensor([1.0 + s % 7 for s in stamps], dtype=torch.float64)


def ring_writer(url: str, prefix: str, td_id: str, writer: int, progress: Any, stop: Any, out: Any) -> None:
    """Extend the ring with stamped rows (stamps ``writer * 1_000_000 + k``) until ``stop``; put every row's
    ``(write number, stamp)`` into ``out`` at the end, and count the rows in ``progress[writer]`` as it goes."""
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    log: list[tuple[int, int]] = []
    k = writer * 1_000_000
    while not stop.is_set():
        stamps = list(range(k, k + BATCH))
        k += BATCH
        got = store.extend(lazy_stack([stamped(s) for s in stamps]), priority=priority_of(stamps))
        log.extend(zip(((got.generations - 1) * COUNT + got.indices).tolist(), stamps, strict=True))
        progress[writer] += BATCH
    out.put(log)


def wait_until(what: Any, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``what()`` until true; fail (a writer blocked or dead) past a generous deadline, never on speed."""
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "the writers made no progress while the export ran"
        time.sleep(0.01)


class Writers:
    """Two writer processes on the ring ``store``; ``log`` maps each ring write number to the stamp it wrote."""

    def __init__(self, be: Backend, store: LazyStackedTensorDictStore) -> None:
        ctx = mp_context()
        self.progress = ctx.Array("q", 3, lock=False)
        self.stop, self.out = ctx.Event(), ctx.Queue()
        assert be.server is not None
        args = (be.server.url, be.prefix, store.td_id)
        self.procs = [ctx.Process(target=ring_writer, args=(*args, w, self.progress, self.stop, self.out)) for w in (1, 2)]
        self.log: dict[int, int] = {w: w for w in range(COUNT)}  # the fill: write w holds stamp w

    def __enter__(self) -> Writers:
        for p in self.procs:
            p.start()
        wait_until(lambda: all(self.progress[w] > 0 for w in (1, 2)))  # both running
        return self

    def written(self) -> list[int]:
        return [self.progress[w] for w in (1, 2)]

    def hold_until_both_write(self, batches: int) -> None:
        """Wait until each writer has written ``batches`` more batches (the export held meanwhile)."""
        start = self.written()
        wait_until(lambda: all(now >= was + batches * BATCH for now, was in zip(self.written(), start, strict=True)))

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for _ in self.procs:
            try:
                self.log.update(dict(self.out.get(timeout=DEADLINE_S)))
            except queue.Empty:
                break
        for p in self.procs:
            p.join(DEADLINE_S)
            assert p.exitcode == 0


def filled_ring(be: Backend) -> LazyStackedTensorDictStore:
    store = LazyStackedTensorDictStore(count=COUNT, **be.kwargs())
    store.enable_priorities(alpha=1.0)
    for lo in range(0, COUNT, 2000):
        stamps = list(range(lo, lo + 2000))
        store.extend(lazy_stack([stamped(s) for s in stamps]), priority=priority_of(stamps))
    assert store.write_count == COUNT
    return store


def held_while_exporting(writers: Writers, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Make the export wait, after its fence and before its first chunk read, until both writers wrote
    :data:`HELD_BATCHES` more batches; returns their counts when the export was held and released."""
    seen: dict[str, list[int]] = {}
    read_chunk = _checkpoint._read_chunk

    def held(s: Any, h: Any, lo: int, hi: int) -> Any:
        if "held" not in seen:  # the fence is taken, nothing read: the writes overwrite the first rows to read
            seen["held"] = writers.written()
            writers.hold_until_both_write(HELD_BATCHES)
            seen["released"] = writers.written()
        return read_chunk(s, h, lo, hi)

    monkeypatch.setattr(_checkpoint, "CHUNK_ELEMENTS", 5_000)  # (the writes held for fall in the first chunk)
    monkeypatch.setattr(_checkpoint, "_read_chunk", held)
    return seen


def check_restored(be: Backend, path: Path, back: LazyStackedTensorDictStore, log: dict[int, int], fence_stats: dict[str, int]) -> int:
    """The restored ring is the fence's (see the module docstring); returns the rows overwritten during the export."""
    meta = read_meta(path)
    rw, late = meta.ring["rw"], meta.overwritten_during_export
    held_from = meta.ring.get("ho", rw - COUNT)
    assert late > 0 and held_from == rw - COUNT + late
    assert back.write_count == rw and back.cursor == rw % COUNT
    # every row whole, and every row the ring holds the one the fence's write put in its slot
    rows = back[:]
    stamps = rows["stamp"].tolist()
    assert all(consistent(rows[i]) for i in range(COUNT))
    held = np.zeros(COUNT, dtype=bool)
    for w in range(held_from, rw):
        assert stamps[w % COUNT] == log[w], f"slot {w % COUNT} holds {stamps[w % COUNT]}, the fence's write {w} wrote {log[w]}"
        held[w % COUNT] = True
    assert int((~held).sum()) == late
    # priorities: the rows' own (alpha 1: the weight is the priority), 0 for the absent rows
    client = be.client()
    tree = np.frombuffer(client.getrange(back._engine.keys.priorities, 0, 8 * COUNT - 1), dtype="<f8")
    want = np.where(held, 1.0 + np.asarray(stamps) % 7, 0.0)
    assert np.array_equal(tree, want)
    # samples draw only the rows held, with the fence's generations, uniformly and by priority
    for prioritized in (False, True):
        got = back.sample(4096, prioritized=prioritized)
        idx, gen = got.indices, got.generations
        assert bool(torch.from_numpy(held)[idx].all())
        writes = ((gen - 1) * COUNT + idx).tolist()
        assert all(held_from <= w < rw for w in writes)
        assert got.td["stamp"].tolist() == [log[w] for w in writes]
    # a priority update leaves an absent row alone (it would make it drawable)
    if not held.all():
        absent = int(np.flatnonzero(~held)[0])
        assert back.update_priority(torch.tensor([absent]), torch.tensor([5.0])).tolist() == [False]
    # the stats of the fence (every ring write counted as inserted)
    assert fence_stats["ins"] == rw and back.stats()["inserted"] == rw
    return late


@pytest.fixture
def be(real: Backend) -> Backend:
    """redis-server: the writers are processes of their own."""
    return real


def test_export_of_a_ring_two_writer_processes_extend_restores_the_fence(be: Backend, tmp_path: Path, monkeypatch) -> None:
    store = filled_ring(be)
    with Writers(be, store) as writers:
        seen = held_while_exporting(writers, monkeypatch)
        export_checkpoint(store, tmp_path / "ck")  # on the code before: RuntimeError "... (rw moved): stop its writers ..."
        after = writers.written()
    # the writers were never held by the export: they wrote while it was under way, and after
    assert all(r >= h + HELD_BATCHES * BATCH for r, h in zip(seen["released"], seen["held"], strict=True))
    assert all(a >= r for a, r in zip(after, seen["released"], strict=True))
    meta = read_meta(tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="restored", **be.kwargs())
    late = check_restored(be, tmp_path / "ck", back, writers.log, meta.stats)
    assert late >= 2 * HELD_BATCHES * BATCH
    # the absent rows are the oldest: the next writes overwrite them, then every slot holds a row again
    for lo in range(0, late, 2000):
        stamps = list(range(5_000_000 + lo, 5_000_000 + min(late, lo + 2000)))
        back.extend(lazy_stack([stamped(s) for s in stamps]), priority=priority_of(stamps))
    assert len(set(back.sample(20_000, prioritized=False).indices.tolist())) > COUNT / 2
    assert all(consistent(r) for r in back.sample(512, prioritized=False).td.unbind(0))


def test_rb_dumps_while_two_writer_processes_extend_and_rb_loads(be: Backend, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torchrl")
    from tdstore.torchrl import replay_buffer

    store = filled_ring(be)
    rb = replay_buffer(td_id=store.td_id, url=be.server.url, prefix=be.prefix, batch_size=16)
    with Writers(be, store) as writers:
        held_while_exporting(writers, monkeypatch)
        rb.dumps(tmp_path / "rb")
    meta = read_meta(tmp_path / "rb" / "storage")
    other = replay_buffer(COUNT, url=be.server.url, prefix=be.prefix, batch_size=16, sampler="prioritized", alpha=1.0)
    other.loads(tmp_path / "rb")
    assert other.write_count == meta.ring["rw"]
    back = LazyStackedTensorDictStore.from_store(td_id=other.storage.td_id, **be.kwargs())
    check_restored(be, tmp_path / "rb" / "storage", back, writers.log, meta.stats)
    got = other.sample()
    assert all(consistent(r) for r in got.unbind(0))


def test_tdstore_export_while_two_writer_processes_extend_and_tdstore_import(be: Backend, tmp_path: Path, monkeypatch, capsys) -> None:
    store = filled_ring(be)
    assert be.server is not None
    with Writers(be, store) as writers:
        held_while_exporting(writers, monkeypatch)
        code = main(["export", store.td_id, str(tmp_path / "cli"), "--url", be.server.url, "--prefix", be.prefix, "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    meta = read_meta(tmp_path / "cli")
    assert f"{meta.overwritten_during_export} rows overwritten during the export (left absent)" in out.out
    code = main(["import", str(tmp_path / "cli"), "--td-id", "from-cli", "--url", be.server.url, "--prefix", be.prefix, "--no-progress"])
    assert code == 0, capsys.readouterr().err
    back = LazyStackedTensorDictStore.from_store(td_id="from-cli", **be.kwargs())
    check_restored(be, tmp_path / "cli", back, writers.log, meta.stats)


def test_a_checkpoint_without_stats_still_imports(be: Backend, tmp_path: Path) -> None:
    import json

    store = LazyStackedTensorDictStore(count=4, **be.kwargs())
    store.extend(lazy_stack([stamped(s) for s in range(3)]))
    store.sample(5)
    meta = _checkpoint.export_store(store, tmp_path / "ck")
    assert meta.stats["ins"] == 3 and meta.stats["smp"] == 5 and meta.overwritten_during_export == 0
    back = import_checkpoint(tmp_path / "ck", td_id="with-stats", **be.kwargs())
    assert back.stats()["inserted"] == 3 and back.stats()["sampled"] == 5
    doc = json.loads((tmp_path / "ck" / "tdstore.json").read_text())
    for name in ("stats", "overwritten_during_export"):  # as a checkpoint written before them
        del doc[name]
    (tmp_path / "ck" / "tdstore.json").write_text(json.dumps(doc))
    old = import_checkpoint(tmp_path / "ck", td_id="without-stats", **be.kwargs())
    assert old.stats()["inserted"] == 0 and old.write_count == 3
    assert not math.isnan(float(old[0]["obs"][0]))
