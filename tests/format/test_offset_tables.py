"""Rows of heterogeneous keys read as plain GETRANGEs from offset tables the handle keeps (``tdstore/_format/offsets.py``).

The kept tables are never trusted: the transaction reads each row's offsets (or the segment's
whole table) back, and a read whose offsets moved since is read again through ``read.lua``. Every
test here changes the store behind a reader's back and checks the reader still gets exactly what
was written, on every engine.
"""

from __future__ import annotations

import pytest
import torch
from helpers import round_trips, top_level_commands
from tensordict import NonTensorData, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, StoreDamagedError
from tdstore._format import wire as _wire
from tdstore._format.offsets import MAX_HOLD, OffsetTables

N = 64


def _element(i: int, length: int | None = None) -> TensorDict:
    n = i % 7 + 1 if length is None else length
    return TensorDict(
        obs=torch.full((3,), float(i)),
        tokens=torch.arange(n, dtype=torch.int64) + 100 * i,
        grid=torch.full((1 + i % 2, 2 + i % 3), i, dtype=torch.int16),  # two dims, differing
    )


@pytest.fixture(
    params=[(None, True), (256, True), (None, False), (256, False)], ids=["one-segment", "segments", "one-segment-rows", "segments-rows"]
)
def stores(request, backend, monkeypatch):
    """A writer's handle and a reader's handle on one store, and the local copy. The reader checks
    each segment's whole table, or (``-rows``) each row's two offsets."""
    segment_bytes, whole = request.param
    if not whole:
        monkeypatch.setattr(_wire, "TX_WHOLE_BYTES_PER_RANGE", 0)
    local = lazy_stack([_element(i) for i in range(N)])
    extra = {"segment_bytes": segment_bytes} if segment_bytes else {}
    writer = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs(), **extra)
    reader = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **backend.kwargs())
    yield writer, reader, [local[i] for i in range(N)]
    writer.clear_redis()


IDX = torch.tensor([40, 3, 17, 3, 60, 9, 25, 51, 33, 12, 1, 47, 22, 58, 6, 30])  # scattered, 3 twice


def _check(reader: LazyStackedTensorDictStore, els: list[TensorDict]) -> None:
    got = reader[IDX]
    for k, i in enumerate(IDX.tolist()):
        for key in ("obs", "tokens", "grid"):
            assert torch.equal(got[k][key], els[i][key]), (i, key)
    want = lazy_stack([els[i] for i in IDX.tolist()])
    for kw in ({"as_padded_tensor": True}, {"as_padded_tensor": True, "padding_side": "left", "padding_value": -1}):
        assert torch.equal(reader.get_at("tokens", IDX, **kw), want.get("tokens", **kw))
    nested = reader.get_at("tokens", IDX, as_nested_tensor=True)
    assert all(torch.equal(a, b) for a, b in zip(nested.unbind(), want.get("tokens", as_nested_tensor=True).unbind(), strict=True))


def test_reads_after_the_tables_are_kept_match_the_local_stack(stores):
    writer, reader, els = stores
    _check(reader, els)  # read.lua: the tables come back with the rows
    assert reader._engine.offsets.nbytes > 0
    _check(reader, els)  # transactions


def test_a_size_change_behind_the_reader_is_read_correctly(stores):
    writer, reader, els = stores
    _check(reader, els)
    for i, length in ((3, 30), (17, 1), (40, 0)):  # grow, shrink, empty: every later offset of the segment moves
        els[i] = _element(i, length)
        writer[i] = els[i]
        _check(reader, els)
    _check(reader, els)


def test_same_sizes_new_bytes_and_reshaped_records(stores):
    writer, reader, els = stores
    _check(reader, els)
    # same byte size everywhere (the offsets stay), new values, and a 2-dim element reshaped in place
    for i in (3, 9, 60):
        el = els[i].clone()
        el["tokens"] = -el["tokens"]
        el["grid"] = torch.arange(el["grid"].numel(), dtype=torch.int16).reshape(tuple(reversed(el["grid"].shape)))
        els[i] = el
        writer[i] = el
    _check(reader, els)


def test_a_ring_writer_moving_rows_under_a_sampler(stores):
    writer, reader, els = stores
    for step in range(6):
        batch = [_element(1000 + 7 * step + j, (step + j) % 9) for j in range(5)]
        state = writer.ring_state()
        writer.extend(lazy_stack(batch))
        for j, el in enumerate(batch):
            els[(state.cursor + j) % N] = el
        _check(reader, els)


def test_kept_tables_turn_reads_into_one_transaction(real):
    writer = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([_element(i) for i in range(N)]), **real.kwargs())
    reader = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **real.kwargs())
    assert reader.batch_size == (N,)  # the header read
    for read in (lambda: reader[IDX], lambda: reader.get_at("tokens", IDX, as_padded_tensor=True)):
        read()  # warm: scripts loaded, tables kept
        assert round_trips(top_level_commands(real.client, read)) == ["transaction"]
    # a size change: the reader's transaction finds the offsets moved and reads through read.lua
    writer[IDX[2].item()] = _element(int(IDX[2]), 33)
    assert round_trips(top_level_commands(real.client, lambda: reader[IDX])) == ["transaction", "evalsha"]
    assert round_trips(top_level_commands(real.client, lambda: reader[IDX])) == ["transaction"]
    writer.clear_redis()


@pytest.mark.parametrize("lost", ["o", "d", "s"])
def test_a_lost_table_or_data_key_is_damage_not_zeros(real, lost):
    writer = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([_element(i) for i in range(N)]), **real.kwargs())
    writer[IDX]  # tables kept
    leaf = writer._engine.header.leaves[("tokens",)]
    key = {"o": writer._engine.keys.offsets, "d": writer._engine.keys.data, "s": writer._engine.keys.shapes}[lost](leaf.number)
    real.client().delete(key)
    with pytest.raises(StoreDamagedError, match="tokens|:o:|:d:|:s:"):
        writer[IDX]
    with pytest.raises(StoreDamagedError):
        writer.get_at("tokens", IDX, as_padded_tensor=True)
    writer.clear_redis()


def test_no_tables_kept_past_the_budget(backend):
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([_element(i) for i in range(N)]), **backend.kwargs())
    s._engine.offsets = OffsetTables(max_bytes=8 * N)  # less than one table: reads stay with read.lua
    els = [_element(i) for i in range(N)]
    _check(s, els)
    _check(s, els)
    assert s._engine.offsets.nbytes == 0
    s.clear_redis()


def test_a_leaf_that_keeps_changing_is_left_to_the_script_for_longer_each_time(backend):
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([_element(i) for i in range(N)]), **backend.kwargs())
    tables = s._engine.offsets
    h = s._engine.header
    leaf = h.leaves[("tokens",)]
    tables.keep(h, leaf, 0, b"\0" * 8 * (N + 1))
    holds = []
    for _ in range(9):
        tables.changed(h, leaf)
        holds.append(tables._leaves[leaf.number].hold)
    assert holds == [0, 1, 3, 7, 15, 31, 63, MAX_HOLD, MAX_HOLD]
    # while held back, no table is asked for nor used; then the first read asks again
    ids = IDX.numpy()
    for _ in range(MAX_HOLD):
        assert tables.wanted(h, leaf, ids) == [] and tables.plan(h, s._engine.keys, leaf, ids) is None
    assert tables.wanted(h, leaf, ids) == [0]
    tables.keep(h, leaf, 0, b"\0" * 8 * (N + 1))
    tables.confirmed(h, leaf)
    assert tables._leaves[leaf.number].misses == 0
    tables.keep(h, leaf, 0, b"\0" * 8)  # a table of the wrong size (a key never written) is not kept
    assert tables.nbytes == 8 * (N + 1)
    s.clear_redis()


@pytest.mark.ring
def test_samples_of_a_full_ring_with_heterogeneous_keys(backend, real):
    writer = LazyStackedTensorDictStore(count=N, **backend.kwargs())
    els = [_element(i) for i in range(N + 5)]
    writer.extend(lazy_stack(els[:N]))
    writer.extend(lazy_stack(els[N:]))  # wrapped: slots 0..4 hold elements N..N+4
    slots = [els[N + s] if s < 5 else els[s] for s in range(N)]
    sampler = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **backend.kwargs())
    script = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **backend.kwargs())
    script._engine.transactions = False  # the same draws, sampled by read.lua
    for step in range(4):
        got = sampler.sample(24, generator=torch.Generator().manual_seed(step))
        want = script.sample(24, generator=torch.Generator().manual_seed(step))
        assert torch.equal(got.indices, want.indices) and torch.equal(got.generations, want.generations)
        for k, s in enumerate(got.indices.tolist()):
            for key in ("obs", "tokens", "grid"):
                assert torch.equal(got.td[k][key], slots[s][key]), (step, s, key)
        # (grid differs in two dims: a mask along the first cannot describe its padding)
        padded = sampler.sample(
            24, generator=torch.Generator().manual_seed(step), keys=["obs", "tokens"], as_padded_tensor=True, return_mask=True
        )
        assert torch.equal(padded.td["tokens"], want.td.get("tokens", as_padded_tensor=True))
        assert torch.equal(padded.td["masks", "tokens"].sum(-1), torch.tensor([slots[s]["tokens"].numel() for s in got.indices.tolist()]))
        # a writer moves rows of the sampled segment: the next sample is still exact
        batch = [_element(500 + 3 * step + j, 2 + (step + j) % 11) for j in range(3)]
        cursor = writer.ring_state().cursor
        writer.extend(lazy_stack(batch))
        for j, el in enumerate(batch):
            slots[(cursor + j) % N] = el
    if backend.name == "redis":
        # (the sampler above met changed tables in a row: it leaves grid to read.lua for a while)
        fresh = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **backend.kwargs())
        fresh.sample(16)  # read.lua: the ring is full, the tables come back with the rows
        assert round_trips(top_level_commands(real.client, lambda: fresh.sample(16))) == ["transaction"]
    writer.clear_redis()


def test_a_store_with_a_non_tensor_heterogeneous_key_reads_its_rows_as_a_transaction_too(real):
    els = [TensorDict(tokens=torch.arange(i % 5 + 1), note=NonTensorData("x" * (i % 9))) for i in range(N)]
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), **real.kwargs())
    s[IDX]  # read.lua: both keys' tables come back with the rows
    got = []
    assert round_trips(top_level_commands(real.client, lambda: got.append(s[IDX]))) == ["transaction"]
    for k, i in enumerate(IDX.tolist()):
        assert torch.equal(got[0][k]["tokens"], els[i]["tokens"]) and got[0][k]["note"] == "x" * (i % 9)
    s.clear_redis()


def test_keeping_a_table_again_counts_its_bytes_once():
    from types import SimpleNamespace

    from tdstore._format.segments import Segments

    h = SimpleNamespace(epoch="e", segments=Segments(4, 4))
    leaf = SimpleNamespace(number=1, version=1)
    tables = OffsetTables(max_bytes=60)
    tables.keep(h, leaf, 0, b"\0" * 40)
    rising = (
        torch.arange(5, dtype=torch.int64).numpy().astype("<i8").tobytes()
    )  # (a table that does not rise from 0 is refused: test_hostile.py)
    tables.keep(h, leaf, 0, rising)  # the same segment again: replaced, counted once
    assert tables.nbytes == 40 and tables._leaves[1].segments[0] == rising
    tables.changed(h, leaf)
    assert tables.nbytes == 0
