"""Checkpoints are input from outside (issue 38): hostile checkpoint folders refused before anything changes.

Each edit of ``tools/faults/checkpoints.py``'s ``HOSTILE`` (a buffer's own ``rb.dumps``, edited) goes through
``import_checkpoint``, ``tdstore import`` and ``rb.loads`` of the buffer that wrote it: each raises
``CheckpointError`` (the command line: one line, exit 1) and the server holds exactly what it held before,
every key byte for byte, the buffer its rows. On the code before this change every one of them was accepted,
failed after writing, or raised a raw ``RecursionError``/``StoreDamagedError`` (the fault case's report on it:
33 of 33 checks FAIL). Also: another user's td_id is never replaced, 1,500 keys import under ``ulimit -n
256``, a checkpoint's tensorclass is resolved as ``from_store`` resolves one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Backend
from helpers import load_tool
from tensordict import TensorDict, tensorclass

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._checkpoint import export_import as _checkpoint
from tdstore._checkpoint.export_import import CheckpointError, import_checkpoint
from tdstore._format import tensorclass as _tensorclass

pytest.importorskip("torchrl")

from tdstore.torchrl import replay_buffer  # noqa: E402

hostile = load_tool("faults.checkpoints")
probes = load_tool("_probes")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def be(one_node: Backend) -> Backend:
    """redis-server and fakeredis (a ring runs on one node)."""
    return one_node


def snapshot(be: Backend) -> dict[bytes, Any]:
    """Every key under the test's prefix with its content."""
    return probes.raw_snapshot(be.client(), be.prefix)


def edited(be: Backend, tmp_path: Path, case: str) -> tuple[Any, Path]:
    """A buffer (one row written since its checkpoint) and its checkpoint, edited by ``case``."""
    rb, ck = hostile.dumped(be.kwargs(), tmp_path / "rb")
    outside = tmp_path / "outside"
    outside.mkdir()
    hostile.HOSTILE[case](ck, outside)
    return rb, ck


@pytest.mark.parametrize("case", sorted(hostile.HOSTILE))
def test_import_checkpoint_refuses_and_writes_nothing(be: Backend, tmp_path: Path, case: str) -> None:
    _, ck = edited(be, tmp_path, case)
    before = snapshot(be)
    with pytest.raises(CheckpointError, match="not a valid tdstore checkpoint"):
        import_checkpoint(ck, td_id="copy", **be.kwargs())
    assert snapshot(be) == before


@pytest.mark.parametrize("case", sorted(hostile.HOSTILE))
def test_rb_loads_refuses_and_keeps_the_buffer(be: Backend, tmp_path: Path, case: str) -> None:
    rb, _ = edited(be, tmp_path, case)
    rows, before = hostile.content(rb), snapshot(be)
    with pytest.raises(CheckpointError, match="not a valid tdstore checkpoint"):
        rb.loads(tmp_path / "rb")
    assert snapshot(be) == before and hostile.content(rb) == rows and len(rb) == hostile.WRITTEN + 1
    rb.extend(hostile.rows(20, 1))  # the buffer goes on as before
    assert len(rb) == hostile.WRITTEN + 2


@pytest.mark.parametrize("case", sorted(hostile.HOSTILE))
def test_cli_import_prints_one_line_and_exits_1(real: Backend, tmp_path: Path, case: str) -> None:
    assert real.server is not None
    _, ck = edited(real, tmp_path, case)
    before = snapshot(real)
    rc, err = hostile.cli_import(real.server.url, real.prefix, ck, "copy")
    assert hostile.one_clear_line(rc, err), (rc, err)
    assert "tdstore import: failed:" in err and "not a valid tdstore checkpoint" in err
    assert snapshot(real) == before


def test_cli_import_of_a_deep_checkpoint_in_a_process_has_no_traceback(real: Backend, tmp_path: Path) -> None:
    assert real.server is not None
    _, ck = edited(real, tmp_path, "deep nesting")
    proc = subprocess.run(
        [sys.executable, "-m", "tdstore", "import", str(ck), "--url", real.server.url, "--prefix", real.prefix, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_rb_loads_never_replaces_another_users_store(be: Backend, tmp_path: Path) -> None:
    theirs = LazyStackedTensorDictStore(count=hostile.SLOTS, td_id="someone-else", **be.kwargs())  # made, nothing written yet
    _, ck = hostile.dumped(be.kwargs(), tmp_path / "rb")
    ck.joinpath("tdstore.json").write_text(json.dumps({**json.loads(ck.joinpath("tdstore.json").read_text()), "td_id": "someone-else"}))
    before = {k: v for k, v in snapshot(be).items() if b"{someone-else}" in k}
    rb2 = replay_buffer(hostile.SLOTS, batch_size=4, sampler="prioritized", ragged=True, **be.kwargs())
    own = rb2.storage.td_id
    rb2.loads(tmp_path / "rb")  # lands on its own id
    assert rb2.storage.td_id == own and len(rb2) == hostile.WRITTEN
    assert {k: v for k, v in snapshot(be).items() if b"{someone-else}" in k} == before
    assert theirs.capacity == hostile.SLOTS and theirs.write_count == 0
    with pytest.raises(FileExistsError, match="already exists"):
        import_checkpoint(ck, **be.kwargs())
    assert {k: v for k, v in snapshot(be).items() if b"{someone-else}" in k} == before


def test_a_checkpoint_of_1500_keys_imports_under_ulimit_n_256(real: Backend, tmp_path: Path) -> None:
    assert real.server is not None
    ck = hostile.many_keys_checkpoint(tmp_path / "many")
    proc = hostile.import_under_fd_limit(ck, real.server.url, real.prefix, 256)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1500", "6.0"]


def test_a_failure_after_the_commit_leaves_nothing_behind(be: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore call fails after the rows were committed, the header meanwhile damaged by another client
    (it no longer reads back): every key the import made is deleted all the same (before: they stayed, with
    no time to live, and ``clear_redis()``/``tdstore rm`` could not remove them)."""
    _, ck = hostile.dumped(be.kwargs(), tmp_path / "rb")
    before = snapshot(be)

    def fails(engine: Any, root: Path, meta: Any) -> None:
        engine.command("HSET", engine.keys.meta, "inner", "[7]")
        engine.command("HINCRBY", engine.keys.meta, "version", 1)
        raise RuntimeError("the restore call failed")

    monkeypatch.setattr(_checkpoint, "_restore_ring", fails)
    with pytest.raises(RuntimeError, match="restore call failed"):
        import_checkpoint(ck, td_id="copy", **be.kwargs())
    assert snapshot(be) == before


@tensorclass
class Step:
    obs: torch.Tensor


def test_rb_loads_resolves_a_tensorclass_as_from_store_does(be: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered (or of an imported module, by ``__dict__``): found; never by attribute lookup on a module
    (a lazy ``__getattr__`` would import what the file names)."""
    looked_up: list[str] = []
    module = types.ModuleType("hostile_lazy_module")
    module.__getattr__ = lambda name: looked_up.append(name)  # type: ignore[attr-defined]  # what numpy's lazy imports do
    monkeypatch.setitem(sys.modules, "hostile_lazy_module", module)
    _, ck = hostile.dumped(be.kwargs(), tmp_path / "rb")
    saved = json.loads((ck / "store.json").read_text())

    def loads_with(name: str) -> Any:
        (ck / "store.json").write_text(json.dumps({**saved, "tensorclass": name}))
        rb = replay_buffer(hostile.SLOTS, batch_size=4, sampler="prioritized", ragged=True, **be.kwargs())
        rb.loads(tmp_path / "rb")
        return rb.storage._tensorclass_type

    assert loads_with("hostile_lazy_module.f2py") is None and looked_up == []
    monkeypatch.setitem(_tensorclass._REGISTRY, f"{Step.__module__}.{Step.__qualname__}", Step)  # (register_tensorclass, undone after)
    assert loads_with(f"{Step.__module__}.{Step.__qualname__}") is Step


# -- what rb.dumps wrote, through tdstore import; the store's time to live (issue 42 item 6) -------------


def test_tdstore_import_of_the_folder_rb_dumps_wrote(real: Backend, tmp_path: Path) -> None:
    """``tdstore import DIR`` of ``rb.dumps(DIR)`` (a torchrl buffer's: ``DIR/storage`` beside its writer's
    state) restores the rows without torchrl's ``"index"`` key, its ring continuing at the writer's cursor."""
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    assert real.server is not None
    src = TensorDictReplayBuffer(storage=LazyTensorStorage(6), batch_size=4)  # its writer stores "index" in each row
    src.extend(TensorDict(a=torch.arange(8), batch_size=[8]))  # wrapped: the cursor is at 2
    src.dumps(tmp_path / "rb")
    rc, err = hostile.cli_import(real.server.url, real.prefix, tmp_path / "rb", "from-dump")
    assert rc == 0, err
    store = TensorDictStore.from_store(td_id="from-dump", **real.kwargs())  # dense, as LazyTensorStorage is
    assert set(store.keys()) == {"a"} and store["a"].tolist() == [6, 7, 2, 3, 4, 5]
    assert store.ring_state()[0] % 6 == 2  # the next write goes to the writer's cursor


def test_export_then_import_keeps_the_stores_time_to_live(be: Backend, tmp_path: Path) -> None:
    from tdstore import export_checkpoint

    store = LazyStackedTensorDictStore(count=4, ttl=600, **be.kwargs())
    store.extend(TensorDict(x=torch.arange(4.0), batch_size=[4]))
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="with-ttl", **be.kwargs())
    engine = LazyStackedTensorDictStore.stack_of(back)._engine
    assert 0 < int(engine.command("PTTL", engine.keys.meta)) <= 600_000
    again = import_checkpoint(tmp_path / "ck", td_id="given-ttl", ttl=5, **be.kwargs())  # a ttl given wins
    engine = LazyStackedTensorDictStore.stack_of(again)._engine
    assert 0 < int(engine.command("PTTL", engine.keys.meta)) <= 5_000
