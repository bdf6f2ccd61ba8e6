"""Checkpoints (``tdstore._checkpoint.export_import``): rows, ring state, priorities and policy written to disk and restored.

Round trips run on redis-server and fakeredis; the torchrl ones go through ``rb.dumps``/``rb.loads``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Backend
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, lazy_stack, tensorclass

import tdstore
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._checkpoint import export_import as _checkpoint
from tdstore._checkpoint.export_import import CheckpointError, export_checkpoint, import_checkpoint, read_meta
from tdstore._front import upload as _upload
from tdstore.cli import main
from tdstore.server import EmbeddedServer


@pytest.fixture
def be(one_node: Backend) -> Backend:
    """redis-server and fakeredis (rings do not run on spread stores; the cluster adds nothing here)."""
    return one_node


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


def element(i: int) -> TensorDict:
    """Element ``i``: homogeneous, heterogeneous (``tok`` of ``1 + i % 4``), nested and non-tensor keys."""
    return TensorDict(
        obs=torch.full((3,), float(i)),
        tok=torch.arange(1 + i % 4) + 100 * i,
        nested=TensorDict(b=torch.full((2,), i, dtype=torch.int64), deep=TensorDict(c=torch.tensor([i % 2 == 0]))),
        txt=NonTensorData({"step": i, "name": f"t{i}"}),
    )


def assert_same_rows(a: Any, b: Any) -> None:
    """Every key of two stores read whole: the same values, element by element."""
    ta, tb = a.to_tensordict(), b.to_tensordict()
    assert set(ta.keys(True, True)) == set(tb.keys(True, True))
    if isinstance(ta, LazyStackedTensorDict):
        ea, eb = ta.tensordicts, tb.tensordicts
        assert len(ea) == len(eb)
        for x, y in zip(ea, eb, strict=True):
            for k in x.keys(True, True):
                vx, vy = x.get(k), y.get(k)
                if isinstance(vx, torch.Tensor):
                    assert vx.dtype == vy.dtype and torch.equal(vx, vy), k
                else:
                    assert vx == vy, k
    else:
        for k in ta.keys(True, True):
            assert torch.equal(ta.get(k), tb.get(k)), k


def header_fields(store: Any, *names: str) -> list[Any]:
    engine = LazyStackedTensorDictStore.stack_of(store)._engine
    return engine.command("HMGET", engine.keys.meta, *names)


def raw(store: Any, key: str) -> bytes:
    engine = LazyStackedTensorDictStore.stack_of(store)._engine
    return engine.command("GET", getattr(engine.keys, key))


# -- round trips ------------------------------------------------------------------------------------


def test_lazy_store_round_trip_keeps_every_key_and_a_wrapped_ring(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=6, **be.kwargs())
    store.extend(lazy_stack([element(i) for i in range(5)]))
    store.extend(lazy_stack([element(i) for i in range(5, 9)]))  # 9 writes into 6 slots: the ring wrapped
    assert store.ring_state() == (9, 3, 6)
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="restored", **be.kwargs())
    assert isinstance(back, LazyStackedTensorDictStore) and back.td_id == "restored"
    assert back.ring_state() == store.ring_state() == (9, 3, 6)
    assert_same_rows(store, back)
    slots = torch.arange(6)
    # generations follow from the ring write count: slot 0..2 written twice, 3..5 once
    from tdstore._ring.extend import generations

    assert generations(slots, back.write_count, 6).tolist() == [2, 2, 2, 1, 1, 1]
    assert back[1]["txt"] == {"step": 7, "name": "t7"}
    # the restored ring goes on where the old one stopped
    w = back.extend(lazy_stack([element(20)]))
    assert w.indices.tolist() == [3] and w.generations.tolist() == [2]


def test_dense_store_with_inner_dims_and_tensorclass_name_round_trip(be: Backend, tmp_path: Path) -> None:
    data = Step(obs=torch.randn(4, 3, 2), reward=torch.arange(12.0).reshape(4, 3), batch_size=[4, 3])
    store = TensorDictStore.from_tensordict(data, **be.kwargs())
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="dense-copy", tensorclass_cls=Step, **be.kwargs())
    assert isinstance(back, Step)
    assert back.tensorclass_path == store.tensorclass_path and back.tensorclass_path.endswith("Step")
    assert back.batch_size == store.batch_size == (4, 3)
    assert torch.equal(back.obs, data.obs) and torch.equal(back.reward, data.reward)


def test_lazy_store_with_stack_dim_1_round_trip(be: Backend, tmp_path: Path) -> None:
    local = lazy_stack([TensorDict(x=torch.randn(2, 1 + i), batch_size=[2]) for i in range(3)], dim=1)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **be.kwargs())
    export_checkpoint(store, tmp_path / "ck")
    meta = read_meta(tmp_path / "ck")
    assert (meta.stack_dim, meta.inner, meta.count) == (1, (2,), 3)
    assert not (tmp_path / "ck" / "storage_metadata.json").exists()  # not torchrl's layout: heterogeneous, inner dims
    back = import_checkpoint(tmp_path / "ck", td_id="sd1", **be.kwargs())
    assert back.batch_size == store.batch_size == (2, 3)
    for i in range(3):
        assert torch.equal(back[:, i]["x"], local[:, i]["x"])


def test_priorities_and_policy_are_restored_exactly(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=40, **be.kwargs())
    store.enable_priorities(alpha=0.6, max_times_sampled=50)
    store.set_rate_limit(min_size=4, samples_per_insert=4.0, error_buffer=1000.0)
    for k in range(6):  # 60 writes: wrapped; priorities vary
        store.extend(TensorDict(obs=torch.arange(10.0) + 10 * k, batch_size=[10]), priority=torch.rand(10) * 5 + 0.1)
    s = store.sample(32, timeout=10)
    store.update_priority(s.indices, torch.rand(32) + 0.5, generation=s.generations)
    store.sample(16, timeout=10)
    fields = ("rw", "pm", "lb", "sn", "rr", "sc")
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="prio", **be.kwargs())
    assert header_fields(back, *fields) == header_fields(store, *fields)
    assert back.sampling_policy == store.sampling_policy
    assert raw(back, "priorities") == raw(store, "priorities")  # the tree, leaves and sums, byte for byte
    assert raw(back, "times_sampled") == raw(store, "times_sampled")
    # the same distribution: every slot's probability as the restored store reports it equals the original's
    g = torch.Generator().manual_seed(0)
    a, b = store.sample(200, generator=g, timeout=10), back.sample(200, generator=torch.Generator().manual_seed(0), timeout=10)
    pa = dict(zip(a.indices.tolist(), a.probabilities.tolist(), strict=True))
    pb = dict(zip(b.indices.tolist(), b.probabilities.tolist(), strict=True))
    common = set(pa) & set(pb)
    assert len(common) > 5 and all(pa[i] == pb[i] for i in common)
    assert_same_rows(store, back)


def test_queue_cursor_is_restored(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=8, **be.kwargs())
    store.set_queue(True)
    store.extend(TensorDict(x=torch.arange(6), batch_size=[6]))
    assert store.pop(2).td["x"].tolist() == [0, 1]
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="queue", **be.kwargs())
    assert back.pop(3).td["x"].tolist() == [2, 3, 4]
    assert store.pop(3).td["x"].tolist() == [2, 3, 4]


def test_an_empty_ring_round_trips(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=5, **be.kwargs())
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="empty", **be.kwargs())
    assert back.capacity == 5 and back.write_count == 0 and not list(back.keys())
    back.extend(TensorDict(x=torch.ones(2), batch_size=[2]))
    assert back.ring_state() == (2, 2, 2)


def test_a_key_of_empty_elements_round_trips(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=4, **be.kwargs())
    store.extend(TensorDict(e=torch.zeros(4, 0), x=torch.arange(4.0), batch_size=[4]))
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="empty-elements", **be.kwargs())
    assert back["e"].shape == (4, 0) and back["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_import_refuses_an_existing_store_unless_replace(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=4, **be.kwargs())
    store.extend(TensorDict(x=torch.arange(4.0), batch_size=[4]))
    export_checkpoint(store, tmp_path / "ck")
    store.extend(TensorDict(x=torch.full((2,), 9.0), batch_size=[2]))
    with pytest.raises(FileExistsError, match="already exists"):
        import_checkpoint(tmp_path / "ck", **be.kwargs())
    assert store.write_count == 6  # untouched
    back = import_checkpoint(tmp_path / "ck", replace=True, **be.kwargs())
    assert back.td_id == store.td_id and back.write_count == 4 and back["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


# -- memory bounded by a chunk ----------------------------------------------------------------------


def test_export_and_import_go_in_chunks(be: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkpoint, "CHUNK_ELEMENTS", 3)
    store = LazyStackedTensorDictStore(count=10, **be.kwargs())
    store.extend(lazy_stack([element(i) for i in range(10)]))
    reads: list[tuple[int, int]] = []
    writes: list[tuple[int, int]] = []
    read_chunk, queue_chunk = _checkpoint._read_chunk, _upload._queue_chunk

    def spy_read(s: Any, h: Any, lo: int, hi: int) -> Any:
        reads.append((lo, hi))
        return read_chunk(s, h, lo, hi)

    def spy_queue(pipe: Any, keys: Any, header: Any, scans: Any, sizes: Any, het: Any, lo: int, hi: int) -> Any:
        writes.append((lo, hi))
        return queue_chunk(pipe, keys, header, scans, sizes, het, lo, hi)

    monkeypatch.setattr(_checkpoint, "_read_chunk", spy_read)
    monkeypatch.setattr(_upload, "_queue_chunk", spy_queue)
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="chunked", **be.kwargs())
    for chunks in (reads, writes):
        assert len(chunks) >= 4 and max(hi - lo for lo, hi in chunks) <= 3
        assert sorted(chunks)[0][0] == 0 and sorted(chunks)[-1][1] == 10
    assert_same_rows(store, back)


@pytest.mark.parametrize("late", [1, 3])
def test_export_while_the_ring_is_written_keeps_the_fence_and_leaves_overwritten_rows_absent(
    be: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late: int
) -> None:
    # (was: the export failed, "changed while it was exported (rw moved): stop its writers")
    monkeypatch.setattr(_checkpoint, "CHUNK_ELEMENTS", 2)
    store = LazyStackedTensorDictStore(count=6, **be.kwargs())
    store.extend(TensorDict(x=torch.arange(6.0), batch_size=[6]))
    store.extend(TensorDict(x=torch.arange(6.0, 8.0), batch_size=[2]))  # rw 8: slots 2..5 then 0, 1 oldest first
    read_chunk = _checkpoint._read_chunk
    chunks = []

    def racing(s: Any, h: Any, lo: int, hi: int) -> Any:
        chunks.append((lo, hi))
        if lo == 4:  # after the fence and slots 2, 3: writes overwrite slots 2 (read), 3 (read), 4 (not yet)
            store.extend(TensorDict(x=torch.full((late,), 60.0), batch_size=[late]))
        return read_chunk(s, h, lo, hi)

    monkeypatch.setattr(_checkpoint, "_read_chunk", racing)
    meta = _checkpoint.export_store(store, tmp_path / "ck")
    assert chunks == [(2, 4), (4, 6), (0, 2)]  # the fence's oldest rows first
    back = import_checkpoint(tmp_path / "ck", td_id="live", **be.kwargs())
    assert back.write_count == 8 and back.cursor == 2 and meta.ring["rw"] == 8
    if late == 1:  # the write landed on a slot read already: the checkpoint is the fence, whole
        assert meta.overwritten_during_export == 0 and "ho" not in meta.ring
        assert back["x"].tolist() == [6.0, 7.0, 2.0, 3.0, 4.0, 5.0]
        return
    # slot 4 was overwritten before it was read: writes 2, 3, 4 (the fence's oldest rows) are absent
    assert meta.overwritten_during_export == 3 and meta.ring["ho"] == 5
    assert back["x"][[5, 0, 1]].tolist() == [5.0, 6.0, 7.0]
    assert set(back.sample(200).indices.tolist()) == {5, 0, 1}  # the absent rows are never drawn
    with pytest.raises(ValueError, match="3 rows a checkpoint restore left absent"):
        back.enable_priorities(alpha=1.0)  # (they would weigh 1)
    back.extend(TensorDict(x=torch.full((3,), 9.0), batch_size=[3]))  # the next writes fill them: every slot holds a row again
    assert set(back.sample(400).indices.tolist()) == {0, 1, 2, 3, 4, 5}


def test_export_fails_when_the_schema_changes_meanwhile(be: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkpoint, "CHUNK_ELEMENTS", 2)
    store = LazyStackedTensorDictStore(count=6, **be.kwargs())
    store.extend(TensorDict(x=torch.arange(6.0), batch_size=[6]))
    read_chunk = _checkpoint._read_chunk

    def racing(s: Any, h: Any, lo: int, hi: int) -> Any:
        if lo == 2:
            store.extend(TensorDict(x=torch.ones(1), y=torch.ones(1), batch_size=[1]))  # a new key
        return read_chunk(s, h, lo, hi)

    monkeypatch.setattr(_checkpoint, "_read_chunk", racing)
    with pytest.raises(RuntimeError, match="schema or policy changed while it was exported"):
        export_checkpoint(store, tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and list(tmp_path.iterdir()) == []


def test_export_replaces_an_old_checkpoint_but_nothing_else(be: Backend, tmp_path: Path) -> None:
    store = LazyStackedTensorDictStore(count=3, **be.kwargs())
    store.extend(TensorDict(x=torch.arange(3.0), batch_size=[3]))
    export_checkpoint(store, tmp_path / "ck")
    store[0] = TensorDict(x=torch.tensor(7.0))
    export_checkpoint(store, tmp_path / "ck")
    assert import_checkpoint(tmp_path / "ck", td_id="again", **be.kwargs())["x"].tolist() == [7.0, 1.0, 2.0]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="something else"):
        export_checkpoint(store, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


# -- malformed checkpoints ------------------------------------------------------------------------


def _edit_meta(ck: Path, fn: Any) -> None:
    meta = json.loads((ck / "tdstore.json").read_text())
    fn(meta)
    (ck / "tdstore.json").write_text(json.dumps(meta))


def _set_key(i: int, field: str, value: Any) -> Any:
    return lambda m: m["keys"][i].__setitem__(field, value)


def _stem(ck: Path, layout: str) -> Path:
    return ck / next(k["file"] for k in json.loads((ck / "tdstore.json").read_text())["keys"] if k["layout"] == layout)


def _corrupt_offsets(ck: Path) -> None:
    f = _stem(ck, "ragged").with_suffix(".offsets")
    a = np.fromfile(f, dtype="<i8")
    a[2] += 8
    a.tofile(f)


def _corrupt_doc(ck: Path) -> None:
    f = _stem(ck, "json").with_suffix(".data")
    b = bytearray(f.read_bytes())
    b[0:1] = b"{"
    f.write_bytes(bytes(b))


def _corrupt_tree(ck: Path) -> None:
    f = ck / "_tdstore" / "priorities.f64"
    a = np.fromfile(f, dtype="<f8")
    a[1] = np.nan
    a.tofile(f)


BAD = {
    "not json": lambda ck: (ck / "tdstore.json").write_text("{nope"),
    "format": lambda ck: _edit_meta(ck, lambda m: m.__setitem__("format", "pickle")),
    "version": lambda ck: _edit_meta(ck, lambda m: m.__setitem__("version", 99)),
    "count": lambda ck: _edit_meta(ck, lambda m: m.__setitem__("count", -1)),
    "dtype": lambda ck: _edit_meta(ck, _set_key(0, "dtype", "object")),
    "layout": lambda ck: _edit_meta(ck, _set_key(0, "layout", "pickle")),
    "escape": lambda ck: _edit_meta(ck, _set_key(0, "file", "../../etc/passwd")),
    "shape": lambda ck: _edit_meta(ck, _set_key(0, "shape", [4])),
    "short file": lambda ck: (ck / "obs.memmap").write_bytes(b"\0" * 5),
    "offsets": _corrupt_offsets,
    "non-tensor doc": _corrupt_doc,
    "policy": lambda ck: _edit_meta(ck, lambda m: m["ring"].__setitem__("policy", {"alpha": -1})),
    "ring": lambda ck: _edit_meta(ck, lambda m: m["ring"].__setitem__("rr", 10**6)),
    "tree": _corrupt_tree,
    "missing tree": lambda ck: (ck / "_tdstore" / "priorities.f64").unlink(),
}


@pytest.mark.parametrize("damage", sorted(BAD))
def test_a_malformed_checkpoint_is_refused_before_anything_is_written(real: Backend, tmp_path: Path, damage: str) -> None:
    store = LazyStackedTensorDictStore(count=6, **real.kwargs())
    store.enable_priorities(alpha=0.5)
    store.extend(lazy_stack([element(i) for i in range(6)]))
    export_checkpoint(store, tmp_path / "ck")
    store.clear_redis()
    BAD[damage](tmp_path / "ck")
    with pytest.raises(CheckpointError, match="not a valid tdstore checkpoint"):
        import_checkpoint(tmp_path / "ck", **real.kwargs())
    assert real.keys() == []


def test_a_directory_without_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no tdstore.json"):
        read_meta(tmp_path)


# -- torchrl ----------------------------------------------------------------------------------------

torchrl = pytest.importorskip("torchrl")


def test_torchrl_buffer_dumps_empty_loads_samples_the_same_rows(be: Backend, tmp_path: Path) -> None:
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(20, batch_size=8, sampler="prioritized", **be.kwargs())
    rb.extend(TensorDict(obs=torch.arange(30.0)[:, None].expand(30, 4).clone(), step=torch.arange(30), batch_size=[30]))
    s = rb.sample()
    rb.update_priority(s["index"], torch.rand(8) + 1)
    before = rb[:]
    tree = raw(rb.storage._store, "priorities")
    td_id = rb.storage.td_id
    rb.dumps(tmp_path / "rb")
    rb.empty()
    rb2 = replay_buffer(20, batch_size=8, sampler="prioritized", **be.kwargs())
    own = rb2.storage.td_id
    rb2.loads(tmp_path / "rb")
    # the emptied buffer's store is still there, and not rb2's: rb2 restores under its own id
    assert rb2.storage.td_id == own != td_id and len(rb2) == 20 and len(rb) == 0
    assert rb2.storage._store.ring_state() == (30, 10, 20)
    assert (rb2[:] == before).all()
    assert raw(rb2.storage._store, "priorities") == tree
    batch = rb2.sample()
    assert (batch["obs"][:, 0] == batch["step"].float()).all() and bool((batch["step"] >= 10).all())


def test_torchrl_buffer_restored_on_a_wiped_server(tmp_path: Path) -> None:
    from tdstore.torchrl import replay_buffer

    with EmbeddedServer() as first:
        rb = replay_buffer(16, url=first.url, batch_size=4)
        rb.extend(TensorDict(obs=torch.randn(10, 3), batch_size=[10]))
        before, td_id = rb[:], rb.storage.td_id
        rb.dumps(tmp_path / "rb")
    with EmbeddedServer() as second:  # nothing of the first server survives
        rb2 = replay_buffer(16, url=second.url, batch_size=4)
        own = rb2.storage.td_id  # the new buffer's placeholder store, deleted by loads
        rb2.loads(tmp_path / "rb")
        assert rb2.storage.td_id == td_id and len(rb2) == 10
        assert torch.equal(rb2[:]["obs"], before["obs"])
        assert rb2.sample()["obs"].shape == (4, 3)
        assert own.encode() not in {m for m in second.client().smembers("tensordict:stores")}


def test_torchrl_lazy_tensor_storage_reads_a_checkpoint_and_back(be: Backend, tmp_path: Path) -> None:
    from torchrl.data import LazyTensorStorage

    store = LazyStackedTensorDictStore(count=12, **be.kwargs())
    data = TensorDict(obs=torch.randn(15, 3), nested=TensorDict(b=torch.arange(15), batch_size=[15]), batch_size=[15])
    store.extend(data[:10])
    store.extend(data[10:])
    export_checkpoint(store, tmp_path / "ck")
    lts = LazyTensorStorage(12)
    lts.loads(tmp_path / "ck")
    assert len(lts) == 12
    assert torch.equal(lts._storage["obs"], store["obs"]) and torch.equal(lts._storage["nested", "b"], store["nested", "b"])
    # and torchrl's own checkpoint into tdstore: a ring of len writes
    lts2 = LazyTensorStorage(8)
    lts2.set(torch.arange(5), data[:5])
    lts2.dumps(tmp_path / "lts")
    back = import_checkpoint(tmp_path / "lts", td_id="from-torchrl", **be.kwargs())
    assert isinstance(back, TensorDictStore) and back.ring_state() == (5, 5, 5)  # dense, as LazyTensorStorage is
    assert torch.equal(back["obs"][:5], data["obs"][:5]) and torch.equal(back["nested", "b"][:5], data["nested", "b"][:5])


# -- command line -----------------------------------------------------------------------------------


def test_cli_export_and_import(real: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert real.server is not None
    url, prefix = real.server.url, real.prefix
    store = LazyStackedTensorDictStore(count=5, td_id="cli-src", **real.kwargs())
    store.extend(lazy_stack([element(i) for i in range(7)][:5]))
    base = ["--url", url, "--prefix", prefix, "--no-progress"]
    assert main(["export", "cli-src", str(tmp_path / "ck"), *base]) == 0
    assert "exported store cli-src" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "ck"), *base]) == 2  # the store exists
    assert "--replace" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "ck"), "--td-id", "cli-copy", *base]) == 0
    assert_same_rows(store, LazyStackedTensorDictStore.from_store(td_id="cli-copy", **real.kwargs()))
    assert main(["import", str(tmp_path / "ck"), "--replace", *base]) == 0
    assert main(["export", "no-such-store", str(tmp_path / "x"), *base]) == 2
    shutil.copy(tmp_path / "ck" / "tdstore.json", tmp_path / "copy.json")
    (tmp_path / "ck" / "tdstore.json").write_text("[]")
    assert main(["import", str(tmp_path / "ck"), "--td-id", "bad", *base]) == 1
    assert "not a valid tdstore checkpoint" in capsys.readouterr().err


def test_package_exports_the_checkpoint_calls() -> None:
    assert tdstore.export_checkpoint is export_checkpoint and tdstore.import_checkpoint is import_checkpoint


def test_round_trip_on_every_backend_sets_the_ring_state_in_one_call(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-server, fakeredis and a Redis Cluster (a spread store has no ring: its rows only)."""
    spread = bool(backend.kwargs().get("spread"))
    if spread:
        store: Any = TensorDictStore.from_tensordict(TensorDict(x=torch.arange(12.0), batch_size=[12]), **backend.kwargs())
    else:
        store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
        store.enable_priorities(alpha=1.0)
        store.extend(lazy_stack([element(i) for i in range(8)]), priority=torch.arange(1.0, 9.0))
        store.extend(lazy_stack([element(i) for i in range(8, 11)]), priority=2.0)
    export_checkpoint(store, tmp_path / "ck")
    calls: list[str] = []
    call = _checkpoint.scripts.call

    def counting(client: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return call(client, name, *args, **kwargs)

    monkeypatch.setattr(_checkpoint.scripts, "call", counting)
    back = import_checkpoint(tmp_path / "ck", td_id="every-backend", **backend.kwargs())
    assert calls.count("restore") == (0 if spread else 1)
    assert_same_rows(store, back)
    if not spread:
        assert back.ring_state() == store.ring_state() == (11, 3, 8)
        assert raw(back, "priorities") == raw(store, "priorities")


# -- stores of the reference tensordict.store ---------------------------------------------------------


def _reference_kwargs(real: Backend) -> dict[str, Any]:
    assert real.server is not None
    url = real.server.url
    if url.startswith("unix://"):
        return {"unix_socket_path": url[len("unix://") :].split("?")[0], "prefix": real.prefix}
    host, port = url.split("://")[1].split("/")[0].rsplit(":", 1)
    return {"host": host, "port": int(port), "prefix": real.prefix}


def test_a_dense_reference_store_is_copied_into_tdstore(real: Backend) -> None:
    from tensordict.store import TensorDictStore as ReferenceStore

    from tdstore._checkpoint.reference import import_reference

    data = Step(obs=torch.randn(5, 3), reward=torch.arange(5.0), batch_size=[5])
    ref = ReferenceStore.from_tensordict(data, **_reference_kwargs(real))
    with pytest.raises(KeyError, match="import-reference"):
        TensorDictStore.from_store(td_id=ref._td_id, **real.kwargs())
    copy = import_reference(ref._td_id, **real.kwargs())
    assert copy.td_id == ref._td_id and copy.tensorclass_path == ref._tensorclass_cls
    again = TensorDictStore.from_store(td_id=ref._td_id, tensorclass_cls=Step, **real.kwargs())
    assert isinstance(again, Step) and torch.equal(again.obs, data.obs) and torch.equal(again.reward, data.reward)
    assert torch.equal(ref["obs"], data.obs)  # the reference's keys are untouched


def test_a_lazy_reference_store_is_copied_into_tdstore(real: Backend) -> None:
    from tensordict.store import LazyStackedTensorDictStore as ReferenceLazy

    local = lazy_stack(
        [TensorDict(obs=torch.full((2, 3), float(i)), tok=torch.arange(2 * (i + 1)).reshape(2, i + 1), batch_size=[2]) for i in range(4)],
        dim=1,
    )
    ref = ReferenceLazy.from_lazy_stack(local, **_reference_kwargs(real))
    copy = tdstore.import_reference(ref._td_id, new_td_id="lazy-copy", **real.kwargs())
    assert isinstance(copy, LazyStackedTensorDictStore) and copy.batch_size == local.batch_size == (2, 4)
    for i in range(4):
        assert torch.equal(copy[:, i]["obs"], local[:, i]["obs"]) and torch.equal(copy[:, i]["tok"], local[:, i]["tok"])


def test_reference_json_values_are_copied_and_pickled_ones_refused(real: Backend) -> None:
    from tensordict.store import TensorDictStore as ReferenceStore

    from tdstore._checkpoint.reference import ReferenceStoreError, import_reference

    ref = ReferenceStore.from_tensordict(TensorDict(x=torch.zeros(3), batch_size=[3]), **_reference_kwargs(real))
    ref.set("run", NonTensorData({"name": "exp-1"}, batch_size=[3]))
    copy = import_reference(ref._td_id, new_td_id="json-copy", **real.kwargs())
    assert copy[2]["run"] == {"name": "exp-1"} and copy["x"].tolist() == [0.0, 0.0, 0.0]
    ref.set("odd", NonTensorData({1, 2}, batch_size=[3]))  # a set: the reference pickles it
    before = real.keys()
    with pytest.raises(ReferenceStoreError, match="never unpickles"):
        import_reference(ref._td_id, **real.kwargs())
    assert real.keys() == before


def test_cli_import_reference(real: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    from tensordict.store import TensorDictStore as ReferenceStore

    assert real.server is not None
    ref = ReferenceStore.from_tensordict(TensorDict(x=torch.arange(4.0), batch_size=[4]), **_reference_kwargs(real))
    base = ["--url", real.server.url, "--prefix", real.prefix, "--no-progress"]
    assert main(["ls", *base[:4]]) == 0
    err = capsys.readouterr().err
    assert ref._td_id in err and "import-reference" in err
    assert main(["ls", "--json", *base[:4]]) == 0
    assert json.loads(capsys.readouterr().out)["reference"] == [ref._td_id]
    assert main(["import-reference", ref._td_id, "--td-id", "from-ref", *base]) == 0
    assert "copied the tensordict.store store" in capsys.readouterr().out
    assert TensorDictStore.from_store(td_id="from-ref", **real.kwargs())["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert main(["import-reference", "no-such-store", *base]) == 2
